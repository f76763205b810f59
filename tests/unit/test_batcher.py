"""DynamicBatcher on fake engines: no model, no torch — async functions that record the batches they get."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
from pydantic import ValidationError

from miaohui.errors import (
    ConfigError,
    DeadlineExceededError,
    InputError,
    MiaohuiError,
    QueueFullError,
    UnavailableError,
)
from miaohui.priority import PRIORITY
from miaohui.serving.batcher import BatcherConfig, BatcherObserver, DynamicBatcher

SHUTDOWN = (
    "batcher for 'model' is stopping; the request was not computed — retry the request later or on another replica"
)

QUEUED_LATE = (
    r"^request deadline passed while queued \(\d+\.\d ms allowed, \d+\.\d ms since submit\) — "
    r"send a longer timeout, or lower the load / add instances \(max_queue_size=256, instances=1\)$"
)


class FakeEngine:
    """Answers ``payload * 10``; records each batch, when it started and how many run at once.

    ``bad`` payloads get a per-item ValueError; a batch holding a ``poison`` payload raises as a whole;
    while ``gate`` is set and not released every call waits on it.
    """

    def __init__(self, delay: float = 0.002, bad: Sequence[int] = (), poison: Sequence[int] = ()) -> None:
        self.delay = delay
        self.bad = set(bad)
        self.poison = set(poison)
        self.gate: asyncio.Event | None = None
        self.batches: list[list[int]] = []
        self.started: list[float] = []
        self.active = 0
        self.max_active = 0

    async def __call__(self, payloads: list[int]) -> list[int | BaseException]:
        self.batches.append(list(payloads))
        self.started.append(time.monotonic())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.delay:
                await asyncio.sleep(self.delay)
        finally:
            self.active -= 1
        if self.poison & set(payloads):
            raise RuntimeError(f"poison in {payloads}")
        return [ValueError(f"bad {p}") if p in self.bad else p * 10 for p in payloads]

    def computed(self) -> set[int]:
        return {p for batch in self.batches for p in batch}


class Recorder(BatcherObserver):
    def __init__(self) -> None:
        self.depths: list[int] = []
        self.rejects: list[str] = []
        self.batches: list[tuple[int, int, int, list[float]]] = []
        self.computes: list[tuple[float, int, bool]] = []

    def on_enqueue(self, queue_depth: int) -> None:
        self.depths.append(queue_depth)

    def on_reject(self, reason: str) -> None:
        self.rejects.append(reason)

    def on_batch(self, size: int, tokens: int, padded_tokens: int, queue_wait_s: list[float]) -> None:
        self.batches.append((size, tokens, padded_tokens, queue_wait_s))

    def on_compute(self, seconds: float, size: int, ok: bool) -> None:
        self.computes.append((seconds, size, ok))


@asynccontextmanager
async def serve(engine: Any, **config: Any) -> AsyncIterator[tuple[DynamicBatcher[int, int], Recorder]]:
    recorder = Recorder()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(engine, BatcherConfig(**config), recorder)
    batcher.start()
    try:
        yield batcher, recorder
    finally:
        if engine.gate is not None:
            engine.gate.set()
        await batcher.stop(drain=False)


async def until(cond: Callable[[], object], timeout: float = 1.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.001)


async def hold(batcher: DynamicBatcher[int, int], engine: FakeEngine) -> asyncio.Task[int]:
    """Occupy the (single) instance with payload -1 so the next requests pile up in the queue."""
    engine.gate = asyncio.Event()
    blocker = asyncio.create_task(batcher.submit(-1, 1))
    await until(lambda: engine.batches)
    return blocker


async def queue(batcher: DynamicBatcher[int, int], items: Sequence[tuple[int, int]]) -> list[asyncio.Task[int]]:
    """Submit (payload, length) pairs as tasks and wait until all are queued."""
    before = batcher.queue_depth
    tasks = [asyncio.create_task(batcher.submit(p, n)) for p, n in items]
    await until(lambda: batcher.queue_depth == before + len(items))
    return tasks


# ------------------------------------------------------------------ batching


async def test_results_go_to_the_right_caller() -> None:
    engine = FakeEngine()
    async with serve(engine, max_batch_size=8, max_queue_delay_ms=1) as (batcher, _):
        results = await asyncio.gather(*(batcher.submit(i, 1 + i % 7) for i in range(50)))
    assert results == [i * 10 for i in range(50)]
    assert engine.computed() == set(range(50))
    assert all(len(b) <= 8 for b in engine.batches)


async def test_batches_fill_up_to_max_batch_size_in_fifo_order() -> None:
    engine = FakeEngine()
    async with serve(engine, max_batch_size=4, max_queue_delay_ms=0) as (batcher, recorder):
        blocker = await hold(batcher, engine)
        tasks = await queue(batcher, [(i, 5) for i in range(10)])
        engine.gate.set()  # type: ignore[union-attr]
        assert await asyncio.gather(*tasks) == [i * 10 for i in range(10)]
        await blocker
    assert engine.batches[1:] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [(size, tokens, padded) for size, tokens, padded, _ in recorder.batches[1:]] == [
        (4, 20, 20),
        (4, 20, 20),
        (2, 10, 10),
    ]
    assert recorder.depths[:3] == [1, 1, 2]
    assert all(len(waits) == size and min(waits) >= 0 for size, _, _, waits in recorder.batches)


async def test_lone_request_is_answered_after_the_queue_delay() -> None:
    engine = FakeEngine(delay=0)
    async with serve(engine, max_batch_size=32, max_queue_delay_ms=30) as (batcher, recorder):
        start = time.monotonic()
        assert await batcher.submit(7, 3) == 70
        elapsed = time.monotonic() - start
    assert 0.028 <= elapsed < 0.2
    assert recorder.batches[0][3][0] >= 0.028


async def test_batches_hold_one_length_bucket_and_the_oldest_bucket_goes_first() -> None:
    engine = FakeEngine()
    lengths = {0: 100, 1: 4, 2: 20, 3: 4, 4: 100, 5: 7, 6: 30, 7: 8, 8: 9, 9: 2}
    async with serve(engine, max_batch_size=8, max_queue_delay_ms=0, length_buckets=[8, 32]) as (
        batcher,
        rec,
    ):
        blocker = await hold(batcher, engine)
        tasks = await queue(batcher, list(lengths.items()))
        engine.gate.set()  # type: ignore[union-attr]
        assert await asyncio.gather(*tasks) == [i * 10 for i in lengths]
        await blocker
    # buckets: ≤8, 9..32, >32; the bucket of the oldest request (payload 0, length 100) goes first
    assert engine.batches[1:] == [[0, 4], [1, 3, 5, 7, 9], [2, 6, 8]]
    assert [(size, tokens, padded) for size, tokens, padded, _ in rec.batches[1:]] == [
        (2, 200, 200),
        (5, 25, 40),
        (3, 59, 90),
    ]


async def test_preferred_batch_size_is_sent_without_waiting_for_the_delay() -> None:
    engine = FakeEngine(delay=0.005)
    async with serve(engine, max_batch_size=8, max_queue_delay_ms=100, preferred_batch_sizes=[4, 2]) as (
        batcher,
        _,
    ):
        start = time.monotonic()
        results = await asyncio.gather(*(batcher.submit(i, 3) for i in range(9)))
    assert results == [i * 10 for i in range(9)]
    assert [len(b) for b in engine.batches] == [4, 4, 1]
    assert engine.started[0] - start < 0.05 and engine.started[1] - start < 0.05  # no delay for preferred
    assert engine.started[2] - start >= 0.099  # the leftover waits max_queue_delay_ms


async def test_full_batch_takes_the_largest_preferred_size() -> None:
    engine = FakeEngine()
    async with serve(engine, max_batch_size=8, max_queue_delay_ms=0, preferred_batch_sizes=[2, 4]) as (b, _):
        blocker = await hold(b, engine)
        tasks = await queue(b, [(i, 1) for i in range(11)])
        engine.gate.set()  # type: ignore[union-attr]
        await asyncio.gather(blocker, *tasks)
    # 11 queued: a full batch would be 8, the largest preferred size that fits is 4;
    # the last 3 go when the delay (0 here) runs out
    assert [len(b) for b in engine.batches[1:]] == [4, 4, 3]


async def test_token_budget_closes_the_batch() -> None:
    engine = FakeEngine()
    lengths = [10, 10, 10, 10, 10, 10, 30, 100, 10]
    async with serve(engine, max_batch_size=32, max_queue_delay_ms=0, max_batch_tokens=40) as (batcher, rec):
        blocker = await hold(batcher, engine)
        tasks = await queue(batcher, list(enumerate(lengths)))
        engine.gate.set()  # type: ignore[union-attr]
        await asyncio.gather(blocker, *tasks)
    # padded tokens = size x longest: 4x10 fits 40; 2x10 then +30 would be 3x30=90; 100 alone is allowed
    assert engine.batches[1:] == [[0, 1, 2, 3], [4, 5], [6], [7], [8]]
    assert [padded for _, _, padded, _ in rec.batches[1:]] == [40, 20, 30, 100, 10]


async def test_instances_compute_batches_concurrently() -> None:
    engine = FakeEngine(delay=0.2)
    async with serve(engine, max_batch_size=2, max_queue_delay_ms=0, instances=3) as (batcher, _):
        start = time.monotonic()
        results = await asyncio.gather(*(batcher.submit(i, 1) for i in range(6)))
        elapsed = time.monotonic() - start
    assert results == [i * 10 for i in range(6)]
    assert engine.max_active == 3
    assert elapsed < 0.45  # three batches side by side, not one after another (0.6 s)


async def test_a_stream_of_short_requests_does_not_starve_a_long_one() -> None:
    engine = FakeEngine(delay=0.002)
    config: dict[str, Any] = {
        "max_batch_size": 4,
        "max_queue_delay_ms": 5,
        "length_buckets": [8],
        "max_queue_size": 10_000,
    }
    async with serve(engine, **config) as (batcher, _):
        shorts: list[asyncio.Task[int]] = []

        async def stream() -> None:
            """Keep 24 short requests outstanding, so a full short bucket is always ready."""
            end, payload = time.monotonic() + 1.0, 1000
            while time.monotonic() < end:
                while sum(not t.done() for t in shorts) < 24:
                    shorts.append(asyncio.create_task(batcher.submit(payload, 4)))
                    payload += 1
                await asyncio.sleep(0.001)

        producer = asyncio.create_task(stream())
        await asyncio.sleep(0.05)
        start = time.monotonic()
        assert await batcher.submit(1, 100) == 10
        latency = time.monotonic() - start
        assert not producer.done()
        await producer
        await asyncio.gather(*shorts)
    # served within a few batches after its delay, while the stream went on for 1 s; a policy that
    # prefers the busiest (or full) bucket would hold it until the stream ends
    assert latency < 0.3
    long_batch = engine.batches.index([1])
    assert len(engine.batches) - long_batch > 10  # and shorts kept being served after it


# ------------------------------------------------------------------ rejections


async def test_full_queue_rejects_at_once() -> None:
    engine = FakeEngine()
    async with serve(engine, max_queue_size=2, max_queue_delay_ms=0) as (batcher, recorder):
        blocker = await hold(batcher, engine)
        tasks = await queue(batcher, [(1, 1), (2, 1)])
        with pytest.raises(QueueFullError) as info:
            await batcher.submit(3, 1)
        assert str(info.value) == (
            "queue of 'model' is full (2 of max_queue_size=2 requests waiting) — "
            "retry later with backoff, or raise max_queue_size / instances in the model's config"
        )
        assert recorder.rejects == ["queue_full"]
        engine.gate.set()  # type: ignore[union-attr]
        assert await asyncio.gather(blocker, *tasks) == [-10, 10, 20]
    assert 3 not in engine.computed()


async def test_deadline_passing_in_the_queue_fails_before_compute() -> None:
    engine = FakeEngine()
    async with serve(engine, max_queue_delay_ms=0) as (batcher, recorder):
        blocker = await hold(batcher, engine)
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=QUEUED_LATE):
            await batcher.submit(7, 1, deadline=start + 0.02)
        assert 0.019 <= time.monotonic() - start < 0.3  # the blocker holds the instance indefinitely
        assert batcher.queue_depth == 0
        engine.gate.set()  # type: ignore[union-attr]
        await blocker
        assert await batcher.submit(8, 1) == 80
    assert 7 not in engine.computed()
    assert recorder.rejects == ["deadline"]


async def test_owner_fails_expired_requests_it_finds_in_the_queue() -> None:
    engine = FakeEngine(delay=0)
    async with serve(engine, max_queue_delay_ms=0) as (batcher, recorder):
        blocker = await hold(batcher, engine)
        late = asyncio.create_task(batcher.submit(7, 1, deadline=time.monotonic() + 0.01))
        await until(lambda: batcher.queue_depth == 1)
        time.sleep(0.02)  # the loop is busy past the deadline; the owner looks before the caller's timer
        engine.gate.set()  # type: ignore[union-attr]
        with pytest.raises(DeadlineExceededError, match="passed while queued"):
            await late
        await blocker
    assert 7 not in engine.computed()
    assert recorder.rejects == ["deadline"]


async def test_deadline_passing_during_compute_answers_the_caller_in_time() -> None:
    engine = FakeEngine(delay=0.5)
    async with serve(engine, max_queue_delay_ms=0) as (batcher, recorder):
        start = time.monotonic()
        with pytest.raises(
            DeadlineExceededError,
            match=r"^request deadline passed while computing \(\d+\.\d ms allowed",
        ):
            await batcher.submit(7, 1, deadline=start + 0.02)
        assert time.monotonic() - start < 0.4  # answered at the deadline, not when compute ends (0.5 s)
        assert await batcher.submit(8, 1) == 80  # the instance is fine afterwards
    assert engine.batches == [[7], [8]]
    assert recorder.rejects == ["deadline"]


async def test_default_timeout_and_past_deadlines() -> None:
    engine = FakeEngine(delay=0.1)
    async with serve(engine, max_queue_delay_ms=0, default_timeout_ms=20) as (batcher, recorder):
        with pytest.raises(DeadlineExceededError, match="passed while computing"):
            await batcher.submit(1, 1)
        with pytest.raises(DeadlineExceededError, match="ms before it was submitted — give a deadline in the"):
            await batcher.submit(2, 1, deadline=time.monotonic() - 0.001)
    assert engine.batches == [[1]]
    assert recorder.rejects == ["deadline", "deadline"]


async def test_cancelled_request_is_dropped_before_compute() -> None:
    engine = FakeEngine()
    async with serve(engine, max_queue_delay_ms=0) as (batcher, recorder):
        blocker = await hold(batcher, engine)
        (gone,) = await queue(batcher, [(7, 1)])
        kept = asyncio.create_task(batcher.submit(8, 1))
        await until(lambda: batcher.queue_depth == 2)
        gone.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert batcher.queue_depth == 1
        engine.gate.set()  # type: ignore[union-attr]
        assert await asyncio.gather(blocker, kept) == [-10, 80]
    assert engine.batches == [[-1], [8]]
    assert recorder.rejects == ["cancelled"]


async def test_submit_many_queues_every_row_before_it_returns() -> None:
    engine = FakeEngine()
    async with serve(engine, max_batch_size=8, max_queue_delay_ms=0) as (batcher, _):
        blocker = await hold(batcher, engine)
        pending = batcher.submit_many([(1, 3), (2, 5), (3, 4)])
        assert batcher.queue_depth == 3  # no loop turn needed: the caller can work while they are computed
        engine.gate.set()  # type: ignore[union-attr]
        assert await pending == [10, 20, 30]
        await blocker
    assert engine.batches == [[-1], [1, 2, 3]]


async def test_submit_many_cancelled_drops_its_queued_rows() -> None:
    engine = FakeEngine()
    async with serve(engine, max_queue_delay_ms=0) as (batcher, recorder):
        blocker = await hold(batcher, engine)
        pending = batcher.submit_many([(1, 1), (2, 1)])
        pending.cancel()  # before it ever ran, as when the client goes away at once
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert batcher.queue_depth == 0
        engine.gate.set()  # type: ignore[union-attr]
        await blocker
    assert engine.computed() == {-1}
    assert recorder.rejects == ["cancelled", "cancelled"]


async def test_submit_many_fails_with_a_row_error_and_drops_the_rest() -> None:
    engine = FakeEngine(bad=[1])
    async with serve(engine, max_batch_size=1, max_queue_delay_ms=0) as (batcher, _):
        blocker = await hold(batcher, engine)
        pending = batcher.submit_many([(1, 1), (2, 1), (3, 1)])
        engine.gate.set()  # type: ignore[union-attr]
        with pytest.raises(ValueError, match="bad 1"):
            await pending
        await blocker
        assert batcher.queue_depth == 0
    assert 3 not in engine.computed()


async def test_submit_many_rejects_at_once_and_leaves_nothing_queued() -> None:
    engine = FakeEngine()
    async with serve(engine, max_queue_size=2, max_queue_delay_ms=0) as (batcher, _):
        blocker = await hold(batcher, engine)
        with pytest.raises(QueueFullError):
            batcher.submit_many([(1, 1), (2, 1), (3, 1)])
        assert batcher.queue_depth == 0
        engine.gate.set()  # type: ignore[union-attr]
        await blocker
    assert engine.computed() == {-1}


# ------------------------------------------------------------------ failures


async def test_a_bad_item_result_fails_only_its_caller() -> None:
    engine = FakeEngine(bad=[3])
    async with serve(engine, max_queue_delay_ms=0) as (batcher, _):
        blocker = await hold(batcher, engine)
        tasks = await queue(batcher, [(i, 1) for i in range(6)])
        engine.gate.set()  # type: ignore[union-attr]
        results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
    assert engine.batches[1:] == [[0, 1, 2, 3, 4, 5]]
    assert str(results[4]) == "bad 3" and isinstance(results[4], ValueError)
    assert results[:4] + results[5:] == [-10, 0, 10, 20, 40, 50]


async def test_a_raising_batch_is_retried_in_halves_so_only_the_culprit_fails() -> None:
    engine = FakeEngine(poison=[5])
    async with serve(engine, max_queue_delay_ms=0) as (batcher, recorder):
        blocker = await hold(batcher, engine)
        tasks = await queue(batcher, [(i, 1) for i in range(8)])
        engine.gate.set()  # type: ignore[union-attr]
        results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
        assert await batcher.submit(9, 1) == 90  # the owner survived
    assert isinstance(results[6], RuntimeError) and str(results[6]) == "poison in [5]"
    assert results[:6] + results[7:] == [-10, 0, 10, 20, 30, 40, 60, 70]
    assert engine.batches[1:5] == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5]]
    assert [(size, ok) for _, size, ok in recorder.computes[1:]] == [
        (8, False), (4, True), (4, False), (2, False), (1, True), (1, False), (2, True), (1, True),
    ]  # fmt: skip


async def test_a_raising_batch_of_one_gives_the_caller_the_exception() -> None:
    engine = FakeEngine(poison=[1])
    async with serve(engine, max_queue_delay_ms=0) as (batcher, _):
        with pytest.raises(RuntimeError, match=r"^poison in \[1\]$"):
            await batcher.submit(1, 1)
        assert await batcher.submit(2, 1) == 20


async def test_wrong_number_of_results_is_an_error_not_a_hang() -> None:
    async def short_engine(payloads: list[int]) -> list[int | BaseException]:
        return [p for p in payloads if p != 2]

    engine = FakeEngine()
    async with serve(engine, max_queue_delay_ms=0) as (batcher, _):
        batcher._run_batch = short_engine
        with pytest.raises(MiaohuiError) as info:
            await batcher.submit(2, 1)
        assert await batcher.submit(3, 1) == 3
    assert str(info.value) == (
        "run_batch returned 0 results for a batch of 1 — return exactly one result (or exception) per input, in order"
    )


async def test_a_failing_observer_never_stops_the_batcher() -> None:
    class Broken(BatcherObserver):
        def on_enqueue(self, queue_depth: int) -> None:
            raise RuntimeError("observer down")

        def on_batch(self, size: int, tokens: int, padded_tokens: int, queue_wait_s: list[float]) -> None:
            raise RuntimeError("observer down")

        def on_compute(self, seconds: float, size: int, ok: bool) -> None:
            raise RuntimeError("observer down")

    batcher: DynamicBatcher[int, int] = DynamicBatcher(FakeEngine(), BatcherConfig(max_queue_delay_ms=0), Broken())
    async with batcher:
        assert await asyncio.gather(*(batcher.submit(i, 1) for i in range(5))) == [0, 10, 20, 30, 40]


# ------------------------------------------------------------------ lifecycle


async def test_stop_with_drain_computes_everything_queued_without_waiting() -> None:
    engine = FakeEngine()
    async with serve(engine, max_batch_size=8, max_queue_delay_ms=1000) as (batcher, recorder):
        tasks = await queue(batcher, [(i, 1) for i in range(3)])
        start = time.monotonic()
        await batcher.stop(drain=True)
        assert time.monotonic() - start < 0.5
        assert all(t.done() for t in tasks)
        assert [t.result() for t in tasks] == [0, 10, 20]
        with pytest.raises(UnavailableError) as info:  # 503: this replica is going away, not overloaded
            await batcher.submit(4, 1)
        assert str(info.value) == SHUTDOWN
        assert recorder.rejects == ["shutdown"]


async def test_stop_without_drain_rejects_queued_and_finishes_in_flight() -> None:
    engine = FakeEngine()
    async with serve(engine, max_queue_delay_ms=0) as (batcher, recorder):
        blocker = await hold(batcher, engine)
        tasks = await queue(batcher, [(i, 1) for i in range(3)])
        stopping = asyncio.create_task(batcher.stop(drain=False))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [str(r) for r in results] == [SHUTDOWN] * 3
        assert all(isinstance(r, UnavailableError) for r in results)
        assert not stopping.done() and batcher.in_flight == 1
        engine.gate.set()  # type: ignore[union-attr]
        await stopping
        assert blocker.done() and blocker.result() == -10
        assert batcher.queue_depth == 0 and batcher.in_flight == 0
    assert engine.batches == [[-1]]
    assert recorder.rejects == ["shutdown"] * 3


async def test_submit_checks_start_and_length() -> None:
    batcher: DynamicBatcher[int, int] = DynamicBatcher(FakeEngine())
    with pytest.raises(MiaohuiError) as info:
        await batcher.submit(1, 1)
    assert str(info.value) == (
        "batcher for 'model' is not started — call batcher.start() inside the event loop (or use `async with batcher:`)"
    )
    async with batcher:
        with pytest.raises(InputError) as bad:
            await batcher.submit(1, 0)
    assert str(bad.value) == "request length 0 is below 1 — pass the request's token count (≥ 1)"


# ------------------------------------------------------------------ config


def test_config_defaults_and_normalisation() -> None:
    config = BatcherConfig(preferred_batch_sizes=[8, 2, 8, 4])
    assert config.preferred_batch_sizes == [2, 4, 8]
    assert (config.max_batch_size, config.max_queue_delay_ms, config.max_queue_size) == (32, 5.0, 256)
    assert (config.instances, config.max_batch_tokens, config.default_timeout_ms) == (1, None, None)


def test_config_rejects_preferred_sizes_above_max() -> None:
    with pytest.raises(ConfigError) as info:
        BatcherConfig(max_batch_size=8, preferred_batch_sizes=[4, 32, 16])
    assert str(info.value) == (
        "preferred_batch_sizes [4, 16, 32] has sizes above max_batch_size=8: [16, 32] — "
        "remove [16, 32] from preferred_batch_sizes or raise max_batch_size to at least 32"
    )


def test_config_rejects_unordered_length_buckets() -> None:
    with pytest.raises(ConfigError) as info:
        BatcherConfig(length_buckets=[16, 64, 64, 128])
    assert str(info.value) == (
        "length_buckets [16, 64, 64, 128] is not strictly increasing — list the sequence-length boundaries "
        "from small to large without repeats, e.g. [16, 32, 64, 128, 256, 512]"
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_batch_size", 0, "Input should be greater than or equal to 1"),
        ("max_queue_delay_ms", -1, "Input should be greater than or equal to 0"),
        ("max_queue_size", 0, "Input should be greater than or equal to 1"),
        ("instances", 0, "Input should be greater than or equal to 1"),
        ("max_batch_tokens", 0, "Input should be greater than or equal to 1"),
        ("default_timeout_ms", 0, "Input should be greater than 0"),
        ("preferred_batch_sizes", [0], "Input should be greater than or equal to 1"),
        ("length_buckets", [0, 8], "Input should be greater than or equal to 1"),
        ("max_batch", 8, "Extra inputs are not permitted"),
    ],
)
def test_config_field_constraints(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        BatcherConfig(**{field: value})
    (error,) = info.value.errors()
    assert error["msg"] == message


# ------------------------------------------------------------------ priority


async def test_interactive_requests_are_queued_ahead_of_bulk_ones() -> None:
    """The API key's priority class (a context variable the key gate sets): interactive before bulk, FIFO within."""
    engine = FakeEngine()
    async with serve(engine, max_batch_size=2, max_queue_delay_ms=0) as (batcher, _):
        blocker = await hold(batcher, engine)
        token = PRIORITY.set("bulk")
        bulk = await queue(batcher, [(1, 4), (2, 4), (3, 4)])
        PRIORITY.reset(token)
        interactive = await queue(batcher, [(4, 4), (5, 4)])
        bulk_other = PRIORITY.set("bulk")
        late = await queue(batcher, [(6, 4)])  # bulk again: behind the earlier bulk ones
        PRIORITY.reset(bulk_other)
        engine.gate.set()  # type: ignore[union-attr]
        await asyncio.gather(blocker, *bulk, *interactive, *late)
    assert engine.batches[1:] == [[4, 5], [1, 2], [3, 6]]
