"""A prefix hit's copy on the GPU slot engine: the cached blocks of a long history into a slot, as
``SlotPrefixKV.load`` does it (all layers' blocks in one gather, one multi-tensor copy into the slots) against the
per-layer form (a gather, a reshape and a write per layer and per keys / values), on the same caches:

    python -m lab.probes.slot_prefix_copy --history 2000 [--out DIR]        (CUDA if present, else CPU)

Shapes: a Qwen2.5-1.5B-shaped cache (28 layers, 2 KV heads of 128, 8 slots of 4096 positions, bf16 on a GPU; on a
CPU the positions are cut to 2,304 and the dtype is fp32). Wall time of one load including the device's work
(synchronised), median and p99 of ``--iters``; both forms' slot contents are checked equal. Writes
DIR/slot_prefix_copy.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from miaohui.generation.cache.slot_prefix import SlotPrefixKV


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, dtype, max_len = ("cuda", torch.bfloat16, 4096) if cuda else ("cpu", torch.float32, 2304)
    shape = (9, 2, max_len, 128)
    keys = [torch.randn(shape, device=dev).to(dtype) for _ in range(28)]
    values = [torch.randn(shape, device=dev).to(dtype) for _ in range(28)]
    cache = SlotPrefixKV(keys, values, 16, 256 << 20)
    prompt = list(range(args.history + 1))
    cache.store(prompt[: args.history], 0)
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

    times = {"per_layer": timed(lambda p, k, s: per_layer_load(cache, p, k, s))}
    reference = [t[1].clone() for t in (*keys, *values)]
    times["fused"] = timed(cache.load)
    same = all(torch.equal(r, t[1]) for r, t in zip(reference, (*keys, *values), strict=True))
    doc = {
        "probe": "slot_prefix_copy",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "history_tokens": args.history,
        "loaded_tokens": n,
        "equal": same,
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
