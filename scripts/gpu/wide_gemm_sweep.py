"""On the GPU: the encoder's many-row persistent TMA GEMM (:func:`miaohui.models.wide_gemm.wide_linear`) over its
configurations against cuBLAS — what the engine runs today — for an encoder layer's four GEMMs at 4,096 and 16,384
rows (32×128 and 128×128), fp16, random weights.

Per (GEMM, M): cuBLAS (``F.linear`` with bias; for the FFN's first GEMM ``torch._addmm_activation`` with its GELU
epilogue, as the engine builds it), then every ``WIDE_SWEEP`` configuration; each a CUDA graph of 20 calls over a few
weight copies in turn (``decode_kernel_probe._time_graph``), the same input (at these sizes the layer's input was just
written by the kernel before, so it sits in L2 in the engine too). A configuration Triton cannot compile (shared
memory) is recorded as an error. The best configuration is checked against fp32; the per-layer sums say what 12
layers would gain.

    python3 scripts/gpu/wide_gemm_sweep.py --out /tmp/wgemm
    python3 scripts/gpu/wide_gemm_sweep.py --hidden 384 --inter 1536 --out /tmp/wgemm_e5   # e5-small's widths
    TRITON_INTERPRET=1 python3 scripts/gpu/wide_gemm_sweep.py --device cpu --out /tmp/wgemm   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from decode_kernel_probe import _rotating, _time_graph
from encoder_gemm_sweep import HIDDEN, INTER, _cublas, gemms
from torch.nn import functional as F

from miaohui.models.wide_gemm import WIDE_SWEEP, wide_linear

REPS = 20


def sweep(device: str, hidden: int, inter: int, rows: tuple[int, ...], configs: list[Any], out: Path) -> dict[str, Any]:
    """Times every product at every row count; ``out`` gets the report so far after each (a call cut short by its
    time limit keeps what it measured)."""
    cuda = device == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    report: dict[str, Any] = {"rows": [], "best": [], "hidden": hidden, "intermediate": inter}
    for m in rows:
        for name, (n, k, gelu) in gemms(hidden, inter).items():
            copies = 4 if cuda else 1
            wbs = [
                (torch.randn(n, k, device=device, dtype=dtype) * 0.03, torch.randn(n, device=device, dtype=dtype))
                for _ in range(copies)
            ]
            x = torch.randn(m, k, device=device, dtype=dtype)
            want = F.linear(x.float(), wbs[0][0].float(), wbs[0][1].float())
            want = F.gelu(want, approximate="tanh") if gelu else want
            cublas_us = _time_graph(_rotating(_cublas(gelu and cuda), x, wbs), REPS, cuda)
            best: tuple[float, Any] | None = None
            for cfg in configs:
                run = _rotating(lambda x, wb, c=cfg, g=gelu: wide_linear(x, wb[0], wb[1], c, gelu=g), x, wbs)
                t0 = time.perf_counter()
                try:
                    us = _time_graph(run, REPS, cuda)
                except Exception as exc:  # a configuration Triton cannot compile is a finding, not a stop
                    report["rows"].append({"gemm": name, "m": m, "config": cfg, "error": repr(exc)[:200]})
                    continue
                report["rows"].append({"gemm": name, "m": m, "config": cfg, "us": us,
                                       "wall_s": round(time.perf_counter() - t0, 2)})  # fmt: skip
                if best is None or us < best[0] or not cuda:
                    best = (us, cfg)
            if best is None:
                errors = [r["error"] for r in report["rows"] if r["gemm"] == name and r["m"] == m and "error" in r]
                print(json.dumps({"gemm": name, "m": m, "error": errors[0] if errors else "no configuration"}))
                continue
            got = wide_linear(x, wbs[0][0], wbs[0][1], best[1], gelu=gelu).float()
            flops = 2.0 * m * n * k
            entry = {"gemm": name, "m": m, "n": n, "k": k, "config": best[1], "us": best[0], "cublas_us": cublas_us,
                     "tflops": flops / best[0] / 1e6, "cublas_tflops": flops / cublas_us / 1e6,
                     "rel_err": float((got - want).abs().max() / want.abs().max())}  # fmt: skip
            report["best"].append(entry)
            print(json.dumps(entry), flush=True)
            out.write_text(json.dumps(report, indent=1))
            del wbs
    for m in sorted({e["m"] for e in report["best"]}):
        at = [e for e in report["best"] if e["m"] == m]
        report[f"layer_us_m{m}"] = {
            "wide": sum(e["us"] for e in at),
            "cublas": sum(e["cublas_us"] for e in at),
            "best_of_both": sum(min(e["us"], e["cublas_us"]) for e in at),
        }
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="768: BERT-base; 384: multilingual-e5-small")
    ap.add_argument("--inter", type=int, default=INTER, help="3072: BERT-base; 1536: multilingual-e5-small")
    ap.add_argument("--rows", default="4096,16384")
    ap.add_argument("--out", type=Path, default=Path("/tmp/wgemm"))
    args = ap.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on the CPU run it under TRITON_INTERPRET=1 (Triton's interpreter)")
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    rows = tuple(int(r) for r in args.rows.split(",")) if cuda else (40,)
    hidden, inter = (args.hidden, args.inter) if cuda else (args.hidden // 24, args.inter // 24)
    configs = WIDE_SWEEP if cuda else [(16, 16, 16, 8, 3, 4, 0), (32, 16, 16, 8, 3, 4, 1)]
    with torch.inference_mode():
        report = sweep(args.device, hidden, inter, rows, configs, args.out / "wide_gemm_sweep.json")
    shape = f"hidden {args.hidden}, FFN {args.inter}"
    report |= {"model": f"encoder GEMM shapes ({shape}), fp16 (random weights)", "torch": torch.__version__}
    if cuda:
        import triton

        report |= {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__}
    for key, v in report.items():
        if key.startswith("layer_us_m"):
            print(f"{key}: wide {v['wide']:.1f} µs, cuBLAS {v['cublas']:.1f}, best of both {v['best_of_both']:.1f}")
    (args.out / "wide_gemm_sweep.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
