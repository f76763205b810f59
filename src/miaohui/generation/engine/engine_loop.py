"""The generation loop: :class:`LLMEngine` owns the step (schedule → launch → collect → advance → emit), in two
variants side by side — :meth:`LLMEngine.step` (synchronous) and :meth:`LLMEngine.step_with_batch_queue` (async
scheduling: step N+1 is launched before step N is collected) — chosen once (``step_fn``), as vLLM's ``EngineCore``
does. :class:`AsyncLLMEngine` runs ``step_fn`` in its own thread and streams each step's tokens on the event loop;
it is the in-process implementation of the front-end contract (:class:`~miaohui.generation.engine.client.LLMClient`).

The event loop stays free to accept requests, stream tokens and handle disconnects while a step runs, and gets each
step's updates in one call. The scheduler is shared under the engine's lock: requests join it between steps, and an
abort frees the slot at once (the step in flight may still compute the sequence's token, which is then dropped).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

from miaohui.errors import ConfigError, InternalError, MiaohuiError
from miaohui.generation.cache.prefix_kv import PrefixKV
from miaohui.generation.engine.client import EngineStoppedError, RequestStream, Sink, TokenEvent, stream_events
from miaohui.generation.engine.observer import GenerationObserver, StepReport, safe_call
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.runner import Collect, ModelRunner
from miaohui.generation.engine.scheduler import (
    FinishReason,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SequenceUpdate,
)
from miaohui.generation.engine.slot_runner import SlotModelRunner
from miaohui.generation.engine.structured import TokenMasks, check_supported
from miaohui.gil import GENERATION_SWITCH_US, apply_switch_interval

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from miaohui.generation.cache.slot_prefix import SlotPrefixKV
    from miaohui.generation.executors.base import AnyCausalLMEngine, CausalLMEngine, SlotCausalLMEngine

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "GenerationObserver", "LLMEngine", "StepOutput"]


@dataclass(frozen=True)
class _InFlight:
    """A launched step: what was scheduled, when it was launched, and the call that collects its tokens."""

    out: SchedulerOutput
    start: float
    collect: Collect


@dataclass(frozen=True)
class StepOutput:
    """What one collected step produced: its updates and report, or (a failed model call) the error and the
    sequences it ended."""

    updates: list[SequenceUpdate] = field(default_factory=list)
    report: StepReport | None = None
    error: MiaohuiError | None = None
    failed: list[int] = field(default_factory=list)
    """Sequences ended with ``error`` (every sequence of the engine: a failed step fails its whole batch)."""


class LLMEngine:
    """A scheduler and a model runner, and the step loop over them (see the module docstring).

    ``lock`` guards the scheduler: :class:`AsyncLLMEngine` adds and aborts requests from the event loop while its
    thread steps; the model calls run outside it."""

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
        self.scheduler = Scheduler(self.config, engine.eos_token_ids, factory, vocab=engine.dims.vocab)
        masks = TokenMasks(tokenizer, engine.dims.vocab, engine.eos_token_ids) if tokenizer is not None else None
        self.runner: ModelRunner | SlotModelRunner = (
            SlotModelRunner(engine, _slot_prefix(engine, config))
            if isinstance(engine, SlotCausalLMEngine)
            else ModelRunner(engine, masks, _prefix(engine, config))
        )
        self.lock = threading.Lock()
        self.async_scheduling = False
        self.step_fn: Callable[[], StepOutput | None] = self.step
        """:meth:`step`, or :meth:`step_with_batch_queue` once :meth:`use_async_scheduling` chose it."""
        self._inflight: _InFlight | None = None
        self._last_end: float | None = None

    def use_async_scheduling(self) -> None:
        """Choose :meth:`step_with_batch_queue` as ``step_fn`` (before the first step); ConfigError for an engine that
        cannot feed its own greedy picks."""
        if not self.runner.chains:
            raise ConfigError(
                f"async scheduling needs an engine that feeds its own greedy picks; {self.engine.name} does not",
                "set scheduler: async_scheduling: false (or leave it unset) for this engine",
            )
        if isinstance(self.runner, SlotModelRunner):
            self.runner.enable_chaining()
        self.async_scheduling = True
        self.step_fn = self.step_with_batch_queue

    @property
    def vocab(self) -> int:
        return self.engine.dims.vocab

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. InputError (a bad prompt fails alone, never its batch) / QueueFullError
        as :meth:`Scheduler.add`."""
        params = params or SamplingParams()
        check_supported(params, isinstance(self.runner, ModelRunner), "this GPU slot engine")
        with self.lock:
            return self.scheduler.add(prompt_ids, params).seq_id

    def abort(self, request_id: int) -> bool:
        with self.lock:
            return self.scheduler.abort(request_id) is not None

    def has_work(self) -> bool:
        """Requests waiting or running, or a step in flight."""
        return self._inflight is not None or self.scheduler.has_work()

    def idle(self) -> None:
        """The caller sits idle (nothing to run): the next step's ``loop_s`` is not measured from the last one, and the
        runner lets go of the sequences that finished now (with a prefix cache, storing their prompts and answers),
        not at the next request's first step, where it would be part of that request's time to first token."""
        self._last_end = None
        if not self.has_work():
            self.runner.idle()

    # ---- the two step variants ------------------------------------------------------------------------

    def step(self) -> StepOutput | None:
        """Schedule → launch → collect → advance → emit; None when there was nothing to run."""
        with self.lock:
            out = self.scheduler.schedule()
        if out.is_empty:
            return None
        return self._step(out, chain=False)

    def step_with_batch_queue(self) -> StepOutput | None:
        """Async scheduling: while every running sequence decodes greedily, schedule and launch step N+1 *before*
        collecting step N (the engine feeds step N's greedy picks to N+1 on the device), so the device always has
        the next step queued and N's advance and emit run while N+1 computes; otherwise as :meth:`step`. None when
        this call collected nothing (it only launched, or there was nothing to run)."""
        out: SchedulerOutput | None
        with self.lock:
            sched = self.scheduler
            if self._inflight is None:
                out = sched.schedule()
                chain = sched.all_greedy()  # the sequences it just admitted included
            else:  # collect the step in flight; launch the next one first if it can follow on the device
                out, chain = (sched.schedule() if sched.all_greedy() else None), True
        if self._inflight is None and (out is None or out.is_empty):
            return None
        return self._step(out, chain=chain)

    def _step(self, out: SchedulerOutput | None, *, chain: bool) -> StepOutput | None:
        """Launch ``out`` (if any), then collect the step in flight — or, unless ``chain``, the one just launched."""
        launch_s = 0.0  # the model call's own time in this step (not the loop's)
        launched: _InFlight | None = None
        failing = out
        try:  # the model: a failure ends every sequence of this engine, and the loop goes on
            if out is not None and not out.is_empty:
                start = time.perf_counter()
                launched = _InFlight(out, start, self.runner.launch(out))
                launch_s = time.perf_counter() - start
            done = self._inflight
            if done is None and not chain:
                done, launched = launched, None
            self._inflight = launched
            if done is None:
                return None
            failing = done.out
            waited = time.perf_counter()
            result = done.collect()
            end = time.perf_counter()
        except Exception as exc:
            logger.exception("generation step %d failed", failing.step if failing is not None else -1)
            self._inflight = None  # its tokens (if any were computed) belong to sequences that fail now
            return self._fail_step(exc)
        report = self._report(done, end, None if self._last_end is None else waited - launch_s - self._last_end)
        self._last_end = end
        with self.lock:  # bookkeeping: a failure here is a loop bug (AsyncLLMEngine stops)
            updates = self.scheduler.emit(self.scheduler.advance(result))
        return StepOutput(updates, report)

    def _report(self, step: _InFlight, end: float, loop_s: float | None) -> StepReport:
        """The collected step's :class:`StepReport`; ``loop_s``: the loop's host time since the previous collect
        returned, the model calls left out (with async scheduling: the previous step's advance and emit, and this
        turn's schedule). With async scheduling a step's ``decode_s`` counts from its launch, so it includes the
        previous step still computing."""
        out, timing = step.out, self.runner.last_timing
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
            timing.prompt_tokens,
            timing.cached_tokens,
            timing.kept_tokens,
        )

    def _fail_step(self, exc: Exception) -> StepOutput:
        """A step failed: the runner forgets its cache and every sequence of the engine ends with the error now."""
        self.runner.reset()
        error = exc if isinstance(exc, MiaohuiError) else None
        if error is None:
            error = InternalError(f"generation step failed: {exc!r}", "retry; if it persists, check the engine logs")
        with self.lock:
            sched = self.scheduler
            failed = [sid for sid in sched.seq_ids() if sched.abort(sid, "error") is not None]
        return StepOutput(error=error, failed=failed)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[tuple[list[int], str, FinishReason | None]]:
        """Offline: run prompts to completion with continuous batching; (token ids, text, reason) each."""
        ids = [self.add_request(p, params) for p in prompts]
        results: dict[int, tuple[list[int], list[str], list[FinishReason | None]]] = {i: ([], [], [None]) for i in ids}
        while self.has_work():
            step = self.step_fn()
            if step is not None and step.error is not None:
                raise step.error
            for up in step.updates if step is not None else ():
                toks, texts, reason = results[up.seq_id]
                if up.token_id is not None:
                    toks.append(up.token_id)
                texts.append(up.text)
                reason[0] = up.finish_reason
        self.idle()
        return [(results[i][0], "".join(results[i][1]), results[i][2][0]) for i in ids]


