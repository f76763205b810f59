"""The load generator: closed-loop (N workers) and open-loop (Poisson arrivals) runs of one load level.

Timing of one run (``t = 0`` when the warm-up starts, one clock shared by every worker process)::

    0 ──── warm-up ──── warmup_s ──────── measured ──────── warmup_s + duration_s (or N requests)

Only requests *sent* in the measured window count. Each of them ends as ``"ok"`` or an error label (the
target never raises and every task is awaited), so ``sent == answered + errors`` holds by construction and
the report checks it. Open-loop latency runs from the *scheduled* send time, so a slow server (or a slow
client) shows up as latency instead of silently lowering the offered rate (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from queue import Empty
from typing import Any, Literal

import numpy as np

from miaohui.bench import targets
from miaohui.bench.chat import ChatTarget
from miaohui.bench.targets import Target, TargetSpec
from miaohui.errors import ConfigError, MiaohuiError

Mode = Literal["closed", "open"]
LAG_TICK_S = 0.005
START_SLACK_S = 0.2


def make_target(spec: TargetSpec) -> Target:
    """The target ``spec`` names: :class:`~miaohui.bench.chat.ChatTarget` or one of :mod:`miaohui.bench.targets`."""
    return ChatTarget(spec) if spec.kind == "chat" else targets.make_target(spec)


class BenchError(MiaohuiError):
    """The load generator itself failed (not the system under test)."""


@dataclass(frozen=True)
class LoadPlan:
    """One load level. ``level`` is the concurrency (closed loop) or the rate in requests/s (open loop)."""

    mode: Mode
    level: float
    warmup_s: float = 2.0
    duration_s: float | None = 10.0
    requests: int | None = None
    """Measured requests to send (after the warm-up); with ``duration_s`` whichever ends first."""
    seed: int = 0
    processes: int = 1
    """Worker processes (a closed loop uses no more than its concurrency)."""

    def __post_init__(self) -> None:
        if self.duration_s is None and self.requests is None:
            raise ConfigError(
                "the run has no end: neither a duration nor a request count",
                "pass --duration 10 or --requests 1000",
            )
        if self.level <= 0:
            raise ConfigError(f"load level {self.level} must be > 0", "give a concurrency ≥ 1 or a rate > 0")
        if self.mode == "closed" and self.level != int(self.level):
            raise ConfigError(f"concurrency {self.level} is not a whole number", "give e.g. --concurrency 8")

    @property
    def workers(self) -> int:
        return max(1, min(self.processes, int(self.level))) if self.mode == "closed" else max(1, self.processes)

    @property
    def stop_at(self) -> float:
        return math.inf if self.duration_s is None else self.warmup_s + self.duration_s

    def share(self, index: int) -> LoadPlan:
        """The part of this plan worker process ``index`` of ``processes`` runs (a different seed each)."""
        n = self.workers
        if self.mode == "closed":
            level = float(int(self.level) // n + (1 if index < int(self.level) % n else 0))
        else:
            level = self.level / n  # a sum of independent Poisson streams is Poisson with the summed rate
        requests = None if self.requests is None else self.requests // n + (1 if index < self.requests % n else 0)
        return replace(self, level=level, requests=requests, seed=self.seed * 1009 + index, processes=1)


@dataclass
class RawRun:
    """What one process measured. Times are seconds on the run clock (0 = warm-up start)."""

    sent_at: list[float] = field(default_factory=list)
    """Scheduled (open loop) or actual (closed loop) send time of each measured request."""
    latency_s: list[float] = field(default_factory=list)
    status: list[str] = field(default_factory=list)
    sent: int = 0
    """Measured requests handed to the target (counted before sending, apart from the results)."""
    sent_total: int = 0
    """All requests sent, warm-up included (for the client's CPU cost per request)."""
    first_send: float = math.inf
    last_done: float = 0.0
    send_lag_s: list[float] = field(default_factory=list)
    """Open loop: how late each request left against its schedule (client overload shows here)."""
    loop_lag_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    """CPU seconds of the load-generator processes over the run (warm-up included)."""
    wall_s: float = 0.0
    processes: int = 1
    target_stats: dict[str, Any] = field(default_factory=dict)
    details: list[Any] = field(default_factory=list)
    """Per-request records of targets that keep one (the chat target's :class:`~miaohui.bench.chat.StreamRecord`),
    for the measured requests only, in completion order (not aligned with ``status``)."""

    def record(self, sent_at: float, done: float, status: str, detail: Any = None) -> None:
        self.sent_at.append(sent_at)
        self.latency_s.append(done - sent_at)
        self.status.append(status)
        self.last_done = max(self.last_done, done)
        if detail is not None:
            self.details.append(detail)

    def merge(self, other: RawRun) -> None:
        self.sent_at += other.sent_at
        self.latency_s += other.latency_s
        self.status += other.status
        self.details += other.details
        self.send_lag_s += other.send_lag_s
        self.loop_lag_s += other.loop_lag_s
        self.sent += other.sent
        self.sent_total += other.sent_total
        self.first_send = min(self.first_send, other.first_send)
        self.last_done = max(self.last_done, other.last_done)
        self.cpu_s += other.cpu_s
        self.wall_s = max(self.wall_s, other.wall_s)
        for key, value in other.target_stats.items():
            if isinstance(value, list) and isinstance(self.target_stats.get(key), list):
                self.target_stats[key] = self.target_stats[key] + value
            else:
                self.target_stats.setdefault(key, value)


def poisson_arrivals(
    rate: float, seed: int, horizon_s: float = math.inf, after_s: float = 0.0, count_after: int | None = None
) -> np.ndarray:
    """Arrival times of a Poisson process of ``rate``/s from 0: up to ``horizon_s``, and (if given) no
    more than ``count_after`` arrivals at or after ``after_s``. Deterministic for a seed."""
    if rate <= 0:
        raise ConfigError(f"rate {rate} must be > 0", "give --rate in requests per second, e.g. 200")
    if math.isinf(horizon_s) and count_after is None:
        raise ConfigError("a Poisson schedule needs a horizon or a count", "pass --duration or --requests")
    rng = np.random.default_rng(seed)
    chunks, t = [], 0.0
    chunk = int(min(max(rate * min(horizon_s, 60.0), 64), 1 << 20))
    while True:
        times = t + np.cumsum(rng.exponential(1.0 / rate, chunk))
        chunks.append(times)
        t = float(times[-1])
        done_count = count_after is not None and int((np.concatenate(chunks) >= after_s).sum()) >= count_after
        if t >= horizon_s or done_count:
            break
    out = np.concatenate(chunks)
    out = out[out < horizon_s]
    if count_after is not None:
        measured = np.flatnonzero(out >= after_s)
        if len(measured) > count_after:
            out = out[: measured[count_after]]
    return out


# ---------------------------------------------------------------------------------------------- one process


async def _loop_lag(clock: Callable[[], float], until: asyncio.Event, out: list[float]) -> None:
    """Oversleep of a 5 ms timer: how long ready callbacks wait for the event loop (client saturation)."""
    while not until.is_set():
        t = clock()
        await asyncio.sleep(LAG_TICK_S)
        out.append(max(0.0, clock() - t - LAG_TICK_S))


async def _closed(
    target: Target, texts: Iterator[str], plan: LoadPlan, clock: Callable[[], float], raw: RawRun
) -> None:
    budget = [plan.requests if plan.requests is not None else math.inf]

    async def worker() -> None:
        while True:
            t = clock()
            if t >= plan.stop_at:
                return
            measured = t >= plan.warmup_s
            if measured:
                if budget[0] <= 0:
                    return
                budget[0] -= 1
                raw.sent += 1
                raw.first_send = min(raw.first_send, t)
            raw.sent_total += 1
            status, detail = await target.send_detailed(next(texts))
            if measured:
                raw.record(t, clock(), status, detail)

    await asyncio.gather(*(worker() for _ in range(int(plan.level))))


async def _open(target: Target, texts: Iterator[str], plan: LoadPlan, clock: Callable[[], float], raw: RawRun) -> None:
    horizon = plan.stop_at
    schedule = poisson_arrivals(plan.level, plan.seed, horizon, plan.warmup_s, plan.requests)
    pending: set[asyncio.Task[None]] = set()

    async def one(text: str, at: float, measured: bool) -> None:
        status, detail = await target.send_detailed(text)
        if measured:
            raw.record(at, clock(), status, detail)

    burst = 0
    for at in schedule.tolist():
        delay = at - clock()
        if delay > 0:
            burst = 0
            await asyncio.sleep(delay)
        elif burst >= 64:  # behind schedule: still let answers in now and then
            burst = 0
            await asyncio.sleep(0)
        burst += 1
        measured = at >= plan.warmup_s
        if measured:
            raw.sent += 1
            raw.first_send = min(raw.first_send, at)
            raw.send_lag_s.append(max(0.0, clock() - at))
        raw.sent_total += 1
        task = asyncio.create_task(one(next(texts), at, measured))
        pending.add(task)
        task.add_done_callback(pending.discard)
    while pending:
        await asyncio.gather(*list(pending))


def cycle_texts(texts: list[str], seed: int) -> Iterator[str]:
    if not texts:
        raise ConfigError("no texts to send", "pass --texts FILE with at least one line, or use the dev split")
    order = np.random.default_rng(seed).permutation(len(texts))
    return itertools.cycle([texts[i] for i in order])


async def run_async(
    spec: TargetSpec,
    texts: list[str],
    plan: LoadPlan,
    start: float | None = None,
    on_measure: Callable[[], Any] | None = None,
) -> RawRun:
    """Run ``plan`` in this process against ``spec``. ``start`` is the ``time.time()`` at which the run
    clock is 0 (worker processes share it); ``on_measure`` is awaited when the measured window opens."""
    target = make_target(
        replace(spec, max_connections=max(spec.max_connections, int(plan.level))) if plan.mode == "closed" else spec
    )
    await target.open()
    raw = RawRun()
    try:
        if start is not None:
            await asyncio.sleep(max(0.0, start - time.time()))
        base = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - base

        stop = asyncio.Event()
        lag = asyncio.create_task(_loop_lag(clock, stop, raw.loop_lag_s))
        hook = asyncio.create_task(_at(plan.warmup_s, clock, on_measure)) if on_measure else None
        asyncio.get_running_loop().call_later(plan.warmup_s, target.reset_stats)
        cpu0 = time.process_time()
        run = _closed if plan.mode == "closed" else _open
        await run(target, cycle_texts(texts, plan.seed), plan, clock, raw)
        raw.cpu_s, raw.wall_s = time.process_time() - cpu0, clock()
        stop.set()
        await lag
        if hook is not None:
            await hook
        raw.target_stats = target.stats()
    finally:
        await target.close()
    return raw


async def _at(t: float, clock: Callable[[], float], fn: Callable[[], Any]) -> None:
    """Call ``fn`` (blocking, e.g. a /metrics scrape) in a thread at run time ``t``."""
    await asyncio.sleep(max(0.0, t - clock()))
    await asyncio.to_thread(fn)


def run_sync(
    spec: TargetSpec,
    texts: list[str],
    plan: LoadPlan,
    start: float | None = None,
    on_measure: Callable[[], Any] | None = None,
) -> RawRun:
    """:func:`run_async` on a fresh event loop (uvloop where installed)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run_async(spec, texts, plan, start, on_measure))


# ---------------------------------------------------------------------------------------------- processes


def _child(spec: TargetSpec, texts: list[str], plan: LoadPlan, ready: Any, go: Any, start: Any, out: Any) -> None:
    try:
        ready.put(None)
        go.wait()
        out.put(run_sync(spec, texts, plan, start.value))
    except BaseException as exc:  # report, never hang the parent
        out.put(exc)


def run_processes(
    spec: TargetSpec,
    texts: list[str],
    plan: LoadPlan,
    on_measure: Callable[[], Any] | None = None,
    on_done: Callable[[], Any] | None = None,
) -> RawRun:
    """Split ``plan`` over ``plan.processes`` worker processes (one clock), merge what they measured.

    ``on_measure`` runs in this process when the measured window opens (e.g. a /metrics scrape)."""
    if plan.workers <= 1:
        raw = run_sync(spec, texts, plan, on_measure=on_measure)
        if on_done is not None:
            on_done()
        return raw
    ctx = mp.get_context("spawn")
    ready, out, go, start = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    procs = [
        ctx.Process(target=_child, args=(spec, texts, plan.share(i), ready, go, start, out), daemon=True)
        for i in range(plan.workers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        _get(ready, procs)
    start.value = time.time() + START_SLACK_S
    go.set()
    if on_measure is not None:
        time.sleep(max(0.0, start.value + plan.warmup_s - time.time()))
        on_measure()
    merged = RawRun(processes=len(procs))
    errors: list[BaseException] = []
    for _ in procs:
        got = _get(out, procs)
        if isinstance(got, BaseException):
            errors.append(got)
        else:
            merged.merge(got)
    for p in procs:
        p.join(timeout=30)
    if errors:
        raise errors[0]
    if on_done is not None:
        on_done()
    return merged


def _get(queue: Any, procs: list[Any]) -> Any:
    """Next item of ``queue``; an error instead of a hang if a worker process died without a word."""
    while True:
        try:
            return queue.get(timeout=0.5)
        except Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise BenchError(
                    f"load worker process exited with code {dead[0].exitcode} before reporting",
                    "run with --processes 1 to see its error",
                ) from None
