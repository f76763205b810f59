"""Prefix caching on the GPU slot engine (``inductor``): time to first token of a new turn at the end of a long
conversation, against a short prompt alone, in one process.

    python benchmarks/bench_prefix_cache_gpu.py --model qwen1.5b --history 2000 --turn 50 [--out DIR]
    python benchmarks/bench_prefix_cache_gpu.py --model qwen1.5b --history 500,1000,2000   (one engine, interleaved)

The goal (issue 44): on the H200, a 1.5B model's TTFT for a 2,000-token conversation with a 50-token new turn <= 1.2x
that of a 50-token prompt. Per iteration (fresh random tokens each time, so nothing but the history is shared):
``short`` — a ``--turn``-token prompt alone (no hit); ``turn_cached`` — a ``--history``-token conversation is run once
(its blocks are cached, not timed), then history + a ``--turn``-token new turn is timed (its prefix comes from the
cache, and the slot the history left still holds it: a quiet server, nothing copied); ``turn_pool`` — another new turn
after the same history, once an unrelated ``--turn``-token request (not timed) has taken that slot: the prefix is copied
from the cache's pool (a busy server); ``turn_uncached`` — the same prompt on an engine without a prefix cache (the
baseline the cache removes). TTFT here is the wall time of a one-token ``generate`` through ``LLMEngine`` (scheduler,
runner, engine, the token on the host): no HTTP. ``qwen1.5b`` is a Qwen2.5-1.5B-*shaped* decoder with RANDOM weights
(speed depends on shape only); ``tiny`` a tiny one, for the CPU (tests). Median and p99 over ``--iters`` after
``--warmup``; ratios of medians. With several ``--history`` lengths each iteration runs every one (what a hit costs
beyond the short prompt, by history: ``by_history``); the top-level figures are the longest's. Writes
``prefix_cache_gpu_<model>.json`` and ``.png`` under ``--out``; ``--plot-from JSON`` redraws a result's PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miaohui.bench.report import git_commit
from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.slot_defaults import choose_defaults
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.dims import DecoderDims
from miaohui.generation.models.static_kv import StaticKVDecoder

SHAPES = {
    "qwen1.5b": DecoderDims(28, 1536, 12, 2, 128, 8960, 151936, 1000000.0, 1e-6, 32768),
    "tiny": DecoderDims(2, 64, 4, 2, 16, 128, 512, 10000.0, 1e-6, 4096),
}
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _engine(args: argparse.Namespace, device: str) -> TorchSlotEngine:
    """On a GPU the engine ``serve`` runs for this model without a generation.yaml (static prefill and mixed-step
    graphs), with ``--slots``, ``--max-len`` (a 2,050-token conversation passes the default 2,048) and
    ``--prefix-graphs``."""
    dims = SHAPES[args.model]
    dtype = "bf16" if device == "cuda" else "fp32"
    if device == "cuda":
        chosen = choose_defaults(dataclasses.asdict(dims), torch.cuda.mem_get_info()[1], dtype).engine
        opts = chosen.model_copy(update={"num_slots": args.slots, "max_len": args.max_len, "device": device,
                                         "prefix_graphs": args.prefix_graphs})  # fmt: skip
    else:
        opts = SlotEngineOptions(num_slots=args.slots, max_len=args.max_len, dtype="fp32", device=device)
    dec = StaticKVDecoder(
        dims, num_slots=opts.num_slots, max_len=opts.max_len, dtype={"bf16": torch.bfloat16}.get(dtype, torch.float32),
        device=device,
    )  # fmt: skip
    dec.init_random(0)
    engine = TorchSlotEngine(dec, [], 0, opts)
    engine.warmup(log=lambda m: print(m, file=sys.stderr))
    return engine


def _ttft(llm: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], ONE)
    return time.perf_counter() - start


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(xs), "p99_ms": 1e3 * float(np.percentile(xs, 99)), "n": len(xs)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = SHAPES[args.model].vocab
    rng = np.random.default_rng(0)
    engine = _engine(args, device)
    sched = {"max_model_len": args.max_len, "max_batched_tokens": args.max_len}  # a whole conversation in one step
    cached = LLMEngine(engine, None, SchedulerConfig(prefix_cache_mb=args.cache_mb, **sched))
    plain = LLMEngine(engine, None, SchedulerConfig(prefix_cache_mb=0.0, **sched))

    def words(n: int) -> list[int]:
        return [int(t) for t in rng.integers(10, vocab, n)]

    histories = sorted({int(h) for h in args.history.split(",")})
    times: dict[str, list[float]] = {"short": []}
    kinds = ("turn_cached", "turn_pool", "turn_uncached")
    for h in histories:
        for kind in kinds:
            times[f"{kind}_{h}"] = []
    for i in range(args.warmup + args.iters):
        got = {"short": _ttft(cached, words(args.turn))}
        for h in histories:
            history, turn = words(h), words(args.turn)
            cached.generate([history], ONE)  # the conversation so far: its blocks are cached
            got[f"turn_cached_{h}"] = _ttft(cached, history + turn)
            cached.generate([words(args.turn)], ONE)  # another request takes the slot the conversation left
            got[f"turn_pool_{h}"] = _ttft(cached, history + words(args.turn))
            # the engine without a cache writes the same slots; the cached engine's next request is an unrelated
            # prompt (the short one, or the next history), which takes the slot it wrote before any could match it
            got[f"turn_uncached_{h}"] = _ttft(plain, history + turn)
        if i >= args.warmup:
            for k, v in got.items():
                times[k].append(v)
    pool = cached.runner.prefix_cache
    stats = pool.stats if pool is not None else None
    summary = {k: _summary(v) for k, v in times.items()}
    short = summary["short"]["median_ms"]
    by_history = {
        str(h): {
            **{kind: summary[f"{kind}_{h}"] for kind in kinds},
            **{f"ratio_{kind}_over_short": summary[f"{kind}_{h}"]["median_ms"] / short for kind in kinds},
        }
        for h in histories
    }
    longest = by_history[str(histories[-1])]
    out = {"short": summary["short"], **{kind: longest[kind] for kind in kinds}}
    return {
        "benchmark": "prefix_cache_gpu",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit() or "unknown",
        "command": shlex.join([sys.executable, *sys.argv]),
        "hardware": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "model": f"{args.model}-shaped decoder, RANDOM weights",
        "device": device,
        "history_tokens": histories[-1],
        "turn_tokens": args.turn,
        "ttft": out,
        **{f"ratio_{kind}_over_short": longest[f"ratio_{kind}_over_short"] for kind in kinds},
        "by_history": by_history,
        "goal": "ratio_turn_cached_over_short <= 1.2 on the H200 (qwen1.5b, history 2000, turn 50)",
        "prefix_cache": dataclasses.asdict(stats) if stats else None,
        "engine": {
            "options": engine.options.model_dump(mode="json"),
            "prefix_graphs": len(engine._prefix_graphs),
            "prefix_graph_steps": engine.prefix_graph_steps,
            "prefill_graphs": len(engine._prefill_graphs),
        },
    }


def plot(doc: dict[str, Any], png: Path) -> None:
    """TTFT by history length: the 50-token prompt alone, the turn with its history cached (still in its slot; copied
    from the pool, where the result has it) and without the cache, medians with p99 whiskers, and the goal (1.2x the
    short prompt)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = doc.get("by_history") or {
        str(doc["history_tokens"]): {k: doc["ttft"][k] for k in ("turn_cached", "turn_uncached")}
    }
    lengths = sorted(by, key=int)
    short = doc["ttft"]["short"]
    series = [
        ("short", f"{doc['turn_tokens']}-token prompt alone"),
        ("turn_cached", "turn, history cached, still in its slot"),
        ("turn_pool", "turn, history cached, copied from the pool"),
        ("turn_uncached", "turn, no prefix cache"),
    ]
    series = [(k, label) for k, label in series if k == "short" or k in by[lengths[0]]]
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    width = 0.8 / len(series)
    for i, (kind, label) in enumerate(series):
        stats = [short if kind == "short" else by[h][kind] for h in lengths]
        med = [x["median_ms"] for x in stats]
        err = [[0] * len(stats), [x["p99_ms"] - x["median_ms"] for x in stats]]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(lengths))]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=label)
        for x, m in zip(xs, med, strict=True):
            ax.annotate(
                f"{m:.2f}", (x, m), ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points"
            )
    ax.axhline(1.2 * short["median_ms"], color="gray", ls="--", lw=1, label="goal: 1.2x the short prompt")
    ax.set_xticks(range(len(lengths)), [f"{h} tokens of history" for h in lengths])
    ax.set_ylabel("time to first token, ms (median, p99 whisker)")
    ax.set_title(f"{doc['model']}: prefix cache on {doc['hardware']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="qwen1.5b")
    ap.add_argument("--history", default="2000", help="tokens of the conversation so far (a comma list: each)")
    ap.add_argument("--turn", type=int, default=50, help="tokens of the new turn (and of the short prompt)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument(
        "--prefix-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engine.prefix_graphs: prefix hits' rests as CUDA graphs (on in serve's defaults)",
    )
    ap.add_argument("--cache-mb", type=float, default=256.0, help="prefix_cache_mb of the cached engine")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--plot-from", type=Path, help="only redraw the PNG of this result JSON (no GPU needed)")
    args = ap.parse_args()
    if args.plot_from:
        plot(json.loads(args.plot_from.read_text(encoding="utf-8")), args.plot_from.with_suffix(".png"))
        print(f"wrote {args.plot_from.with_suffix('.png')}")
        return
    doc = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefix_cache_gpu_{args.model}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    plot(doc, path.with_suffix(".png"))
    print(json.dumps({k: v for k, v in doc.items() if k == "ttft" or k.startswith("ratio_")}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
