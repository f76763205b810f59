"""On the GPU: where a decode step of the static-KV engine spends its time (kernel table), and how long a
CUDA-graph step takes, for the 1.5B Qwen-shaped model with random weights; with ``--prefills``, the same for the
static prefill graphs of those (prompts × length) buckets.

    python -m lab.probes.profile_decode [--batches 1,64] [--int8-batch1 [--int8-kernel gemv --gemv-table JSON]]
        [--prefills 1x128,2x128,8x128] [--symbolic-heads] [--out DIR]

``--symbolic-heads``: the fused decode and mixed layers get the head count as before session 23, bound by
``functools.partial``, so that ``dynamic=True`` makes it a symbol of their graphs (the engine binds it with
:func:`~miaohui.generation.models.constants.with_constants`, a constant): the same call can time both.

``--gemv-table``: ``lab/probes/gemv_sweep.py``'s JSON; its fastest configuration per weight shape goes into
``w8a16.GEMV_BEST`` before the engine is built.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from lab.harness import replay_us, summary
from miaohui.bench.kernel_timeline import cuda_kernels, exclusive
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.kernels import w8a16
from miaohui.generation.models import mixed_step, static_kv
from miaohui.generation.models.dims import DecoderDims
from miaohui.generation.models.static_kv import StaticKVDecoder

# Qwen2.5-1.5B shape (random weights)
QWEN_15B = DecoderDims(
    num_layers=28, hidden=1536, num_heads=12, num_kv_heads=2, head_dim=128, intermediate=8960, vocab=151936,
    rope_theta=1e6, rms_eps=1e-6, max_positions=32768,
)  # fmt: skip


def _profile(graph: torch.cuda.CUDAGraph, label: str, table_path: Path) -> dict[str, float]:
    """A captured graph's replay: median time of 200 (CUDA events), and its kernels (count, device time) over 10."""
    step = summary(replay_us(graph.replay, 200))["median"] / 1000
    # the graph's own kernels: calling the compiled step outside the graph can run another variant of it
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    n_kernels = sum(e.count for e in events) / 10
    gpu_us = sum(e.device_time_total for e in events) / 10
    print(f"{label}: graph step {step:.3f} ms; {n_kernels:.0f} kernels/step, kernel time {gpu_us:.0f} us")
    print(table)
    table_path.write_text(table)
    _write_order(prof, round(n_kernels), table_path.with_suffix(".order.txt"))
    return {"graph_step_ms": step, "kernels_per_step": n_kernels, "kernel_us_per_step": gpu_us}


def _write_order(prof: torch.profiler.profile, n: int, path: Path) -> None:
    """The first replay's kernels in the order they ran (start offset, µs, name): what precedes what, e.g. which
    operation a graph's memcpy nodes (``memcpy32_post``) belong to."""
    kernels = cuda_kernels(prof)[:n]
    t0 = kernels[0].start if kernels else 0
    lines = [
        f"{k.start - t0:9.1f} {k.end - k.start:7.2f} {x:7.2f}  {k.name[:120]}"
        for k, x in zip(kernels, exclusive(kernels), strict=True)
    ]
    path.write_text("start_us  dur_us  alone_us  kernel\n" + "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    ap.add_argument("--int8-batch1", action="store_true", help="the int8 weight copy for steps of one row (TPOT)")
    kernels = ("inductor", "gemv", "gemv_fused", "gemv_layer")
    ap.add_argument("--int8-kernel", choices=kernels, default=None, help="default: the engine's")
    ap.add_argument("--decode-attention", choices=("matmul", "triton"), default=None, help="default: the engine's")
    ap.add_argument("--gemv-table", type=Path, nargs="*", default=[], help="gemv_sweep.py JSONs: best config per shape")
    ap.add_argument("--prefills", default="", help="static prefill buckets to profile, e.g. 1x128,2x128,8x128")
    ap.add_argument("--mixed", default="", help="mixed-step token buckets to profile at batch 64, e.g. 128,256,512")
    ap.add_argument("--symbolic-heads", action="store_true", help="the head count a symbol of the layers' graphs")
    args = ap.parse_args()
    if args.symbolic_heads:  # partial: Dynamo makes the bound int a symbol (tests/unit/test_constants.py)
        static_kv.with_constants = mixed_step.with_constants = functools.partial  # type: ignore[assignment]
    args.out.mkdir(parents=True, exist_ok=True)
    dims = QWEN_15B
    batches = [int(b) for b in args.batches.split(",") if b]
    prefills = [(int(n), int(t)) for n, t in (p.split("x") for p in args.prefills.split(",") if p)]
    mixed = [int(v) for v in args.mixed.split(",") if v]
    opts = SlotEngineOptions(
        num_slots=64,
        max_len=1024,
        dtype="bf16",
        batch_buckets=(1, 64),
        length_buckets=(256, 1024),
        int8_batch1=args.int8_batch1,
        int8_kernel=args.int8_kernel,
        **({"decode_attention": args.decode_attention} if args.decode_attention else {}),
        static_prefill=bool(prefills),
        prefill_batch_buckets=tuple(sorted({n for n, _ in prefills})) or (1, 2, 4, 8),
        prefill_length_buckets=tuple(sorted({t for _, t in prefills})),
        mixed_prefill_tokens=tuple(mixed),
    )
    if args.gemv_table:
        w8a16.GEMV_BEST.update(w8a16.best_from_sweeps([json.loads(p.read_text()) for p in args.gemv_table]))
        print("gemv configs:", w8a16.GEMV_BEST)
    dec = StaticKVDecoder(dims, num_slots=64, max_len=1024, qkv_bias=True, dtype=torch.bfloat16, device="cuda")
    dec.init_random()
    engine = TorchSlotEngine(dec, [0], 0, opts)
    t = time.perf_counter()
    engine.warmup(log=print)
    print(f"warm-up {time.perf_counter() - t:.1f}s")
    report: dict[str, object] = {}
    for b in batches:
        slots = list(range(b))
        engine.prefill(slots, [[5] * 128] * b)
        graph, _ = engine._graphs[(b, 256)]
        report[str(b)] = _profile(graph, f"batch {b}", args.out / f"profile_decode_b{b}.txt")
        for slot in slots:
            engine.release(slot)
    for n, length in prefills:
        graph, _ = engine._prefill_graphs[(n, length)]
        report[f"prefill_{n}x{length}"] = _profile(
            graph, f"prefill {n}x{length}", args.out / f"profile_prefill_{n}x{length}.txt"
        )
    for p in mixed:
        # 64 decode rows at position 200 of their slots, then p / 128 prompts of 128 tokens (into the scratch row)
        io = engine._mx_dev
        io[1, :64], io[2, :64], io[3, :64] = 200, torch.arange(64), 1
        io[1, 64 : 64 + p] = torch.arange(p) % 128
        io[2, 64 : 64 + p] = dec.scratch_row
        graph, _ = engine._mixed_graphs[(64, p, 256)]
        report[f"mixed_64_{p}"] = _profile(graph, f"mixed 64+{p}", args.out / f"profile_mixed_64_{p}.txt")
    report["options"] = {"int8_batch1": args.int8_batch1, "int8_kernel": opts.int8_kernel,
                         "decode_attention": opts.decode_attention, "symbolic_heads": args.symbolic_heads,
                         "gemv_configs": {f"{n}x{k}": c for (n, k), c in w8a16.GEMV_BEST.items()}}  # fmt: skip
    (args.out / "profile_decode.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
