"""Probe (H200): where a ``fast-graphs`` engine's start goes in a fresh process. Loads the version at ARGV[1] and
captures every bucket under cProfile; prints the Triton cache's file count before and after (more after = kernels
compiled again, not loaded), per-phase seconds and the top functions.

    TRITON_CACHE_DIR=$(mktemp -d) python lab/profile_fast_graphs_load.py VERSION_DIR
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path


def files(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file())


def main() -> None:
    started = time.perf_counter()
    import torch  # noqa: F401

    from miaohui.engines.fast_graphs import triton_cache_dir
    from miaohui.engines.inductor_engine import InductorEngine
    from miaohui.engines.loader import load_engine

    imported = time.perf_counter() - started
    cache = triton_cache_dir()
    before = files(cache) if cache.is_dir() else 0
    prof = cProfile.Profile()
    prof.enable()
    engine = load_engine(Path(sys.argv[1]))
    assert isinstance(engine, InductorEngine)
    after_load = files(cache)
    t = time.perf_counter()
    for b, s in engine.all_buckets():
        engine.capture(b, s)
    captured = time.perf_counter() - t
    prof.disable()
    print(
        f"imports {imported:.2f}s; phases {engine.start_phases}; capture loop {captured:.2f}s "
        f"({len(engine.all_buckets())} buckets); triton cache files {before} → {after_load} → {files(cache)}"
    )
    import os

    print("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR"), "knobs", triton_cache_dir())
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(18)
    stats.sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
