"""A prefix hit's copy on the GPU slot engine: the cached blocks of a long history into a slot, in three forms on the
same caches: ``per_layer`` (a gather, a reshape and a write per layer and per keys / values: the reference),
``fused`` (``SlotPrefixKV.copy_in``'s reference form: one gather for all layers, then one multi-tensor copy into the
slots) and ``kernel`` (its GPU form, ``miaohui.generation.kernels.block_copy``: one Triton kernel per keys / values
reaching the layers' caches through a table of their addresses; on CUDA, or on a CPU under ``TRITON_INTERPRET=1``):

    python -m lab.probes.slot_prefix_copy --history 2000 [--out DIR]        (CUDA if present, else CPU)

Shapes: a Qwen2.5-1.5B-shaped cache (28 layers, 2 KV heads of 128, 8 slots of 4096 positions, bf16 on a GPU; on a
CPU the positions are cut to 2,304 and the dtype is fp32, and under the interpreter to 256 positions and a 200-token
history). Wall time of one load including the device's work (synchronised), median and p99 of ``--iters``. Each form
starts from the slot as it was and must leave what the reference left (``equal``). Writes DIR/slot_prefix_copy.json.
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
from miaohui.generation.kernels import block_copy

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


def engine_load(cache: SlotPrefixKV, kernel: bool) -> Load:
    """``SlotPrefixKV.load``'s work (match, indices, ``copy_in``) with the copy's form chosen."""

    def load(prompt: list[int], n: int, slot: int) -> None:
        used = -(-n // cache.block_size)
        blocks = cache.cache.match(prompt)[:used]
        cache.copy_in(cache._indices([b.payload.index for b in blocks]), slot, kernel=kernel)

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
    forms: dict[str, Load] = {
        "per_layer": lambda p, k, s: per_layer_load(cache, p, k, s),
        "fused": engine_load(cache, kernel=False),
    }
    if block_copy.triton is not None and (cuda or interpreted):
        cache._table = block_copy.address_table(keys + values)  # a GPU's cache has it
        forms["kernel"] = engine_load(cache, kernel=True)

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
        "triton": block_copy.triton.__version__ if block_copy.triton is not None else None,
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
