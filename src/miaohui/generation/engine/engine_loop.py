"""The generation loop: ``LLMEngine`` (synchronous, one step = schedule → run → update) and
``AsyncLLMEngine`` (one asyncio task owns it; requests stream their tokens).

The async engine's own thread runs steps back to back while there is work and sleeps otherwise; the event loop
stays free to accept requests, stream tokens and handle disconnects meanwhile, and gets each step's updates in one
call. The scheduler is shared under a lock: requests join it between steps, and an abort frees the slot at once
(the step in flight may still compute the sequence's token, which is then dropped).

For the HTTP layer::

    stream = engine.add(prompt_ids, params)     # raises InputError (400) / QueueFullError (429) now
    try:
        async for event in stream:              # TokenEvent: text delta, token id, finish reason
            ...                                 # send an SSE chunk
    finally:
        await stream.aclose()                   # client gone or done: aborts if still running

``generate()`` wraps the same in an async generator. Metrics go to a :class:`GenerationObserver`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from miaohui.errors import ConfigError, InputError, MiaohuiError
from miaohui.generation.engine.observer import GenerationObserver, StepReport, safe_call
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.runner import Collect, ModelRunner
from miaohui.generation.engine.scheduler import (
    Advanced,
    FinishReason,
    RunnerOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SequenceUpdate,
)
from miaohui.generation.engine.slot_runner import SlotModelRunner
from miaohui.gil import GENERATION_SWITCH_US, apply_switch_interval

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from miaohui.generation.executors.base import AnyCausalLMEngine

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "GenerationObserver", "LLMEngine", "RequestStream", "TokenEvent"]


@dataclass(frozen=True)
class TokenEvent:
    """One streamed step of one request. The last event has ``finish_reason`` set."""

    request_id: int
    token_id: int | None
    """The new token (None on an abort/error finish)."""
    text: str
    """Text delta to append (may be empty: an incomplete character, or text held back by a stop string)."""
    index: int
    """Number of generated tokens so far."""
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int

    def __init__(
        self,
        request_id: int,
        token_id: int | None,
        text: str,
        index: int,
        finish_reason: FinishReason | None,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        # written out: one event per streamed token, and a frozen dataclass's generated __init__ (object.__setattr__
        # per field) takes twice as long. Still frozen: no assignment after __init__.
        d = self.__dict__
        d["request_id"] = request_id
        d["token_id"] = token_id
        d["text"] = text
        d["index"] = index
        d["finish_reason"] = finish_reason
        d["prompt_tokens"] = prompt_tokens
        d["completion_tokens"] = completion_tokens


def check_token_ids(prompt_ids: Sequence[int], vocab: int) -> None:
    """InputError unless every prompt token id is an int in [0, vocab)."""
    bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad:
        raise InputError(
            f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}",
            "encode the prompt with this model's tokenizer",
        )


class _Aborter(Protocol):
    def abort(self, request_id: int) -> bool: ...


class _Engine(Protocol):
    def add(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> RequestStream: ...


async def stream_events(
    engine: _Engine, prompt_ids: Sequence[int], params: SamplingParams | None = None
) -> AsyncIterator[TokenEvent]:
    """Add a request to ``engine`` (local or remote) and yield its events; closing the generator aborts it."""
    stream = engine.add(prompt_ids, params)
    try:
        async for event in stream:
            yield event
    finally:
        stream.abort()


class EngineStoppedError(MiaohuiError):
    """The engine stopped or failed while the request was running."""


class LLMEngine:
    """Synchronous engine: a scheduler and a model runner. ``step()`` is schedule → execute → update."""

    def __init__(
        self, engine: AnyCausalLMEngine, tokenizer: Tokenizer | None, config: SchedulerConfig | None = None
    ) -> None:
        from miaohui.generation.engine.detok import detokenizer_factory
        from miaohui.generation.executors.base import SlotCausalLMEngine

        self.engine = engine
        self.tokenizer = tokenizer
        config = config or SchedulerConfig()
        # a static cache holds num_slots sequences
        if isinstance(engine, SlotCausalLMEngine) and config.max_running_seqs > engine.num_slots:
            config = config.model_copy(update={"max_running_seqs": engine.num_slots})
        if config.max_model_len > engine.max_positions:
            config = config.model_copy(update={"max_model_len": engine.max_positions})
        cap = engine.max_prefill_prompts if isinstance(engine, SlotCausalLMEngine) else None
        if cap is not None and config.max_prefill_seqs is None:  # more prompts would take the engine's slow path
            config = config.model_copy(update={"max_prefill_seqs": max(cap, config.prefill_min_prompts)})
        self.config = config
        factory = detokenizer_factory(tokenizer) if tokenizer is not None else None
        self.scheduler = Scheduler(self.config, engine.eos_token_ids, factory)
        self.runner: ModelRunner | SlotModelRunner = (
            SlotModelRunner(engine) if isinstance(engine, SlotCausalLMEngine) else ModelRunner(engine)
        )

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. InputError (bad prompt, checked here so that it fails alone,
        never its batch) / QueueFullError as :meth:`Scheduler.add`."""
        check_token_ids(prompt_ids, self.engine.dims.vocab)
        return self.scheduler.add(prompt_ids, params or SamplingParams()).seq_id

    def abort(self, request_id: int) -> bool:
        return self.scheduler.abort(request_id) is not None

    def step(self) -> list[SequenceUpdate]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        return self.scheduler.update(self.runner.execute(out))

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[tuple[list[int], str, FinishReason | None]]:
        """Offline: run prompts to completion with continuous batching; (token ids, text, reason) each."""
        ids = [self.add_request(p, params) for p in prompts]
        results: dict[int, tuple[list[int], list[str], list[FinishReason | None]]] = {i: ([], [], [None]) for i in ids}
        while self.scheduler.has_work():
            for up in self.step():
                toks, texts, reason = results[up.seq_id]
                if up.token_id is not None:
                    toks.append(up.token_id)
                texts.append(up.text)
                reason[0] = up.finish_reason
        return [(results[i][0], "".join(results[i][1]), results[i][2][0]) for i in ids]


