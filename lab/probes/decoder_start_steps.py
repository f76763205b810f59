"""Where a built GPU decoder's start goes, step by step in one fresh process (issue 43, goal 2), on the version folder
``build-llm --backend inductor`` wrote (precompiled graphs in it):

    python -m lab.probes.decoder_start_steps VERSION_DIR --out DIR        (on a GPU; new empty compile caches)

Times: the imports, CUDA's initialisation, the serve defaults, ``load_slot_engine`` (weights, the Triton restore, the
precompiled graphs' load, profiled with cProfile), the warm-up as serve runs it (``defer``: the buckets of the first
requests before ready; ``--no-defer``: every graph) with per-graph capture times from the engine's log lines, then the
graphs left for after ready on the engine's background thread. Writes DIR/decoder_start_steps.json and
DIR/decoder_start_load_profile.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

started = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("version", type=Path)
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--no-defer", action="store_true", help="capture every graph before ready")
    ap.add_argument("--tag", default="", help="suffix of the output files")
    ap.add_argument("--ready-rows", type=int, default=None, help="engine.ready_rows instead of the default")
    ap.add_argument("--ready-tokens", type=int, default=None, help="engine.ready_tokens instead of the default")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s: %(message)s")
    fresh = Path(tempfile.mkdtemp(prefix="start-steps-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(fresh / "triton")
    steps: dict[str, float] = {}

    def mark(name: str, since: float) -> float:
        now = time.perf_counter()
        steps[name] = round(now - since, 3)
        print(f"{name}: {steps[name]:.3f}s", flush=True)
        return now

    t = time.perf_counter()
    import torch

    t = mark("import torch", t)
    import miaohui.generation.build.static_artifact as sa
    import miaohui.generation.executors.slot_engine  # noqa: F401

    t = mark("import miaohui engine", t)
    torch.cuda.init()
    total = torch.cuda.mem_get_info()[1]
    t = mark("cuda init + mem_get_info", t)
    defaults = sa.serve_defaults(args.version, None, total)
    t = mark("serve defaults", t)
    import cProfile
    import pstats

    lines: list[str] = []

    class Keep:
        def write(self, s: str) -> None:
            lines.append(s)

    profile = cProfile.Profile()
    profile.enable()
    options = defaults.engine
    for field in ("ready_rows", "ready_tokens"):
        if getattr(args, field) is not None:
            options = options.model_copy(update={field: getattr(args, field)})
    engine = sa.load_slot_engine(args.version, options)
    profile.disable()
    t = mark("load_slot_engine", t)
    stats = pstats.Stats(profile, stream=Keep())  # type: ignore[arg-type]
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(30)
    (args.out / f"decoder_start_load_profile{args.tag}.txt").write_text("".join(lines))
    logs: list[tuple[float, str]] = []
    engine.warmup(log=lambda m: logs.append((round(time.perf_counter() - t, 3), m)), defer=not args.no_defer)
    t = mark("warmup", t)
    pending = engine.pending_graphs
    thread = engine.capture_deferred(log=lambda m: logs.append((round(time.perf_counter() - t, 3), m)))
    if thread is not None:
        thread.join()
    t = mark("capture after ready", t)
    result = {
        "version": str(args.version),
        "ready_rows": options.ready_rows,
        "ready_tokens": options.ready_tokens,
        "steps_s": steps,
        "since_process_start_s": round(time.perf_counter() - started, 2),
        "engine_start_phases": {k: round(v, 3) for k, v in engine.start_phases.items()},
        "graphs_after_ready": pending,
        # kernels that benchmarked their launch configs in this process (each writes a .best_config): 0 measured
        "autotuned_here": len(list((fresh / "inductor").rglob("*.best_config"))),
        "graphs": {
            "decode": len(engine._graphs),
            "prefill": len(engine._prefill_graphs),
            "mixed": len(engine._mixed_graphs),
        },
        "pycache_prefix": os.environ.get("PYTHONPYCACHEPREFIX"),
        "warmup_log": logs,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    (args.out / f"decoder_start_steps{args.tag}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["steps_s"]))


if __name__ == "__main__":
    main()
