"""A prefix hit's copy on the GPU slot engine: the cached blocks of a long history into a slot, in three forms on the
same caches: ``per_layer`` (a gather, a reshape and a write per layer and per keys / values: the reference),
``fused`` (``SlotPrefixKV.load``: one gather for all layers, then one multi-tensor copy into the slots) and ``kernel``
(one Triton kernel per keys / values reaching the layers' caches through a table of their addresses; on CUDA, or on
a CPU under ``TRITON_INTERPRET=1``):

    python -m lab.probes.slot_prefix_copy --history 2000 [--out DIR]        (CUDA if present, else CPU)

Shapes: a Qwen2.5-1.5B-shaped cache (28 layers, 2 KV heads of 128, 8 slots of 4096 positions, bf16 on a GPU; on a
CPU the positions are cut to 2,304 and the dtype is fp32, and under the interpreter to 256 positions and a 200-token
history). Wall time of one load including the device's work (synchronised), median and p99 of ``--iters``. Each form
starts from the slot as it was and must leave what the reference left (``equal``). Writes DIR/slot_prefix_copy.json.
If ``kernel`` wins on a GPU it becomes ``SlotPrefixKV.load``'s CUDA form.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from miaohui.generation.cache.slot_prefix import SlotPrefixKV

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

Load = Callable[[list[int], int, int], None]


def per_layer_load(cache: SlotPrefixKV, prompt: list[int], n: int, slot: int) -> None:
    """The reference form: one gather, reshape and write per layer, for keys and for values."""
    blocks = cache.cache.match(prompt)
    used = -(-n // cache.block_size)
    idx = torch.tensor([b.payload.index for b in blocks[:used]], device=cache.pool_k.device)
    width = used * cache.block_size
    for layers, pool in ((cache.keys, cache.pool_k), (cache.values, cache.pool_v)):
        for i, layer in enumerate(layers):
            part = pool[i]
            kv_heads, head_dim = part.shape[1], part.shape[3]
            layer[slot, :, :width] = part[idx].transpose(0, 1).reshape(kv_heads, width, head_dim)


if triton is not None:

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


def kernel_load(cache: SlotPrefixKV, tables: list[torch.Tensor]) -> Load:
    """``SlotPrefixKV.load`` as two kernel launches (keys, values); ``tables``: the layers' cache addresses."""
    first = cache.keys[0]
    _, kv_heads, _, head_dim = first.shape
    dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[first.dtype]

    def load(prompt: list[int], n: int, slot: int) -> None:
        used = -(-n // cache.block_size)
        blocks = cache.cache.match(prompt)[:used]
        idx = torch.tensor([b.payload.index for b in blocks], dtype=torch.int64).to(first.device, non_blocking=True)
        for table, pool in zip(tables, (cache.pool_k, cache.pool_v), strict=True):
            _blocks_to_slot[(len(cache.keys), used, kv_heads)](
                table, pool, idx, slot * first.stride(0), first.stride(1), pool.shape[1],
                KV_HEADS=kv_heads, CHUNK=cache.block_size * head_dim, DTYPE=dtype,
            )  # fmt: skip

    return load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    interpreted = not cuda and os.environ.get("TRITON_INTERPRET") == "1"
    dev, dtype, max_len = ("cuda", torch.bfloat16, 4096) if cuda else ("cpu", torch.float32, 2304)
    history = args.history
    if interpreted:
        max_len, history = 256, min(history, 200)
    keys = [torch.randn((9, 2, max_len, 128), device=dev).to(dtype) for _ in range(28)]
    values = [torch.randn((9, 2, max_len, 128), device=dev).to(dtype) for _ in range(28)]
    caches = (*keys, *values)
    cache = SlotPrefixKV(keys, values, 16, 256 << 20)
    prompt = list(range(history + 1))
    cache.store(prompt[:history], 0)
    n = cache.cached(prompt)
    forms: dict[str, Load] = {"per_layer": lambda p, k, s: per_layer_load(cache, p, k, s), "fused": cache.load}
    if triton is not None and (cuda or interpreted):
        tables = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev) for ts in (keys, values)]
        forms["kernel"] = kernel_load(cache, tables)

    before = [t[1].clone() for t in caches]
    times: dict[str, list[float]] = {}
    equal: dict[str, bool] = {}
    reference: list[torch.Tensor] = []
    for name, load in forms.items():
        for t, b in zip(caches, before, strict=True):
            t[1].copy_(b)  # every form starts from the slot as it was
        times[name] = []
        for _ in range(args.iters + 5):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            load(prompt, n, 1)
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
        del times[name][:5]
        if not reference:
            reference = [t[1].clone() for t in caches]
        equal[name] = all(torch.equal(r, t[1]) for r, t in zip(reference, caches, strict=True))
    doc = {
        "probe": "slot_prefix_copy",
        "device": torch.cuda.get_device_name() if cuda else "cpu" + (" (Triton interpreter)" if interpreted else ""),
        "torch": torch.__version__,
        "triton": triton.__version__ if triton is not None else None,
        "history_tokens": history,
        "loaded_tokens": n,
        "equal": equal,
        **{
            k: {"median_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * sorted(v)[int(0.99 * (len(v) - 1))]}
            for k, v in times.items()
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "slot_prefix_copy.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
