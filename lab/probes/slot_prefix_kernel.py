"""A prefix hit's copy as one Triton kernel per keys / values: every layer's cached blocks from the pool into the
slot, the layers' cache tensors reached through a table of their addresses, against ``SlotPrefixKV.load`` (one
gather for all layers, then one multi-tensor copy: its host time, not the device's, is most of a hit's copy):

    python -m lab.probes.slot_prefix_kernel --history 2000 [--out DIR]        (CUDA; TRITON_INTERPRET=1 on a CPU)

Shapes as ``lab/probes/slot_prefix_copy.py`` (a Qwen2.5-1.5B-shaped cache: 28 layers, 2 KV heads of 128, 8 slots;
bf16 and 4,096 positions on a GPU, fp32 and 256 positions under the interpreter). Both forms' slot contents are
checked equal; wall time of one load (synchronised), median and p99 of ``--iters``. Writes
DIR/slot_prefix_kernel.json. If it wins on a GPU, it becomes ``SlotPrefixKV.load``'s CUDA form.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from miaohui.generation.cache.slot_prefix import SlotPrefixKV


@triton.jit
def _blocks_to_slot(
    table_ptr,  # int64 [layers]: each layer's cache tensor's address
    pool_ptr,  # [layers, pool_blocks, kv_heads, block, head_dim], contiguous
    idx_ptr,  # int64 [used]: the pool blocks, in prefix order
    slot_offset,  # elements from a layer cache's start to (slot, head 0, position 0)
    stride_head,  # elements between a layer cache's heads
    pool_blocks,
    KV_HEADS: tl.constexpr,
    CHUNK: tl.constexpr,  # block * head_dim: a block of one head is contiguous in the pool and in the slot
    DTYPE: tl.constexpr,
) -> None:
    layer, j, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    block = tl.load(idx_ptr + j)
    base = tl.load(table_ptr + layer).to(tl.pointer_type(DTYPE))
    offs = tl.arange(0, CHUNK)
    src = pool_ptr + ((layer * pool_blocks + block) * KV_HEADS + head) * CHUNK + offs
    dst = base + slot_offset + head * stride_head + j * CHUNK + offs
    tl.store(dst, tl.load(src))


def kernel_load(
    cache: SlotPrefixKV, tables: tuple[torch.Tensor, torch.Tensor], prompt: list[int], n: int, slot: int
) -> None:
    """``SlotPrefixKV.load`` as two kernel launches (keys, values)."""
    blocks = cache.cache.match(prompt)
    used = -(-n // cache.block_size)
    idx = torch.tensor([b.payload.index for b in blocks[:used]], dtype=torch.int64).to(cache.pool_k.device)
    first = cache.keys[0]
    _, kv_heads, _, head_dim = first.shape
    dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[first.dtype]
    for table, pool in zip(tables, (cache.pool_k, cache.pool_v), strict=True):
        _blocks_to_slot[(len(cache.keys), used, kv_heads)](
            table, pool, idx, slot * first.stride(0), first.stride(1), pool.shape[1],
            KV_HEADS=kv_heads, CHUNK=cache.block_size * head_dim, DTYPE=dtype,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, dtype, max_len = ("cuda", torch.bfloat16, 4096) if cuda else ("cpu", torch.float32, 256)
    history = args.history if cuda else min(args.history, 200)
    shape = (9, 2, max_len, 128)
    keys = [torch.randn(shape, device=dev).to(dtype) for _ in range(28)]
    values = [torch.randn(shape, device=dev).to(dtype) for _ in range(28)]
    cache = SlotPrefixKV(keys, values, 16, (64 if cuda else 8) << 20)
    tables = tuple(torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev) for ts in (keys, values))
    prompt = list(range(history + 1))
    cache.store(prompt[:history], 0)
    n = cache.cached(prompt)

    def timed(fn: object) -> list[float]:
        out = []
        for _ in range(args.iters + 5):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn(prompt, n, 1)  # type: ignore[operator]
            if cuda:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
        return out[5:]

    before = [t[1].clone() for t in (*keys, *values)]
    times = {"fused": timed(cache.load)}
    reference = [t[1].clone() for t in (*keys, *values)]
    for t, b in zip((*keys, *values), before, strict=True):
        t[1].copy_(b)  # the slot as it was: the kernel must write what the fused form wrote
    times["kernel"] = timed(lambda p, k, s: kernel_load(cache, tables, p, k, s))
    same = all(torch.equal(r, t[1]) for r, t in zip(reference, (*keys, *values), strict=True))
    doc = {
        "probe": "slot_prefix_kernel",
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "history_tokens": history,
        "loaded_tokens": n,
        "equal": same,
        **{
            k: {"median_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * sorted(v)[int(0.99 * (len(v) - 1))]}
            for k, v in times.items()
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "slot_prefix_kernel.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
