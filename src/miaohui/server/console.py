"""The web console: static pages at ``/ui`` and the two JSON routes they read.

* ``/ui/`` — chat (dialogue pipelines and chat models), the model repository, live plots; plain HTML, CSS and
  JavaScript shipped with the package (``server/ui/``), no CDN and no front-end build.
* ``GET /v1/console/summary?window_s=300`` — the live plots' data: per sampling interval, requests/s, p50 and p99
  request latency, queue depth and mean batch size.
* ``GET /v1/console/models`` — the repository as this server sees it (each model and version: backend, precision,
  state, load and warm-up seconds), the causal LMs, the dialogue pipelines, and whether load/unload is allowed here
  (with ``--workers N`` it is not, and the reason says why).

Where the plot data comes from: :class:`ConsoleSampler`, a task of the server's event loop, reads the cumulative
counters of the server's :class:`~miaohui.server.metrics.Metrics` (the same values ``/metrics`` renders; the totals
of every worker with ``--workers N``) every ``interval_s`` into a ring buffer of ``keep_s`` seconds. A point of the
summary is the difference of two neighbouring samples: requests/s is the change of ``miaohui_requests_total``, the
latency quantiles are interpolated within the buckets of ``miaohui_request_duration_seconds`` that changed (as
PromQL's ``histogram_quantile`` does), batch size is the change of ``miaohui_batch_size``'s sum over its count, and
queue depth is ``miaohui_queue_depth`` summed over the models at the later sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from miaohui.errors import ConfigError, MiaohuiError
from miaohui.server.metrics import LATENCY_BUCKETS, Metrics
from miaohui.server.state import check_model_control
from miaohui.server.status import message

if TYPE_CHECKING:
    from prometheus_client.samples import Sample

    from miaohui.server.state import ServerState

__all__ = ["UI_DIR", "ConsoleSampler", "Snapshot", "console_router", "mount_console", "quantile"]

UI_DIR = Path(__file__).resolve().parent / "ui"
"""The console's static files (package data)."""
INTERVAL_S = 1.0
"""Seconds between two samples of the counters: one plot point per second, cheap next to any request."""
KEEP_S = 600.0
"""Seconds of history the ring buffer keeps (the plots show the last minutes)."""


@dataclass(frozen=True)
class Snapshot:
    """The cumulative counters at one moment (monotonic and wall-clock time)."""

    t: float
    wall: float
    requests: float
    latency_buckets: tuple[float, ...]
    """Cumulative count per bucket of :data:`LATENCY_BUCKETS`, then +Inf."""
    queue_depth: float
    batches: float
    batch_rows: float


def quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """The ``q`` quantile of observations in cumulative ``counts`` per upper bound (the last one +Inf), linearly
    interpolated within its bucket as PromQL's ``histogram_quantile``; None without observations. An answer in the
    +Inf bucket is the largest finite bound."""
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    for i, count in enumerate(counts):
        if count >= rank:
            if i >= len(bounds):
                return bounds[-1]
            lower = bounds[i - 1] if i else 0.0
            below = counts[i - 1] if i else 0.0
            inside = count - below
            return lower + (bounds[i] - lower) * ((rank - below) / inside if inside > 0 else 1.0)
    return bounds[-1]


class ConsoleSampler:
    """A ring buffer of :class:`Snapshot` s of ``metrics``, taken every ``interval_s`` by a task of the event loop."""

    def __init__(self, metrics: Metrics, interval_s: float = INTERVAL_S, keep_s: float = KEEP_S) -> None:
        if interval_s <= 0 or keep_s < interval_s:
            raise ConfigError(
                f"console sampling every {interval_s} s keeping {keep_s} s is not possible",
                "give interval_s > 0 and keep_s >= interval_s",
            )
        self.metrics = metrics
        self.interval_s = interval_s
        self.samples: deque[Snapshot] = deque(maxlen=int(keep_s / interval_s) + 1)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sampling (on the running event loop); a second call does nothing."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="console-sampler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def sample(self) -> Snapshot:
        """Read the counters now and append them to the ring buffer."""
        snap = self.snapshot()
        self.samples.append(snap)
        return snap

    def snapshot(self) -> Snapshot:
        m = self.metrics
        families = _families(m, ("miaohui_requests", "miaohui_request_duration_seconds", "miaohui_queue_depth",
                                 "miaohui_batch_size"))  # fmt: skip
        bounds = [*LATENCY_BUCKETS, math.inf]
        buckets = [0.0] * len(bounds)
        for s in families["miaohui_request_duration_seconds"]:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                if le in bounds:
                    buckets[bounds.index(le)] += s.value
        batch = families["miaohui_batch_size"]
        return Snapshot(
            t=time.monotonic(),
            wall=time.time(),
            requests=sum(s.value for s in families["miaohui_requests"] if s.name.endswith("_total")),
            latency_buckets=tuple(buckets),
            queue_depth=sum(s.value for s in families["miaohui_queue_depth"]),
            batches=sum(s.value for s in batch if s.name.endswith("_count")),
            batch_rows=sum(s.value for s in batch if s.name.endswith("_sum")),
        )

    def summary(self, window_s: float) -> dict[str, Any]:
        """The points of the last ``window_s`` seconds (one per pair of neighbouring samples), oldest first."""
        samples = list(self.samples)
        newest = samples[-1].t if samples else 0.0
        recent = [s for s in samples if s.t >= newest - window_s - self.interval_s / 2]
        points = [_point(a, b) for a, b in itertools.pairwise(recent)]
        return {
            "source": "ring buffer of the server's Metrics, sampled every interval_s",
            "interval_s": self.interval_s,
            "window_s": window_s,
            "requests_total": samples[-1].requests if samples else 0.0,
            "points": points,
        }


