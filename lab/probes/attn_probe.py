"""On the GPU: which launch configuration of the encoder's Triton attention
(:mod:`miaohui.models.encoder_attention`) is fastest at each of the engine's shapes, and is it faster than the SDPA
form the engine runs without it (cuDNN's fused attention and the permute copies around it)?

It sweeps BLOCK_M × BLOCK_N × num_warps × num_stages at the given heads and head size (BERT-base's 12 of 64 by
default) with one padded sequence per batch, fp16; each configuration's output is checked against the SDPA form. Per
shape: µs per call (median of 30 replays of a CUDA graph holding 20 calls, :mod:`lab.harness`), the SDPA form's µs,
and the best configuration (``best``: ``scripts/gpu/tune.py`` keeps those that pass
``miaohui.models.tuning.rules.attention_entries``).

    python -m lab.probes.attn_probe --out /tmp/attn
    TRITON_INTERPRET=1 python -m lab.probes.attn_probe --device cpu --shapes 1x16 --out /tmp/attn  # smoke test
"""

from __future__ import annotations

import argparse
import functools
import itertools
from pathlib import Path
from typing import Any

import torch

from lab.harness import time_graph, write_report
from miaohui.models.encoder_attention import AttnConfig, sdpa_encoder_attention, triton_encoder_attention
from miaohui.models.fast_bert import MASK_BIAS

HEADS, HEAD_SIZE = 12, 64
"""BERT-base's; ``--heads 12 --head-size 32`` for multilingual-e5-small's."""


SERVING_CONFIGS: list[AttnConfig] = [(16, 64, 4, 2), (32, 128, 2, 2), (16, 128, 4, 2), (64, 64, 4, 1), (128, 64, 4, 1)]
"""The configurations that won the full sweeps on the H200 at BERT-base's and e5-small's shapes: ``--configs serving``
tries only these, so a server's whole bucket grid can be probed in one call."""


def configs(quick: bool, which: str = "all") -> list[AttnConfig]:
    """Every (BLOCK_M, BLOCK_N, num_warps, num_stages) of the sweep, or :data:`SERVING_CONFIGS`; ``quick``: two, for
    the CPU smoke test."""
    if quick:
        return [(32, 64, 4, 1), (16, 128, 2, 2)]
    if which == "serving":
        return list(SERVING_CONFIGS)
    return list(itertools.product((16, 32, 64, 128), (64, 128), (2, 4, 8), (1, 2)))


def inputs(
    b: int, s: int, device: str, dtype: torch.dtype, heads: int = HEADS, head_size: int = HEAD_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, S, 3·H·D] and the padding bias, the first sequence's second half padded."""
    gen = torch.Generator(device="cpu").manual_seed(b * 1000 + s)
    qkv = torch.randn(b, s, 3 * heads * head_size, generator=gen).to(device, dtype)
    mask = torch.ones(b, s)
    mask[0, s // 2 :] = 0
    bias = ((1.0 - mask[:, None, None, :]) * MASK_BIAS).to(device, dtype)
    return qkv, bias


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="1x16,1x64,1x128,8x64,32x128,128x128")
    ap.add_argument("--configs", choices=["all", "serving"], default="all", help="the full sweep, or its winners")
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--head-size", type=int, default=HEAD_SIZE)
    ap.add_argument("--out", type=Path, default=Path("/tmp/attn"))
    args = ap.parse_args()
    heads = args.heads
    cuda = args.device == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    report: dict[str, Any] = {
        "heads": heads,
        "head_size": args.head_size,
        "dtype": str(dtype),
        "rows": [],
        "best": [],
    }
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        qkv, bias = inputs(b, s, args.device, dtype, heads, args.head_size)
        with torch.inference_mode():
            want = sdpa_encoder_attention(qkv.float(), bias.float(), heads)
            sdpa_us = time_graph(functools.partial(sdpa_encoder_attention, qkv, bias, heads), 20, cuda)
            rows = []
            for cfg in configs(not cuda, args.configs):
                row: dict[str, Any] = {"batch": b, "heads": heads, "seq": s, "config": list(cfg)}
                try:
                    got = triton_encoder_attention(qkv, bias, heads, cfg)
                    row["max_err"] = float((got.float() - want).abs().max())
                    row["us"] = time_graph(functools.partial(triton_encoder_attention, qkv, bias, heads, cfg), 20, cuda)
                except Exception as exc:  # a configuration that does not compile (shared memory) is a finding
                    row["error"] = repr(exc)[:300]
                rows.append(row)
        ok = [r for r in rows if "us" in r and r["max_err"] < 1e-2]
        best = min(ok, key=lambda r: r["us"]) if cuda and ok else (ok[0] if ok else None)
        report["rows"] += rows
        if best is not None:
            report["best"].append(best | {"sdpa_us": sdpa_us})
            print(
                f"{b:4d}x{s:<4d} sdpa {sdpa_us:7.2f} us   best {best['us']:7.2f} us {best['config']}"
                f"   err {best['max_err']:.1e}   ({len(ok)}/{len(rows)} configurations ok)",
                flush=True,
            )
        else:
            print(f"{b:4d}x{s:<4d} no configuration ran: {rows[0].get('error')}", flush=True)
    write_report(args.out, "attn_probe", report)


if __name__ == "__main__":
    main()