@dataclass
class _Track:
    stream: RequestStream
    arrival: float
    last: float | None = None
    tokens: int = 0


def _prefix(engine: CausalLMEngine, config: SchedulerConfig) -> PrefixKV | None:
    """The runner's prefix cache (``prefix_cache_mb``; None when it is 0)."""
    if config.prefix_cache_mb <= 0:
        return None
    return PrefixKV(engine.dims, config.prefix_block_size, int(config.prefix_cache_mb * 2**20))


def _slot_prefix(engine: SlotCausalLMEngine, config: SchedulerConfig) -> SlotPrefixKV | None:
    """The slot runner's prefix cache: a block pool of ``prefix_cache_mb`` beside the engine's slots (None at 0)."""
    if config.prefix_cache_mb <= 0:
        return None
    return engine.prefix_cache(config.prefix_block_size, int(config.prefix_cache_mb * 2**20))


class AsyncLLMEngine:
    """An :class:`LLMEngine` driven by its own thread; requests stream their tokens on the event loop.

    The engine thread calls ``llm.step_fn`` back to back while there is work — schedule, launch and collect (the
    model; the GPU), advance (append tokens, end-of-sequence and length checks), emit (detokenization, stop strings)
    — and sleeps otherwise. With ``async_scheduling`` (opt-in; the GPU engine) the step is
    :meth:`LLMEngine.step_with_batch_queue`, so the device always has the next step queued. Each step's updates go to
    the event loop in one ``call_soon_threadsafe``, where they are pushed to the request streams, so the model is
    never idle while the event loop streams the previous step's tokens.

    Use as ``async with AsyncLLMEngine(llm) as engine:`` or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self, llm: LLMEngine, observer: GenerationObserver | None = None, *, async_scheduling: bool | None = None
    ) -> None:
        self.llm = llm
        wanted = async_scheduling if async_scheduling is not None else llm.config.async_scheduling
        if wanted:
            llm.use_async_scheduling()
        self.async_scheduling = wanted
        """Launch step N+1 before collecting step N (``SchedulerConfig.async_scheduling``, off by default)."""
        self.observer = observer or GenerationObserver()
        self._tracks: dict[int, _Track] = {}
        self._lock = llm.lock
        self._work = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    @property
    def vocab(self) -> int:
        return self.llm.vocab

    @property
    def max_model_len(self) -> int:
        return self.llm.config.max_model_len

    @property
    def num_running(self) -> int:
        return self.llm.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.llm.scheduler.num_waiting

    @property
    def start_phases(self) -> dict[str, float]:
        return dict(getattr(self.llm.engine, "start_phases", {}))

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
        capture = getattr(self.llm.engine, "capture_deferred", None)
        if capture is not None:  # a GPU slot engine's graphs left for after ready (capture_after_ready)
            capture()

    def _warmup(self, prompt: list[int], params: SamplingParams) -> None:
        config = self.llm.config  # its two prompts must fit the queue whatever max_waiting the model serves with
        update = {"max_waiting": max(2, config.max_waiting), "prefix_cache_mb": 0.0}
        warm = LLMEngine(self.llm.engine, None, config.model_copy(update=update))
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

    async def shutdown(self) -> None:
        """:meth:`stop`, then close the model (its sessions, memory and compiled graphs)."""
        await self.stop()
        self.llm.engine.close()

    async def __aenter__(self) -> AsyncLLMEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, sink: Sink | None = None
    ) -> RequestStream:
        """Queue a request now and return its stream. Raises InputError / QueueFullError at once.
        ``sink``: receives the events (and a final exception) instead of the stream's queue."""
        if not self.is_running:
            raise EngineStoppedError("the generation engine is not running", "await engine.start() first")
        with self._work:
            rid = self.llm.scheduler.add(prompt_ids, params or SamplingParams()).seq_id
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

    # ---- the engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread. If the loop itself breaks (a scheduler bug, not a failing model step, which the step
        survives), every request ends with an error and the engine stops, instead of hanging."""
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
        """``llm.step_fn`` back to back while there is work; each collected step's tokens go to the event loop."""
        llm = self.llm
        while True:
            if not llm.has_work():
                llm.idle()  # outside the lock: a request that comes meanwhile is queued at once (the runner is ours)
            with self._work:
                while not self._stopping and not llm.has_work():
                    self._work.wait()
                if self._stopping:
                    return
            step = llm.step_fn()
            if step is None:
                if not llm.has_work() or llm._inflight is None:  # nothing ran (cannot happen with a valid config)
                    time.sleep(0.001)  # never spin
                continue
            if step.error is not None:
                delivered = self._deliver_soon(loop, self._fail, step.failed, step.error)
            else:
                delivered = self._deliver_soon(loop, self._deliver, step)
            if not delivered:
                return

    @staticmethod
    def _deliver_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> bool:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to stream to
            return False
        return True

    # ---- the event loop side ---------------------------------------------------------------------------

    def _counts(self) -> None:
        safe_call(self.observer.on_queue, self.num_running, self.num_waiting)

    def _deliver(self, step: StepOutput) -> None:
        """On the event loop: one step's updates to their streams, and the step's metrics."""
        if step.report is not None:
            safe_call(self.observer.on_step, step.report)
            if step.report.prompt_tokens:
                report = step.report
                safe_call(self.observer.on_prefix_cache, report.prompt_tokens, report.cached_tokens, report.kept_tokens)
        now = time.monotonic()  # the step's tokens are all streamed now
        itls: list[float] = []
        for update in step.updates:
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
            up.logprobs,
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
