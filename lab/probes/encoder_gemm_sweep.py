"""On the GPU: the encoder's few-row Triton GEMM (:func:`miaohui.models.skinny_gemm.skinny_linear`) over its
configurations against cuBLAS for an encoder layer's four GEMMs (BERT-base's by default) at M = 16, 128 and 512 rows
(1×16, 1×128, 8×64), fp16, random weights.

Per (GEMM, M): cuBLAS (``F.linear`` with bias; for the FFN's first GEMM ``torch._addmm_activation`` with its GELU
epilogue, as the engine builds it), then every ``SKINNY_SWEEP`` configuration with BLOCK_M ≤ M; each a CUDA graph of
40 calls over weights rotated past L2 (:mod:`lab.harness`). The best configuration is checked against fp32 and the
per-layer sums say what a 12-layer encoder would gain. ``scripts/gpu/tune.py`` times the chain of each width's best
configurations with ``pdl_probe``.

    python -m lab.probes.encoder_gemm_sweep --out /tmp/egemm
    python -m lab.probes.encoder_gemm_sweep --hidden 384 --inter 1536 --rows 16,128 --out /tmp/e5gemm   # e5-small
    TRITON_INTERPRET=1 python -m lab.probes.encoder_gemm_sweep --device cpu --out /tmp/egemm   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from lab.harness import rotating, time_graph, write_report
from miaohui.models.skinny_gemm import SKINNY_SWEEP, skinny_linear
from miaohui.models.tuning import products

HIDDEN, INTER = 768, 3072


def gemms(hidden: int = HIDDEN, inter: int = INTER) -> dict[str, tuple[int, int, bool]]:
    """An encoder layer's GEMMs: name → (N, K, GELU epilogue)."""
    return {name: (n, k, name == "ffn_in") for name, (n, k) in products(hidden, inter).items()}


def _cublas(gelu: bool) -> Any:
    def run(x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if gelu:
            return torch._addmm_activation(wb[1], x, wb[0].t(), use_gelu=True)
        return F.linear(x, wb[0], wb[1])

    return run


def sweep(
    device: str, tiny: bool, hidden: int = HIDDEN, inter: int = INTER, rows: tuple[int, ...] = (16, 128, 512)
) -> dict[str, Any]:
    cuda = device == "cuda"
    dtype = torch.float16 if cuda else torch.float32  # the interpreter has no fp16 dot on every path
    report: dict[str, Any] = {"rows": [], "best": [], "hidden": hidden, "intermediate": inter}
    for m in rows if not tiny else (16, 40):
        for name, (n, k, gelu) in gemms(hidden, inter).items():
            if tiny:
                n, k = n // 24, k // 24
            copies = max(1, min(40, (400 << 20) // (n * k * 2))) if cuda else 1
            wbs = [
                (torch.randn(n, k, device=device, dtype=dtype) * 0.03, torch.randn(n, device=device, dtype=dtype))
                for _ in range(copies)
            ]
            x = torch.randn(m, k, device=device, dtype=dtype)
            want = F.linear(x.float(), wbs[0][0].float(), wbs[0][1].float())
            want = F.gelu(want, approximate="tanh") if gelu else want
            cublas_us = time_graph(rotating(_cublas(gelu and cuda), x, items=wbs), 40, cuda)
            best: tuple[float, Any] | None = None
            configs = [c for c in SKINNY_SWEEP if c[0] <= m]
            for cfg in configs[:3] if tiny else configs:
                run = rotating(lambda x, wb, c=cfg, g=gelu: skinny_linear(x, wb[0], wb[1], c, gelu=g), x, items=wbs)
                try:
                    us = time_graph(run, 40, cuda)
                except Exception as exc:  # a configuration Triton cannot compile is a finding, not a stop
                    report["rows"].append({"gemm": name, "m": m, "config": cfg, "error": repr(exc)[:200]})
                    continue
                report["rows"].append({"gemm": name, "m": m, "config": cfg, "us": us})
                if best is None or us < best[0] or not cuda:
                    best = (us, cfg)
            if best is None:  # every configuration failed: report the first error and go on
                errors = [r["error"] for r in report["rows"] if r["gemm"] == name and r["m"] == m and "error" in r]
                print(json.dumps({"gemm": name, "m": m, "error": errors[0] if errors else "no configuration"}))
                continue
            got = skinny_linear(x, wbs[0][0], wbs[0][1], best[1], gelu=gelu).float()
            entry = {"gemm": name, "m": m, "n": n, "k": k, "config": best[1], "us": best[0], "cublas_us": cublas_us,
                     "rel_err": float((got - want).abs().max() / want.abs().max())}  # fmt: skip
            report["best"].append(entry)
            print(json.dumps(entry), flush=True)
            del wbs
    for m in sorted({e["m"] for e in report["best"]}):
        at = [e for e in report["best"] if e["m"] == m]
        report[f"layer_us_m{m}"] = {
            "skinny": sum(e["us"] for e in at),
            "cublas": sum(e["cublas_us"] for e in at),
            "best_of_both": sum(min(e["us"], e["cublas_us"]) for e in at),
        }
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="768: BERT-base; 384: multilingual-e5-small")
    ap.add_argument("--inter", type=int, default=INTER, help="3072: BERT-base; 1536: multilingual-e5-small")
    ap.add_argument("--rows", default="16,128,512")
    ap.add_argument("--out", type=Path, default=Path("/tmp/egemm"))
    args = ap.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on the CPU run it under TRITON_INTERPRET=1 (Triton's interpreter)")
    with torch.inference_mode():
        rows = tuple(int(r) for r in args.rows.split(","))
        report = sweep(args.device, tiny=args.device != "cuda", hidden=args.hidden, inter=args.inter, rows=rows)
    shape = f"hidden {args.hidden}, FFN {args.inter}"
    report |= {"model": f"encoder GEMM shapes ({shape}), fp16 (random weights)"}
    for key, v in report.items():
        if key.startswith("layer_us_m"):
            print(f"{key}: skinny {v['skinny']:.1f} µs, cuBLAS {v['cublas']:.1f}, best of both {v['best_of_both']:.1f}")
    write_report(args.out, "encoder_gemm_sweep", report)


if __name__ == "__main__":
    main()
