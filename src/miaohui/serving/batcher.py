"""Dynamic batcher: gathers single requests into batches for one model, like Triton's dynamic batcher.

Pure asyncio and generic over the payload ``P`` and result ``R``; no torch, no numpy. The engine side is
one callable, ``run_batch(payloads) -> results`` (one result or exception per payload, in order).

Each model instance has one *owner* task. An owner repeatedly asks the queue for a batch
(:meth:`DynamicBatcher._select`) and computes it. How a batch is chosen:

1. Requests are grouped by sequence-length bucket (``length_buckets``); a batch holds one bucket only.
2. For each bucket, walk its queue from the oldest request and count how many fit one batch: at most
   ``max_batch_size`` requests and, if ``max_batch_tokens`` is set, at most that many padded tokens
   (batch size x longest length). Requests whose deadline already passed are failed here, before compute.
3. A bucket is *ready* when it is full (a limit stopped the count), when it holds the largest preferred
   batch size that fits (then exactly that size is taken), when its oldest request has waited
   ``max_queue_delay_ms``, or when the batcher drains on stop.
4. Of the ready buckets, the one whose oldest request is oldest goes first. The oldest request of the
   whole queue makes its bucket ready after ``max_queue_delay_ms`` at the latest, so a bucket with little
   traffic waits behind earlier work only and is never starved by a busy bucket.
5. If nothing is ready, the owner sleeps until a request arrives or the oldest head's delay runs out.

A bad request fails alone: per-item exceptions go to their callers only, and if ``run_batch`` raises for a
whole batch the batch is bisected and retried until the culprit is alone. Requests whose callers went away
(cancelled, deadline passed) are dropped before compute and counted by the observer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import Field, field_validator, model_validator

from miaohui.config import Frozen
from miaohui.errors import (
    ConfigError,
    DeadlineExceededError,
    InputError,
    MiaohuiError,
    QueueFullError,
    UnavailableError,
)
from miaohui.priority import PRIORITY

logger = logging.getLogger(__name__)

P = TypeVar("P")
R = TypeVar("R")

RejectReason = Literal["queue_full", "deadline", "cancelled", "shutdown"]
RunBatch = Callable[[list[P]], Awaitable[Sequence[R | BaseException]]]


class BatcherConfig(Frozen):
    """How one model's requests are gathered into batches (a model's ``config.yaml`` batching fields)."""

    max_batch_size: int = Field(default=32, ge=1)
    """Most requests in one batch."""
    max_queue_delay_ms: float = Field(default=5.0, ge=0.0)
    """Longest a request waits for others to join its batch; 0 sends what is queued at once."""
    preferred_batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    """Batch sizes the engine runs best (e.g. its CUDA-graph sizes). When the queue holds the largest one
    that fits, exactly that many are sent without waiting. Order does not matter; each ≤ max_batch_size."""
    max_queue_size: int = Field(default=256, ge=1)
    """Most requests waiting (not counting those in compute); more are rejected (HTTP 429)."""
    max_batch_tokens: int | None = Field(default=None, ge=1)
    """Padded-token budget per batch (batch size x longest length), e.g. 8192; None = no budget.
    A batch closes when adding the next request would exceed it; one request alone is always allowed."""
    length_buckets: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    """Sequence-length boundaries, e.g. [16, 32, 64, 128, 256, 512]: a request of length L goes to the
    first bucket with L ≤ boundary (longer ones share a last bucket); a batch holds one bucket only,
    which limits padding. Empty = one bucket for all lengths."""
    instances: int = Field(default=1, ge=1)
    """Model instances, each with its own owner task; that many batches compute at once."""
    default_timeout_ms: float | None = Field(default=None, gt=0.0)
    """Deadline for requests submitted without one; None = wait as long as it takes."""

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _sorted_sizes(cls, v: list[int]) -> list[int]:
        return sorted(set(v))

    @field_validator("length_buckets")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if any(a >= b for a, b in itertools.pairwise(v)):
            raise ConfigError(
                f"length_buckets {v} is not strictly increasing",
                "list the sequence-length boundaries from small to large without repeats, "
                "e.g. [16, 32, 64, 128, 256, 512]",
            )
        return v

    @model_validator(mode="after")
    def _preferred_fit(self) -> BatcherConfig:
        too_big = [s for s in self.preferred_batch_sizes if s > self.max_batch_size]
        if too_big:
            raise ConfigError(
                f"preferred_batch_sizes {self.preferred_batch_sizes} has sizes above "
                f"max_batch_size={self.max_batch_size}: {too_big}",
                f"remove {too_big} from preferred_batch_sizes or raise max_batch_size to at least {too_big[-1]}",
            )
        return self


class BatcherObserver:
    """Hooks called where the batcher decides; the server implements them with Prometheus metrics.

    Every method is a no-op here. An exception raised by a hook is logged and never reaches the batcher.
    """

    def on_enqueue(self, queue_depth: int) -> None:
        """A request joined the queue, which now holds ``queue_depth`` requests."""

    def on_dequeue(self, queue_depth: int) -> None:
        """A batch was taken out of the queue; ``queue_depth`` requests are left (keeps gauges fresh)."""

    def on_reject(self, reason: RejectReason) -> None:
        """A request was answered without a result: queue full, deadline passed, caller cancelled, or the
        batcher stopped before computing it."""

    def on_batch(self, size: int, tokens: int, padded_tokens: int, queue_wait_s: list[float]) -> None:
        """A batch was formed: ``size`` requests, their ``tokens`` (sum of lengths), ``padded_tokens``
        (size x longest length) and how long each waited in the queue."""

    def on_compute(self, seconds: float, size: int, ok: bool) -> None:
        """``run_batch`` returned (``ok``) or raised after ``seconds``; retries of a failed batch report
        their own calls."""

    def on_stage(self, stage: str, seconds: float) -> None:
        """Not the batcher's: the served model reports the parts around it through the same observer —
        per request ``tokenize`` and ``slots``, per batch the engine's own stages (on a GPU ``h2d``, ``gpu``,
        ``d2h``). Called from the event loop or an engine thread."""


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class _Item(Generic[P, R]):
    payload: P
    length: int
    bucket: int
    deadline: float | None
    enqueued: float
    seq: int
    future: asyncio.Future[R]
    state: _State = field(default=_State.QUEUED)
    bulk: bool = False
    """Queued by a bulk-class key: interactive requests are queued ahead of it."""

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class DynamicBatcher(Generic[P, R]):
    """Queue plus one owner task per model instance; see the module docstring for how batches form.

    Use ``start()`` (inside a running event loop) then ``await submit(...)``; ``await stop()`` at the end.
    ``async with batcher:`` does both.
    """

    def __init__(
        self,
        run_batch: RunBatch[P, R],
        config: BatcherConfig | None = None,
        observer: BatcherObserver | None = None,
        name: str = "model",
    ) -> None:
        self.config = config or BatcherConfig()
        self.name = name
        self._run_batch = run_batch
        self._observer = observer or BatcherObserver()
        self._buckets: dict[int, deque[_Item[P, R]]] = {}
        self._seq = itertools.count()
        self._wakeup = asyncio.Event()
        self._owners: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._in_flight = 0

    # ---------------------------------------------------------------- public API

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch (not counting those in compute)."""
        return sum(len(q) for q in self._buckets.values())

    @property
    def in_flight(self) -> int:
        """Requests in a batch that is being computed."""
        return self._in_flight

    def start(self) -> None:
        """Start one owner task per instance. Call from inside the running event loop."""
        if self._started:
            return
        self._started = True
        self._owners = [
            asyncio.create_task(self._owner(i), name=f"miaohui-batcher-{self.name}-{i}")
            for i in range(self.config.instances)
        ]

    async def stop(self, drain: bool = True) -> None:
        """Stop taking requests. ``drain``: compute everything queued (without waiting for the delay);
        otherwise queued requests fail with :class:`UnavailableError` (HTTP 503). Batches already computing finish
        either way. When this returns, no request's future is pending."""
        self._closed = True
        if not drain:
            for item in [item for q in self._buckets.values() for item in q]:
                self._reject_queued(item, "shutdown", self._shutdown_error())
        self._notify()
        await asyncio.gather(*self._owners, return_exceptions=True)
        for item in [item for q in self._buckets.values() for item in q]:  # owners died or never started
            self._reject_queued(item, "shutdown", self._shutdown_error())

    async def submit(self, payload: P, length: int, deadline: float | None = None) -> R:
        """Queue one request and wait for its result.

        ``length`` is its sequence length in tokens (bucketing, token budget). ``deadline`` is in
        ``time.monotonic()`` seconds; None uses ``default_timeout_ms`` if set. Raises
        :class:`QueueFullError` (429) at once when the queue is full, :class:`UnavailableError` (503) once the
        batcher stopped,
        :class:`DeadlineExceededError` when the deadline passes first, :class:`InputError` for a bad length,
        or the exception ``run_batch`` gave for this request.
        """
        item = self._enqueue(payload, length, deadline)
        try:
            return await self._wait(item)
        except asyncio.CancelledError:
            self._abandon(item, "cancelled")
            raise

    def submit_many(self, requests: Sequence[tuple[P, int]], deadline: float | None = None) -> asyncio.Task[list[R]]:
        """Queue every ``(payload, length)`` *now* and return a task that resolves to their results in order.

        Unlike ``gather(*(submit(...)))`` the rows are in the queue when this returns, so the caller can do other
        work (e.g. slot extraction) while they are batched and computed. Raises at once like :meth:`submit`
        (then none of them stays queued). Cancelling the task drops the rows still queued; when one row fails,
        the others are dropped too and the task raises that row's error.
        """
        items: list[_Item[P, R]] = []
        try:
            for payload, length in requests:
                items.append(self._enqueue(payload, length, deadline))
        except BaseException:
            for item in items:
                self._abandon(item, "cancelled")
            raise
        task = asyncio.get_running_loop().create_task(self._collect(items))

        def dropped(t: asyncio.Task[list[R]]) -> None:
            if t.cancelled():  # also when cancelled before it ever ran
                for item in items:
                    self._abandon(item, "cancelled")

        task.add_done_callback(dropped)
        return task

    async def __aenter__(self) -> DynamicBatcher[P, R]:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(drain=True)

    # ---------------------------------------------------------------- caller side

    def _enqueue(self, payload: P, length: int, deadline: float | None) -> _Item[P, R]:
        if self._closed:
            self.observe("on_reject", "shutdown")
            raise self._shutdown_error()
        if not self._started:
            raise MiaohuiError(
                f"batcher for {self.name!r} is not started",
                "call batcher.start() inside the event loop (or use `async with batcher:`)",
            )
        if length < 1:
            raise InputError(f"request length {length} is below 1", "pass the request's token count (≥ 1)")
        now = time.monotonic()
        deadline = self._resolve_deadline(deadline, now)
        depth = self.queue_depth
        if depth >= self.config.max_queue_size:
            self.observe("on_reject", "queue_full")
            raise QueueFullError(
                f"queue of {self.name!r} is full ({depth} of max_queue_size={self.config.max_queue_size} "
                "requests waiting)",
                "retry later with backoff, or raise max_queue_size / instances in the model's config",
            )
        loop = asyncio.get_running_loop()
        item: _Item[P, R] = _Item(
            payload, length, self._bucket_of(length), deadline, now, next(self._seq), loop.create_future()
        )
        item.bulk = PRIORITY.get() == "bulk"
        bucket = self._buckets.setdefault(item.bucket, deque())
        if item.bulk or not bucket or not bucket[-1].bulk:
            bucket.append(item)
        else:  # interactive: ahead of the bulk requests waiting in its bucket
            bucket.insert(next(i for i, queued in enumerate(bucket) if queued.bulk), item)
        self.observe("on_enqueue", depth + 1)
        self._notify()
        return item

    def _resolve_deadline(self, deadline: float | None, now: float) -> float | None:
        if deadline is None and self.config.default_timeout_ms is not None:
            deadline = now + self.config.default_timeout_ms / 1000.0
        if deadline is not None and deadline <= now:
            self.observe("on_reject", "deadline")
            raise DeadlineExceededError(
                f"request deadline passed {1000 * (now - deadline):.1f} ms before it was submitted",
                "give a deadline in the future, in time.monotonic() seconds, or a longer timeout",
            )
        return deadline

    async def _wait(self, item: _Item[P, R]) -> R:
        timeout = None if item.deadline is None else max(0.0, item.deadline - time.monotonic())
        done, _ = await asyncio.wait((item.future,), timeout=timeout)
        if not done:
            where = "computing" if item.state is _State.RUNNING else "queued"
            self._abandon(item, "deadline")
            raise self._deadline_error(item, where)
        return item.future.result()

    async def _collect(self, items: list[_Item[P, R]]) -> list[R]:
        results: list[R] = []
        try:
            for item in items:
                results.append(await self._wait(item))
        except Exception as exc:
            reason: RejectReason = "deadline" if isinstance(exc, DeadlineExceededError) else "cancelled"
            for item in items:
                self._abandon(item, reason)
            raise
        return results

    def _abandon(self, item: _Item[P, R], reason: RejectReason) -> None:
        """The caller stopped waiting: drop the request if queued, ignore its result if computing."""
        if item.future.done():
            return
        if item.state is _State.QUEUED:
            self._remove(item)
        item.future.cancel()
        self.observe("on_reject", reason)

    # ---------------------------------------------------------------- owner side

    async def _owner(self, index: int) -> None:
        while True:
            try:
                batch = await self._next_batch()
                if batch is None:
                    return
                await self._execute(batch)
            except Exception:  # never let one bad batch kill the instance
                logger.exception("batcher %r owner %d: unexpected error; continuing", self.name, index)
                await asyncio.sleep(0)

    async def _next_batch(self) -> list[_Item[P, R]] | None:
        """Wait until a batch is ready and take it; None when stopped and the queue is empty."""
        while True:
            now = time.monotonic()
            wakeup = self._wakeup
            batch, wake_at = self._select(now)
            if batch:
                if self._buckets:
                    self._notify()  # let idle owners look at what is left
                return batch
            if self._closed and not self._buckets:
                return None
            timeout = None if wake_at is None else max(0.0, wake_at - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await wakeup.wait()

    def _select(self, now: float) -> tuple[list[_Item[P, R]], float | None]:
        """Take the ready batch whose oldest request is oldest; else return when to look again."""
        best: tuple[int, int, int] | None = None  # (head order, bucket, size)
        wake_at: float | None = None
        for bucket, queue in list(self._buckets.items()):
            fit, limited = self._fit(queue, now)
            if not queue:
                continue
            head = queue[0]
            size = self._ready_size(fit, limited, now - head.enqueued)
            order = head.seq + (1 << 62 if head.bulk else 0)  # an interactive head goes first
            if size and (best is None or order < best[0]):
                best = (order, bucket, size)
            elif not size:
                due = head.enqueued + self.config.max_queue_delay_ms / 1000.0
                wake_at = due if wake_at is None else min(wake_at, due)
        if best is None:
            return [], wake_at
        queue = self._buckets[best[1]]
        batch = [queue.popleft() for _ in range(best[2])]
        if not queue:
            del self._buckets[best[1]]
        return batch, None

    def _fit(self, queue: deque[_Item[P, R]], now: float) -> tuple[int, bool]:
        """Fail expired requests of ``queue``; count how many from its head fit one batch, and whether a
        limit (size or token budget) stopped the count."""
        expired = [item for item in queue if item.expired(now)]
        for item in expired:
            self._reject_queued(item, "deadline", self._deadline_error(item, "queued"))
        budget = self.config.max_batch_tokens
        count = longest = 0
        for item in queue:
            if count == self.config.max_batch_size:
                return count, True
            longest_with = max(longest, item.length)
            if budget is not None and count > 0 and (count + 1) * longest_with > budget:
                return count, True
            count, longest = count + 1, longest_with
        return count, False

    def _ready_size(self, fit: int, limited: bool, waited_s: float) -> int:
        """How many to take from a bucket now (0 = keep waiting)."""
        preferred = self.config.preferred_batch_sizes
        if preferred:
            cap = fit if limited else self.config.max_batch_size
            goal = max((s for s in preferred if s <= cap), default=0)
            if goal and fit >= goal:
                return goal
        if limited or self._closed or waited_s >= self.config.max_queue_delay_ms / 1000.0:
            return fit
        return 0

    async def _execute(self, batch: list[_Item[P, R]]) -> None:
        now = time.monotonic()
        longest = max(item.length for item in batch)
        for item in batch:
            item.state = _State.RUNNING
        self._in_flight += len(batch)
        self.observe(
            "on_batch",
            len(batch),
            sum(item.length for item in batch),
            longest * len(batch),
            [now - item.enqueued for item in batch],
        )
        self.observe("on_dequeue", self.queue_depth)
        try:
            await self._compute(batch)
        finally:
            self._in_flight -= len(batch)
            for item in batch:  # only if compute was interrupted: never leave a caller hanging
                if not item.future.done():
                    self._settle(item, self._shutdown_error())

    async def _compute(self, items: list[_Item[P, R]]) -> None:
        """Run ``items``; if ``run_batch`` raises for the whole batch, bisect so only the culprit fails."""
        items = [item for item in items if not item.future.done()]  # callers that gave up are dropped
        if not items:
            return
        start = time.monotonic()
        try:
            results = await self._run_batch([item.payload for item in items])
            _check_results(results, len(items))
        except Exception as exc:
            self.observe("on_compute", time.monotonic() - start, len(items), False)
            if len(items) == 1:
                self._settle(items[0], exc)
                return
            logger.warning("batcher %r: batch of %d failed (%r); retrying in halves", self.name, len(items), exc)
            middle = len(items) // 2
            await self._compute(items[:middle])
            await self._compute(items[middle:])
            return
        self.observe("on_compute", time.monotonic() - start, len(items), True)
        for item, result in zip(items, results, strict=True):
            self._settle(item, result)

    # ---------------------------------------------------------------- helpers

    def _settle(self, item: _Item[P, R], result: R | BaseException) -> None:
        item.state = _State.DONE
        if item.future.done():
            return
        if isinstance(result, BaseException):
            item.future.set_exception(result)
        else:
            item.future.set_result(result)

    def _reject_queued(self, item: _Item[P, R], reason: RejectReason, error: MiaohuiError) -> None:
        self._remove(item)
        self._settle(item, error)
        self.observe("on_reject", reason)

    def _remove(self, item: _Item[P, R]) -> None:
        queue = self._buckets.get(item.bucket)
        if queue is not None and item in queue:
            queue.remove(item)
            if not queue:
                del self._buckets[item.bucket]
        item.state = _State.DONE

    def _bucket_of(self, length: int) -> int:
        return bisect_left(self.config.length_buckets, length)

    def _notify(self) -> None:
        """Wake every waiting owner; each captured the event before it looked at the queue."""
        wakeup, self._wakeup = self._wakeup, asyncio.Event()
        wakeup.set()

    def observe(self, hook: str, *args: object) -> None:
        """Call the observer's ``hook``; an exception there is logged and ignored (metrics never fail work)."""
        try:
            getattr(self._observer, hook)(*args)
        except Exception:
            logger.exception("batcher %r: observer %s failed; ignored", self.name, hook)

    def _shutdown_error(self) -> UnavailableError:
        return UnavailableError(
            f"batcher for {self.name!r} is stopping; the request was not computed",
            "retry the request later or on another replica",
        )

    def _deadline_error(self, item: _Item[P, R], where: str) -> DeadlineExceededError:
        waited_ms = 1000 * (time.monotonic() - item.enqueued)
        budget_ms = 0.0 if item.deadline is None else 1000 * (item.deadline - item.enqueued)
        return DeadlineExceededError(
            f"request deadline passed while {where} ({budget_ms:.1f} ms allowed, {waited_ms:.1f} ms since submit)",
            "send a longer timeout, or lower the load / add instances (max_queue_size="
            f"{self.config.max_queue_size}, instances={self.config.instances})",
        )


def _check_results(results: Sequence[object], expected: int) -> None:
    if not isinstance(results, Sequence) or len(results) != expected:
        got = len(results) if isinstance(results, Sequence) else type(results).__name__
        raise MiaohuiError(
            f"run_batch returned {got} results for a batch of {expected}",
            "return exactly one result (or exception) per input, in order",
        )
