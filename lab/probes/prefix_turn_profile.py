"""Where a prefix-cache hit's time to first token goes on the GPU slot engine: the turn after a cached history and a
short prompt alone, as ``benchmarks/bench_prefix_cache_gpu.py`` times them, under cProfile (host) and
``torch.profiler`` (host ops and device kernels):

    python -m lab.probes.prefix_turn_profile --history 2000 --turn 50 --out DIR        (on a GPU)

Writes DIR/prefix_turn_profile.txt: per kind (``short``, ``turn_cached``) the wall times and cProfile's top functions by
cumulative time over ``--iters`` requests, and the profiler's top operations by host and by device time for one more
request (a turn's history is run before the profiler starts).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import numpy as np
import torch
from benchmarks.bench_prefix_cache_gpu import ONE, SHAPES, _engine

from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.scheduler import SchedulerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="qwen1.5b")
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--turn", type=int, default=50)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--prefix-graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    engine = _engine(args, "cuda" if torch.cuda.is_available() else "cpu")
    sched = {"max_model_len": args.max_len, "max_batched_tokens": args.max_len}
    llm = LLMEngine(engine, None, SchedulerConfig(prefix_cache_mb=256.0, **sched))
    rng = np.random.default_rng(0)
    vocab = SHAPES[args.model].vocab

    def words(n: int) -> list[int]:
        return [int(t) for t in rng.integers(10, vocab, n)]

    def prompts(kind: str) -> list[int]:
        if kind == "short":
            return words(args.turn)
        history = words(args.history)
        llm.generate([history], ONE)  # cached, not timed
        return history + words(args.turn)

    for kind in ("short", "turn_cached"):  # warm-up, as the bench's first iterations
        for _ in range(3):
            llm.generate([prompts(kind)], ONE)
    report = io.StringIO()
    for kind in ("short", "turn_cached"):
        walls, prof = [], cProfile.Profile()
        for _ in range(args.iters):
            p = prompts(kind)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            prof.enable()
            llm.generate([p], ONE)
            prof.disable()
            walls.append(time.perf_counter() - t)
        p = prompts(kind)  # one more, under torch.profiler alone (the history's own run outside it)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as tprof:
            llm.generate([p], ONE)
        report.write(f"=== {kind}: wall ms {[round(1e3 * w, 2) for w in walls]}\n")
        stats = io.StringIO()
        pstats.Stats(prof, stream=stats).sort_stats("cumulative").print_stats(45)
        report.write(stats.getvalue())
        report.write(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        report.write("\n")
        report.write(tprof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
        report.write("\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_turn_profile.txt").write_text(report.getvalue(), encoding="utf-8")
    print(report.getvalue()[:3000])


if __name__ == "__main__":
    main()
