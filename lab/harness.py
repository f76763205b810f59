"""The lab's one timing harness: every probe times GPU work through it and writes its JSON through it.

Timing (``time_graph``): the work is warmed up on a side stream, captured as one CUDA graph of ``reps`` calls, and
its replays are timed with CUDA events after warm-up replays; the result is the median and p99 per call over
``iters`` replays. A graph takes the launch gaps out, so the figure is the GPU's time for the work. Work that reads
the same weights every call measures the cache: :func:`rotating` makes each call read the next of several copies.
On the CPU (``cuda`` False) the work runs once, untimed: a smoke test of the probe under Triton's interpreter.

Reports (:func:`write_report`): ``{"provenance": {date, commit, command, gpu, versions}, **payload}``, so a result
file says what measured it, where and when.

    python -m lab.probes.attn_probe --out /tmp/attn      # from the repository root
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from miaohui.bench.report import git_commit

REPLAYS = 30
"""Timed replays per measurement."""
WARMUP = 5
"""Replays before the timed ones (the first call of a graph pays for its upload)."""


def capture(fn: Callable[[], Any], reps: int = 1, warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` warmed up ``warmup`` times on a side stream, then captured ``reps`` times as one graph; returns the
    graph and the last call's output (static: each replay writes it again)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(reps):
            out = fn()
    return graph, out


def replay_us(replay: Callable[[], Any], iters: int = REPLAYS, warmup: int = WARMUP, per: int = 1) -> list[float]:
    """µs of each of ``iters`` calls of ``replay`` (CUDA events around each), divided by ``per``."""
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in pairs:
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1000 / per for start, end in pairs]


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median and p99 (nearest rank) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return {"median": float("nan"), "p99": float("nan"), "n": 0}
    return {"median": statistics.median(ordered), "p99": ordered[round(0.99 * (len(ordered) - 1))], "n": len(ordered)}


def time_graph_stats(fn: Callable[[], Any], reps: int = 1, iters: int = REPLAYS) -> dict[str, float]:
    """Median and p99 µs of one ``fn()``, timed as a graph of ``reps`` calls (see the module)."""
    graph, _ = capture(fn, reps)
    return summary(replay_us(graph.replay, iters, per=reps))


def time_graph(fn: Callable[[], Any], reps: int = 1, cuda: bool = True, iters: int = REPLAYS) -> float:
    """Median µs of one ``fn()`` (:func:`time_graph_stats`); on the CPU one untimed call and NaN."""
    if not cuda:
        fn()
        return float("nan")
    return time_graph_stats(fn, reps, iters)["median"]


def rotating(fn: Callable[..., Any], *args: Any, items: Sequence[Any]) -> Callable[[], Any]:
    """A call of ``fn(*args, item)`` over the next of ``items`` each time (a captured graph holds every pointer in
    turn), so repeated calls do not read one copy from the cache."""
    turn = [0]

    def call() -> Any:
        turn[0] = (turn[0] + 1) % len(items)
        return fn(*args, items[turn[0]])

    return call


def provenance() -> dict[str, Any]:
    """Date, commit, command, GPU and library versions of this run."""
    commit = git_commit()
    versions: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                                "cuda": torch.version.cuda}  # fmt: skip
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    gpu: dict[str, Any] = {"name": platform.processor() or "cpu"}
    if torch.cuda.is_available():
        from miaohui.models import cublaslt

        gpu = {
            "name": torch.cuda.get_device_name(),
            "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        }
        versions["cublaslt"] = cublaslt.version_or_none()
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": gpu,
        "versions": versions,
    }


def write_report(out: Path, name: str, payload: dict[str, Any]) -> Path:
    """``payload`` with :func:`provenance` as ``out/name.json``; returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"provenance": provenance(), **payload}, indent=1, default=str))
    return path
