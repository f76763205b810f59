"""On the GPU: miaohui's split-KV decode attention (``decode_attention: triton``) against the engine's default
(``matmul``: two batched matmuls around a softmax, compiled by Inductor as the engine compiles it) for the 1.5B
Qwen2.5 shape (12 query heads, 2 KV heads, head size 128), per layer, at the decode buckets that matter: batch 1 and
64, attended lengths 256…1024, each row at a random position in the upper half of the bucket (what the engine sees:
a bucket is the smallest that holds the longest row). 28 layers' caches rotated, so every call reads its keys and
values from HBM; CUDA graphs of 40 calls. Reports µs per call, the ratio, and the largest difference between the two.

    python -m lab.probes.decode_attention_probe --out /tmp/attn
    python -m lab.probes.decode_attention_probe --sweep --out /tmp/attn   # also every (BLOCK_T, target, warps)
    python -m lab.probes.decode_attention_probe --device cpu --out /tmp/attn   # smoke test, no timing
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from lab.harness import time_graph
from lab.probes.decode_kernel_probe import HEADS, KV_HEADS, D
from miaohui.generation.kernels.decode_attention import (
    decode_attention_op,
    matmul_decode_attention,
    plan,
    triton_decode_attention,
)

SHAPES = [(1, 256), (1, 512), (1, 1024), (8, 512), (64, 256), (64, 512)]
LAYERS = 28
SWEEP = [(block, target, warps) for block in (32, 64) for target in (264, 528, 1056) for warps in (4, 8)]
"""(BLOCK_T, target programs, num_warps) tried by ``--sweep``, at these shapes:"""
SWEEP_SHAPES = [(1, 512), (8, 512), (64, 256), (64, 512), (3, 96)]  # the last: the CPU smoke test's


def _rotating(fn: Any, q: torch.Tensor, caches: list[Any], positions: torch.Tensor) -> Any:
    """``fn(q, keys, values, positions)`` over the next layer's cache at each call."""
    turn = [0]

    def run() -> Any:
        turn[0] = (turn[0] + 1) % len(caches)
        keys, values = caches[turn[0]]
        return fn(q, keys, values, positions)

    return run


def probe(device: str, dtype: torch.dtype, shapes: list[tuple[int, int]], sweep: bool) -> list[dict[str, Any]]:
    cuda = device == "cuda"
    matmul = torch.compile(matmul_decode_attention, dynamic=False) if cuda else matmul_decode_attention
    rows = []
    for b, length in shapes:
        gen = torch.Generator(device="cpu").manual_seed(b * 7919 + length)
        caches = [
            (
                torch.randn(b, KV_HEADS, length, D, generator=gen).to(device, dtype),
                torch.randn(b, KV_HEADS, length, D, generator=gen).to(device, dtype),
            )
            for _ in range(LAYERS if cuda else 1)
        ]
        q = torch.randn(b, HEADS, D, generator=gen).to(device, dtype)
        positions = torch.randint(length // 2, length, (b,), generator=gen).to(device)

        k0, v0 = caches[0]
        want = matmul_decode_attention(q.float(), k0.float(), v0.float(), positions)
        row: dict[str, Any] = {"batch": b, "length": length, "plan": plan(b, KV_HEADS, length)}
        for name, fn in (("matmul", matmul), ("triton", decode_attention_op)):
            got = fn(q, k0, v0, positions)
            row[f"{name}_max_abs_err"] = float((got.float() - want).abs().max())
            row[f"{name}_us"] = time_graph(_rotating(fn, q, caches, positions), 40, cuda)
        row["kv_mb_read_triton"] = float(2 * KV_HEADS * D * (positions + 1).sum() * dtype.itemsize / 2**20)
        if cuda:
            row["speedup"] = row["matmul_us"] / row["triton_us"]
        if sweep and (b, length) in SWEEP_SHAPES:
            timed = []
            for block, target, warps in SWEEP:

                def fn(q: Any, k: Any, v: Any, p: Any, c: tuple[int, int, int] = (block, target, warps)) -> Any:
                    return triton_decode_attention(q, k, v, p, block=c[0], target=c[1], warps=c[2])

                err = float((fn(q, k0, v0, positions).float() - want).abs().max())
                us = time_graph(_rotating(fn, q, caches, positions), 40, cuda)
                timed.append({"config": [block, target, warps], "us": us, "max_abs_err": err})
            row["sweep"] = sorted(timed, key=lambda e: e["us"])
            row["best"] = row["sweep"][0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("/tmp/attn"))
    ap.add_argument("--sweep", action="store_true", help="time every configuration in SWEEP too")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = SHAPES if args.device == "cuda" else [(1, 64), (3, 96)]
    with torch.inference_mode():
        rows = probe(args.device, torch.bfloat16 if args.device == "cuda" else torch.float32, shapes, args.sweep)
    report: dict[str, Any] = {"model": "qwen1.5b attention shape (random cache)", "torch": torch.__version__}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    report["rows"] = rows
    (args.out / "decode_attention_probe.json").write_text(json.dumps(report, indent=1))
    for r in rows:
        best = f", best {r['best']['config']} {r['best']['us']:.2f} µs" if "best" in r else ""
        times = f"matmul {r['matmul_us']:.2f} µs, triton {r['triton_us']:.2f} µs"
        print(f"b={r['batch']:3d} T={r['length']:5d}: {times}{best}")


if __name__ == "__main__":
    main()
