"""On the GPU: a mixed step's attention per layer, the way session 20 ran it (every row, decode rows and prompt tokens,
through the decode kernel in its slot's cache: ``rows``) against the split op (the decode kernel for the decode rows,
the packed-prompt kernel for the prompt tokens: ``split``), and the prompt kernel's block sizes. The 1.5B Qwen2.5
heads (12 query, 2 KV, head size 128), bf16; 64 decode rows at position 200 of their slots and ``p`` prompt tokens
(prompts of 128 in their own slots) for p = 128 / 256 / 512; attended bucket 256. 28 layers' caches rotated, so every
call reads from HBM; CUDA graphs of 40 calls (``decode_kernel_probe._time_graph``). The largest difference from the
matmul forms is reported with each time.

    python -m lab.probes.prompt_attention_probe --out /tmp/pattn
    python -m lab.probes.prompt_attention_probe --device cpu --out /tmp/pattn   # smoke test, no timing
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch

from lab.harness import time_graph
from lab.probes.decode_kernel_probe import HEADS, KV_HEADS, D
from miaohui.generation.kernels.decode_attention import decode_attention
from miaohui.generation.kernels.prompt_attention import BLOCK_M, BLOCK_N, matmul_prompt_attention, prompt_attention

DECODE_ROWS, POSITION, BUCKET, LAYERS = 64, 200, 256, 28
BLOCKS = [(16, 32), (16, 64), (32, 32), (32, 64), (64, 64)]
"""(BLOCK_M, BLOCK_N) of the prompt kernel tried; the default is marked in the output."""


def _inputs(p: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Any]]:
    slots = DECODE_ROWS + p // 128 + 1  # the decode rows' slots, one per prompt, the scratch row
    prompts = torch.arange(p) // 128 + DECODE_ROWS
    positions = torch.cat((torch.full((DECODE_ROWS,), POSITION), torch.arange(p) % 128)).to(device)
    rows = torch.cat((torch.arange(DECODE_ROWS), prompts)).to(device)
    gen = torch.Generator(device="cpu").manual_seed(p)
    caches = [
        tuple(torch.randn(slots, KV_HEADS, BUCKET, D, generator=gen).to(device, dtype) for _ in range(2))
        for _ in range(LAYERS if device == "cuda" else 1)
    ]
    q = torch.randn(DECODE_ROWS + p, HEADS, D, generator=gen).to(device, dtype)
    return q, positions, rows, caches


def _one(p: int, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Times and errors of both forms (and every block size of the prompt kernel) at ``p`` prompt tokens."""
    from miaohui.generation.kernels.prompt_attention import triton_prompt_attention

    cuda, b = device == "cuda", DECODE_ROWS
    q, positions, rows, caches = _inputs(p, device, dtype)
    turn = [len(caches) - 1]

    def next_cache() -> Any:
        turn[0] = (turn[0] + 1) % len(caches)
        return caches[turn[0]]

    def by_rows() -> torch.Tensor:
        keys, values = next_cache()
        return decode_attention(q, keys, values, positions, rows)

    def split(bm: int, bn: int) -> torch.Tensor:
        keys, values = next_cache()
        res = torch.empty_like(q)
        decode_attention(q[:b], keys, values, positions[:b], rows[:b], res[:b])
        if cuda:
            triton_prompt_attention(q[b:], keys, values, positions[b:], rows[b:], res[b:], block_m=bm, block_n=bn)
        else:
            prompt_attention(q[b:], keys, values, positions[b:], rows[b:], res[b:])
        return res

    keys, values = caches[0]
    want = matmul_prompt_attention(q[b:].float(), keys.float(), values.float(), positions[b:], rows[b:])
    row: dict[str, Any] = {"decode_rows": b, "prompt_tokens": p, "bucket": BUCKET}
    turn[0] = len(caches) - 1
    row["rows_err"] = float((by_rows()[b:].float() - want).abs().max())
    row["rows_us"] = time_graph(by_rows, 40, cuda)
    for bm, bn in BLOCKS if cuda else [(BLOCK_M, BLOCK_N)]:
        turn[0] = len(caches) - 1
        tag = f"split_{bm}x{bn}" + ("_default" if (bm, bn) == (BLOCK_M, BLOCK_N) else "")
        row[f"{tag}_err"] = float((split(bm, bn)[b:].float() - want).abs().max())
        row[f"{tag}_us"] = time_graph(functools.partial(split, bm, bn), 40, cuda)
    return row


def probe(device: str, dtype: torch.dtype, tokens: list[int]) -> list[dict[str, Any]]:
    out = []
    for p in tokens:
        out.append(_one(p, device, dtype))
        print(json.dumps(out[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default="128,256,512")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = probe(args.device, dtype, [int(t) for t in args.tokens.split(",")])
    meta = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prompt_attention_probe.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