def _point(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    dt = max(b.t - a.t, 1e-9)
    delta = tuple(y - x for x, y in zip(a.latency_buckets, b.latency_buckets, strict=True))
    p50, p99 = (quantile(q, LATENCY_BUCKETS, delta) for q in (0.5, 0.99))
    batches = b.batches - a.batches
    return {
        "t": round(b.wall, 3),
        "rps": round((b.requests - a.requests) / dt, 3),
        "p50_ms": None if p50 is None else round(p50 * 1000, 3),
        "p99_ms": None if p99 is None else round(p99 * 1000, 3),
        "queue_depth": b.queue_depth,
        "batch_size": round((b.batch_rows - a.batch_rows) / batches, 3) if batches > 0 else None,
    }


def _families(metrics: Metrics, names: Iterable[str]) -> dict[str, list[Sample]]:
    """The samples of the named metric families: this process's, or every worker's totals (``--workers N``)."""
    wanted = set(names)
    found: dict[str, list[Sample]] = {n: [] for n in wanted}
    collected: Iterable[Any]
    if metrics.multiprocess:
        collected = metrics.exposition.collect()
    else:
        own = (metrics.requests, metrics.request_seconds, metrics.queue_depth, metrics.batch_size)
        collected = (family for metric in own for family in metric.collect())
    for family in collected:
        if family.name in wanted:
            found[family.name].extend(family.samples)
    return found


# ---------------------------------------------------------------------------------------------- routes


def models_view(state: ServerState) -> dict[str, Any]:
    """``GET /v1/console/models``: what the models page shows."""
    manager = state.manager
    loaded = {s.name: s for s in manager.states()}
    rows: list[dict[str, Any]] = []
    for entry in manager.index():
        st = loaded.get(entry["name"])
        served = st.versions.get(int(entry["version"])) if st is not None and entry["version"] else None
        row: dict[str, Any] = {"name": entry["name"], "version": entry["version"], "state": entry["state"]}
        row["reason"] = entry["reason"]
        if served is not None:
            timings = served.start_timings()
            row |= {
                "task": served.manifest.task,
                "backend": served.manifest.backend,
                "precision": served.manifest.precision,
                "ready": served.ready,
                "load_s": timings.get("load"),
                "warmup_s": timings.get("warmup"),
                "compile_s": timings.get("compile"),
                "max_batch": served.max_batch,
            }
        rows.append(row)
    llms = [
        {"name": llm.name, "version": llm.version, "backend": llm.info.backend, "precision": llm.info.precision,
         "ready": llm.ready, "chat": llm.info.chat_template is not None}
        for st in manager.chat_states() for llm in st.versions.values()
    ]  # fmt: skip
    try:
        check_model_control(state)
        control = {"allowed": True, "reason": ""}
    except MiaohuiError as exc:
        control = {"allowed": False, "reason": message(exc)}
    pipelines = state.dialogue.describe() if state.dialogue is not None else []
    return {"models": rows, "llms": llms, "pipelines": pipelines, "control": control}


def console_router(state: ServerState, sampler: ConsoleSampler) -> APIRouter:
    router = APIRouter()

    @router.get("/ui", include_in_schema=False)
    async def ui() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @router.get("/v1/console/summary")
    async def summary(window_s: float = Query(300.0, gt=0, le=KEEP_S)) -> dict[str, Any]:
        return sampler.summary(window_s)

    @router.get("/v1/console/models")
    async def models() -> dict[str, Any]:
        return models_view(state)

    return router


def mount_console(app: FastAPI, state: ServerState) -> ConsoleSampler:
    """Add the console's routes and static files to ``app``; the sampler, for the lifespan to start and stop."""
    sampler = ConsoleSampler(state.metrics)
    app.include_router(console_router(state, sampler))
    app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")
    return sampler
