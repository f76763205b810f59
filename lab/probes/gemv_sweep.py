"""On the GPU: miaohui's one-row int8 kernel (:func:`miaohui.generation.kernels.w8a16.w8_gemv`) over its
configurations, for the 1.5B Qwen2.5 shape's five GEMMs (random weights), against what the batch-1 decode graph runs
today.

Session 17's kernel table of the batch-1 step with ``int8_batch1`` (``profile_decode_int8b1_graph_h200_s17c.json``):
1.61 ms of kernels, of which Inductor's coordinate-descent int8 reductions take ~1.1 ms — the down projection with
SiLU·up fused in 16.4 µs per layer (13.8 MB of int8: 0.84 TB/s), gate/up with the RMSNorm 12.9 µs (2.1 TB/s). At
~3.5 TB/s the four GEMMs of a layer would take ~13 µs instead of ~38, which is the gap to the 1.1 ms TPOT goal.

Per GEMM: cuBLAS on bf16 weights, Inductor's int8 form with coordinate descent (``int8_inductor_cd``, the graph's
kernel without its fused prologue), then every ``GEMV_SWEEP`` configuration that gives 132–16,384 programs; each a
CUDA graph of 40 calls over weights rotated past L2 (``decode_kernel_probe._time_graph``). The fastest
configuration per (N, K) is checked against the dequantized weights and written as ``best`` (what
``w8a16.GEMV_BEST`` holds).

    python -m lab.probes.gemv_sweep --out /tmp/gemv
    python -m lab.probes.gemv_sweep --device cpu --out /tmp/gemv   # smoke test (Triton interpreter), no timing
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from lab.harness import rotating, time_graph
from lab.probes.decode_kernel_probe import HEADS, HIDDEN, INTER, KV_HEADS, VOCAB, D
from miaohui.generation.kernels.int8_weights import quantize_int8
from miaohui.generation.kernels.w8a16 import GEMV_SWEEP, GemvConfig, w8_gemv

SHAPES = {"qkv": (HIDDEN + 2 * KV_HEADS * D, HIDDEN), "o": (HIDDEN, HEADS * D), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}  # fmt: skip


def _programs(n: int, cfg: GemvConfig) -> int:
    return -(-n // cfg[0]) * cfg[2]


def sweep(device: str, tiny: bool, min_block_k: int = 0) -> dict[str, Any]:
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter has no bf16 arithmetic
    report: dict[str, Any] = {"rows": [], "best": {}}
    for name, (n, k) in SHAPES.items():
        if tiny:
            n, k = max(16, n // 64), max(64, k // 64)
        configs = [c for c in GEMV_SWEEP if (132 <= _programs(n, c) <= 16384 or tiny) and c[1] >= min_block_k]
        if not configs:
            continue
        copies = max(1, min(40, (400 << 20) // (n * k))) if cuda else 1
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        packed = [quantize_int8(w) for w in weights]
        del weights
        x = torch.randn(1, k, device=device, dtype=dtype)
        deq = packed[0][0].float() * packed[0][1].float()[:, None]
        want = x.float() @ deq.T
        base: dict[str, float] = {}
        torch._dynamo.reset()
        torch._inductor.config.coordinate_descent_tuning = True
        cd = torch.compile(lambda x, w: F.linear(x, w[0].to(x.dtype)) * w[1], dynamic=False)
        base["int8_inductor_cd"] = time_graph(rotating(cd, x, items=packed), 40, cuda)
        torch._inductor.config.coordinate_descent_tuning = False
        bf16 = [q.to(dtype) * s[:, None] for q, s in packed[:copies]]
        base["cublas_bf16"] = time_graph(rotating(F.linear, x, items=bf16), 40, cuda)
        del bf16
        best: tuple[float, GemvConfig] | None = None
        for cfg in configs[:4] if tiny else configs:
            run = rotating(lambda x, w, c=cfg: w8_gemv(x, w[0], w[1], config=c), x, items=packed)
            try:
                us = time_graph(run, 40, cuda)
            except Exception as exc:  # a configuration Triton cannot compile is a finding, not a stop
                report["rows"].append({"gemm": name, "config": cfg, "error": repr(exc)[:200]})
                continue
            report["rows"].append({"gemm": name, "n": n, "k": k, "config": cfg, "us": us})
            if best is None or us < best[0] or not cuda:
                best = (us, cfg)
        assert best is not None
        got = w8_gemv(x, packed[0][0], packed[0][1], config=best[1]).float()
        err = float((got - want).abs().max() / want.abs().max())
        mb = n * k / 2**20
        entry = {"n": n, "k": k, "config": best[1], "us": best[0], "tb_s": n * k / (best[0] * 1e-6) / 1e12,
                 "rel_err": err, "int8_mb": mb, **{f"{b}_us": v for b, v in base.items()}}  # fmt: skip
        report["best"][name] = entry
        print(json.dumps({"gemm": name, **entry}), flush=True)
        del packed
    layers = 28
    for key in ("us", "int8_inductor_cd_us", "cublas_bf16_us"):  # over the shapes swept (all, unless --min-block-k)
        report[f"step_{key}"] = sum(v[key] * (1 if g == "lm_head" else layers) for g, v in report["best"].items())
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gemv"))
    ap.add_argument("--min-block-k", type=int, default=0, help="sweep only configurations with BLOCK_K ≥ this")
    args = ap.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on the CPU run it under TRITON_INTERPRET=1 (Triton's interpreter)")
    args.out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        report = sweep(args.device, tiny=args.device != "cuda", min_block_k=args.min_block_k)
    report |= {"model": "qwen1.5b shape (random weights)", "torch": torch.__version__}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    gemv, cd, bf16 = report["step_us"], report["step_int8_inductor_cd_us"], report["step_cublas_bf16_us"]
    print(f"µs per decode step in GEMMs (28 layers + LM head): gemv {gemv:.0f}, int8 inductor cd {cd:.0f}, "
          f"cuBLAS bf16 {bf16:.0f}", flush=True)  # fmt: skip
    (args.out / "gemv_sweep.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