class RequestStream:
    """Async iterator of one request's :class:`TokenEvent` s; ``aclose()`` (or leaving ``async with``)
    aborts the request if it is still running. Cancelling the task that awaits it aborts it too."""

    def __init__(
        self,
        engine: _Aborter,
        request_id: int,
        prompt_tokens: int,
        sink: Callable[[TokenEvent | BaseException], None] | None = None,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self._sink = sink
        self._admission: asyncio.Future[BaseException | None] | None = None
        """Set by a remote engine: resolves to None once admitted, else to the rejection."""
        self.finished = False
        self._held: BaseException | None = None
        """An error :meth:`ready` took off the queue: raised by the next read, after the events before it."""

    def _push(self, item: TokenEvent | BaseException) -> None:
        if self._sink is not None:  # forwarded as it comes (the engine process's streams to its workers)
            self._sink(item)
        else:
            self._queue.put_nowait(item)

    async def admitted(self) -> None:
        """Wait until the engine accepted the request (at once for a local engine; a remote one answers its
        InputError / QueueFullError here, before the caller commits to a response)."""
        if self._admission is not None:
            error = await self._admission
            if error is not None:
                self.finished = True
                raise error

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        item: TokenEvent | BaseException
        if self._held is not None:
            item, self._held = self._held, None
        else:
            if self.finished and self._queue.empty():
                raise StopAsyncIteration
            try:
                item = await self._queue.get()
            except asyncio.CancelledError:
                self.abort()
                raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        return item

    def ready(self) -> list[TokenEvent]:
        """The events already queued behind the one just read (the reader fell behind the engine), up to the
        final one, without waiting; an error among them is held back and raised by the next read."""
        out: list[TokenEvent] = []
        queue = self._queue
        while self._held is None and not self.finished and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, BaseException):
                self._held = item
                break
            out.append(item)
            if item.finish_reason is not None:
                self.finished = True
        return out

    def abort(self) -> None:
        """Stop generating now (idempotent); the slot is free for the next step."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


@dataclass
class _Track:
    stream: RequestStream
    arrival: float
    last: float | None = None
    tokens: int = 0


@dataclass(frozen=True)
class _InFlight:
    """A launched step: what was scheduled, when it was launched, and the call that collects its tokens."""

    out: SchedulerOutput
    start: float
    collect: Collect


class AsyncLLMEngine:
    """An :class:`LLMEngine` driven by its own thread; requests stream their tokens on the event loop.

    The engine thread runs the whole step loop — schedule, launch and collect (the model; the GPU), advance (append
    tokens, end-of-sequence and length checks), emit (detokenization, stop strings) — and launches the next step
    right away. With ``async_scheduling`` (opt-in; the GPU engine) it launches step N+1 *before* it collects step N (the
    engine feeds step N's greedy picks to N+1 on the device), so the device always has the next step queued and
    step N's advance and emit run while N+1 computes; it falls back to collect-then-schedule while any running
    sequence samples (its token is drawn on the host). Each step's updates go to the event loop in one
    ``call_soon_threadsafe``, where they are pushed to the request streams. So the model is never idle while the
    event loop streams the previous step's tokens (before, the loop ran schedule/update between steps, and on the
    H200 the GPU waited for it: ITL ~5 ms for ~2.5 ms steps). The scheduler is shared under a lock: requests join
    (``add``) and leave (``abort``) between steps; an abort frees the slot at once (the step in flight may still
    compute the sequence's token, which is then dropped).

    Use as ``async with AsyncLLMEngine(llm) as engine:`` or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self, llm: LLMEngine, observer: GenerationObserver | None = None, *, async_scheduling: bool | None = None
    ) -> None:
        self.llm = llm
        wanted = async_scheduling if async_scheduling is not None else llm.config.async_scheduling
        if wanted and not llm.runner.chains:
            raise ConfigError(
                f"async scheduling needs an engine that feeds its own greedy picks; {llm.engine.name} does not",
                "set scheduler: async_scheduling: false (or leave it unset) for this engine",
            )
        self.async_scheduling = wanted
        """Launch step N+1 before collecting step N (``SchedulerConfig.async_scheduling``, off by default)."""
        if wanted and isinstance(llm.runner, SlotModelRunner):
            llm.runner.enable_chaining()
        self.observer = observer or GenerationObserver()
        self._tracks: dict[int, _Track] = {}
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    @property
    def num_running(self) -> int:
        return self.llm.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.llm.scheduler.num_waiting

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def start(self, *, warmup: bool = True) -> None:
        """Start the engine thread (and, with ``warmup``, run one short request through the engine first)."""
        if self.is_running:
            return
        self._stopping = False
        apply_switch_interval(GENERATION_SWITCH_US)  # the step thread gets the GIL back from the loop sooner
        if warmup:
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            prompt = [self.llm.engine.eos_token_ids[0] if self.llm.engine.eos_token_ids else 0] * 4
            await asyncio.to_thread(self._warmup, prompt, params)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="miaohui-llm-engine", daemon=True)
        self._thread.start()

    def _warmup(self, prompt: list[int], params: SamplingParams) -> None:
        config = self.llm.config  # its two prompts must fit the queue whatever max_waiting the model serves with
        warm = LLMEngine(self.llm.engine, None, config.model_copy(update={"max_waiting": max(2, config.max_waiting)}))
        warm.generate([prompt, prompt[:2]], params)

    async def stop(self) -> None:
        """Stop the engine thread (after its step in flight); unfinished requests end with an EngineStoppedError."""
        with self._work:
            self._stopping = True
            self._work.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._fail_all(EngineStoppedError("the generation engine stopped", "retry on a running server"))

    async def __aenter__(self) -> AsyncLLMEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def add(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        sink: Callable[[TokenEvent | BaseException], None] | None = None,
    ) -> RequestStream:
        """Queue a request now and return its stream. Raises InputError / QueueFullError at once.
        ``sink``: receives the events (and a final exception) instead of the stream's queue."""
        if not self.is_running:
            raise EngineStoppedError("the generation engine is not running", "await engine.start() first")
        with self._work:
            rid = self.llm.add_request(prompt_ids, params)
            stream = RequestStream(self, rid, len(prompt_ids), sink)
            self._tracks[rid] = _Track(stream, time.monotonic())
            self._work.notify()
        self._counts()
        return stream

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> AsyncIterator[TokenEvent]:
        """Stream one request's tokens; closing the generator (``aclose``) aborts the request."""
        return stream_events(self, prompt_ids, params)

    def abort(self, request_id: int) -> bool:
        """Abort a request now (its slot is free for the next step); its stream ends with a final event
        whose ``finish_reason`` is ``abort``. False when the request is unknown or already finished."""
        track = self._tracks.pop(request_id, None)
        with self._lock:
            update = self.llm.scheduler.abort(request_id)
        if update is not None and track is not None:
            e2e = time.monotonic() - track.arrival
            safe_call(self.observer.on_finish, e2e, track.stream.prompt_tokens, track.tokens, "abort")
            p = track.stream.prompt_tokens
            track.stream._push(TokenEvent(request_id, None, "", track.tokens, "abort", p, track.tokens))
        self._counts()
        return update is not None

    # ---- internals (event loop thread) ---------------------------------------------------------------

    def _counts(self) -> None:
        safe_call(self.observer.on_queue, self.num_running, self.num_waiting)

    def _run(self) -> None:
        """The engine thread. If the loop itself breaks (a scheduler bug, not a failing model step, which
        :meth:`_steps` survives), every request ends with an error and the engine stops, instead of hanging."""
        loop = self._loop
        assert loop is not None
        try:
            self._steps(loop)
        except Exception as exc:
            logger.exception("the generation loop stopped")
            self._stopping = True
            error = EngineStoppedError(f"the generation loop stopped: {exc!r}", "restart the server; see its log")
            self._deliver_soon(loop, self._fail_all, error)

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """Schedule → launch → collect → advance → emit, back to back while there is work. With
        ``async_scheduling`` the next step is scheduled and launched before the one in flight is collected (while
        every running sequence is greedy), so its advance and emit run while the device computes the next."""
        last_end: float | None = None  # when the previous collect returned (None: idle since)
        inflight: _InFlight | None = None  # launched, not yet collected
        while True:
            out: SchedulerOutput | None = None
            chain = False  # leave this turn's step in flight (collect it next turn)
            with self._work:
                if self._stopping:
                    return
                sched = self.llm.scheduler
                if inflight is None:
                    while not self._stopping and not sched.has_work():
                        last_end = None
                        self._work.wait()
                    if self._stopping:
                        return
                    out = sched.schedule()
                    chain = self.async_scheduling and sched.all_greedy()
                elif self.async_scheduling and sched.all_greedy():
                    out = sched.schedule()  # empty when every sequence ends with the step in flight
            launched: _InFlight | None = None
            collected: tuple[_InFlight, RunnerOutput, float, float] | None = None
            launch_s = 0.0  # the model call's own time in this turn (not the loop's)
            failing = out
            try:  # the model: a failure here ends this engine's requests, and the loop goes on
                if out is not None and not out.is_empty:
                    start = time.perf_counter()
                    launched = _InFlight(out, start, self.llm.runner.launch(out))
                    launch_s = time.perf_counter() - start
                if inflight is None and not chain:  # a synchronous step: collected right away
                    inflight, launched = launched, None
                if inflight is not None:
                    failing = inflight.out
                    waited = time.perf_counter()
                    collected = (inflight, inflight.collect(), waited - launch_s, time.perf_counter())
            except Exception as exc:
                logger.exception("generation step %d failed", failing.step if failing is not None else -1)
                launched = None  # its tokens (if any were computed) belong to sequences that fail now
                if not self._fail_step(loop, exc):
                    return
            inflight = launched
            if collected is not None:  # bookkeeping: a failure here is a loop bug and stops the engine (_run)
                done, result, waited, end = collected
                step = self._report(done, end, None if last_end is None else waited - last_end)
                last_end = end
                with self._lock:
                    advanced = self.llm.scheduler.advance(result)
                if not self._emit(loop, step, advanced):
                    return
            elif out is not None and out.is_empty and inflight is None:  # cannot happen with a valid config
                time.sleep(0.001)  # never spin

    def _report(self, step: _InFlight, end: float, loop_s: float | None) -> StepReport:
        """The collected step's :class:`StepReport`; ``loop_s``: the loop's host time since the previous collect
        returned, the model calls left out (with async scheduling: the previous step's advance and emit, and this
        turn's schedule). With async scheduling a step's ``decode_s`` counts from its launch, so it includes the
        previous step still computing."""
        out, timing = step.out, self.llm.runner.last_timing
        return StepReport(
            len(out.prefill),
            len(out.decode),
            out.num_batched_tokens,
            end - step.start,
            timing.kv_length,
            timing.decode_s,
            timing.prefill_s,
            loop_s,
            tuple(item.queued_s for item in out.prefill),
            timing.mixed,
        )

    def _fail_step(self, loop: asyncio.AbstractEventLoop, exc: Exception) -> bool:
        """A step failed: the runner forgets its cache and every sequence of the engine ends with the error now,
        before the next step. False once the event loop is closed."""
        self.llm.runner.reset()
        if not isinstance(exc, MiaohuiError):
            exc = EngineStoppedError(f"generation step failed: {exc!r}", "retry; if it persists, check the engine logs")
        with self._lock:
            sched = self.llm.scheduler
            failed = [sid for sid in sched.seq_ids() if sched.abort(sid, "error") is not None]
        return self._deliver_soon(loop, self._fail, failed, exc)

    def _emit(self, loop: asyncio.AbstractEventLoop, step: StepReport, advanced: list[Advanced]) -> bool:
        """Make the texts of a step's tokens and hand them to the event loop; False once it is closed."""
        with self._lock:
            updates = self.llm.scheduler.emit(advanced)
        return self._deliver_soon(loop, self._deliver, step, updates)

    @staticmethod
    def _deliver_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> bool:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to stream to
            return False
        return True

    def _deliver(self, step: StepReport, updates: list[SequenceUpdate]) -> None:
        """On the event loop: one step's updates to their streams, and the step's metrics."""
        safe_call(self.observer.on_step, step)
        now = time.monotonic()  # the step's tokens are all streamed now
        itls: list[float] = []
        for update in updates:
            self._publish(update, now, itls)
        if itls:
            safe_call(self.observer.on_tokens, itls)
        self._counts()

    def _fail(self, request_ids: list[int], exc: BaseException) -> None:
        """On the event loop: a failed step ended these requests with ``exc``."""
        for rid in request_ids:
            track = self._tracks.pop(rid, None)
            if track is not None:
                track.stream._push(exc)
                e2e = time.monotonic() - track.arrival
                safe_call(self.observer.on_finish, e2e, track.stream.prompt_tokens, track.tokens, "error")
        self._counts()

    def _publish(self, up: SequenceUpdate, now: float, itls: list[float]) -> None:
        """One update to its stream at ``now``; a later token's inter-token latency goes to ``itls``."""
        track = self._tracks.get(up.seq_id)
        if track is None:
            return
        if track.last is None:
            safe_call(self.observer.on_first_token, now - track.arrival)
        else:
            itls.append(now - track.last)
        track.last = now
        track.tokens = up.num_output_tokens
        prompt = track.stream.prompt_tokens
        event = TokenEvent(
            up.seq_id,
            up.token_id,
            up.text,
            up.num_output_tokens,
            up.finish_reason,
            prompt,
            up.num_output_tokens,
        )
        track.stream._push(event)
        if up.finish_reason is not None:
            del self._tracks[up.seq_id]
            safe_call(self.observer.on_finish, now - track.arrival, prompt, up.num_output_tokens, up.finish_reason)

    def _fail_all(self, exc: BaseException) -> None:
        """On the event loop: every open request ends with ``exc`` (its sequence is aborted)."""
        rids = list(self._tracks)
        with self._lock:
            for rid in rids:
                self.llm.scheduler.abort(rid, "error")
        self._fail(rids, exc)
