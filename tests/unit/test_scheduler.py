"""The continuous-batching scheduler with no model: a fake runner answers fixed tokens, a fake
detokenizer maps token ids to characters. Then the real runner and async loop on a numpy fake engine.
Exact error texts are matched."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence

import numpy as np
import pytest
from pydantic import ValidationError

from miaohui.errors import ConfigError, InputError, InternalError, QueueFullError
from miaohui.generation.engine.client import EngineStoppedError
from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.sampling import make_rng, sample
from miaohui.generation.engine.scheduler import (
    RunnerOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SequenceStatus,
    SequenceUpdate,
)
from miaohui.generation.executors.base import CausalLMEngine
from miaohui.generation.models.dims import DecoderDims
from miaohui.priority import PRIORITY

EOS = 0
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class CharDetok:
    """Token id t ↦ chr(ord('a') + t - 1); token 0 (EOS) has no text."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.prompt = list(prompt)

    def push(self, token_id: int) -> str:
        return "" if token_id == EOS else chr(ord("a") + token_id - 1)

    def flush(self) -> str:
        return ""


def make(**cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), eos_token_ids=[EOS], detokenizer_factory=CharDetok)


def run(sched: Scheduler, out: SchedulerOutput, token: int | dict[int, int] = 5) -> list[SequenceUpdate]:
    """Fake runner: every scheduled sequence gets ``token`` (or its own from a dict)."""
    ids = [p.seq_id for p in out.prefill] + [d.seq_id for d in out.decode]
    tokens = {i: token[i] if isinstance(token, dict) else token for i in ids}
    return sched.update(RunnerOutput(out.step, tokens))


def test_new_requests_join_between_decode_steps() -> None:
    sched = make(max_running_seqs=4, max_batched_tokens=64)
    a = sched.add([1, 2, 3], GREEDY)
    out1 = sched.schedule()
    assert [p.seq_id for p in out1.prefill] == [a.seq_id] and out1.decode == ()
    run(sched, out1)
    b = sched.add([4, 5], GREEDY)
    out2 = sched.schedule()
    assert [d.seq_id for d in out2.decode] == [a.seq_id]
    assert out2.decode[0].token_id == 5  # the token sampled at prefill is fed back
    assert [p.seq_id for p in out2.prefill] == [b.seq_id]
    assert out2.num_batched_tokens == 1 + 2
    run(sched, out2)
    out3 = sched.schedule()
    assert [d.seq_id for d in out3.decode] == [a.seq_id, b.seq_id] and out3.prefill == ()


def test_prefill_respects_token_budget_with_padding_and_fifo() -> None:
    sched = make(max_running_seqs=8, max_batched_tokens=10)
    s1 = sched.add([1] * 4, GREEDY)
    s2 = sched.add([1] * 5, GREEDY)  # 2 rows x 5 padded = 10 fits
    s3 = sched.add([1] * 2, GREEDY)  # 3 x 5 = 15 does not; FIFO: nothing behind it jumps ahead
    out = sched.schedule()
    assert [p.seq_id for p in out.prefill] == [s1.seq_id, s2.seq_id]
    assert out.num_batched_tokens == 10
    run(sched, out)
    out2 = sched.schedule()  # 2 decode tokens + 1 x 2 prefill
    assert [p.seq_id for p in out2.prefill] == [s3.seq_id] and out2.num_batched_tokens == 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_prompts_are_held_for_a_joint_prefill_while_others_decode() -> None:
    """``prefill_min_prompts``: while a sequence decodes, one waiting prompt is held until a second arrives (then both
    are prefilled together) or until it has waited ``prefill_max_wait_ms``; with nothing decoding it goes at once."""
    clock = FakeClock()
    cfg = SchedulerConfig(max_running_seqs=8, max_batched_tokens=64, prefill_min_prompts=2, prefill_max_wait_ms=10)
    sched = Scheduler(cfg, eos_token_ids=[EOS], clock=clock)
    a = sched.add([1, 2, 3], GREEDY)
    out = sched.schedule()  # nothing decodes: no reason to wait
    assert [p.seq_id for p in out.prefill] == [a.seq_id]
    run(sched, out)
    b = sched.add([4, 5], GREEDY)
    clock.now += 0.004
    out = sched.schedule()
    assert out.prefill == () and [d.seq_id for d in out.decode] == [a.seq_id]  # b is held: 4 ms < 10 ms
    run(sched, out)
    c = sched.add([6, 7, 8], GREEDY)
    out = sched.schedule()  # two wait now: both go in one prefill
    assert [p.seq_id for p in out.prefill] == [b.seq_id, c.seq_id]
    run(sched, out)
    d = sched.add([9], GREEDY)
    clock.now += 0.009
    out = sched.schedule()
    assert out.prefill == ()
    run(sched, out)
    clock.now += 0.001  # d has waited 10 ms: it goes alone
    out = sched.schedule()
    assert [p.seq_id for p in out.prefill] == [d.seq_id]


def test_each_prefill_says_how_long_its_prompt_waited() -> None:
    """``PrefillItem.queued_s``: arrival → the step that prefills it (TTFT's queue part, the server's queue histogram)."""
    clock = FakeClock()
    sched = Scheduler(SchedulerConfig(max_running_seqs=1, max_batched_tokens=64), eos_token_ids=[EOS], clock=clock)
    a = sched.add([1, 2], SamplingParams(max_tokens=1, temperature=0.0))
    clock.now += 0.002
    b = sched.add([3], GREEDY)  # waits for a's slot
    clock.now += 0.003
    out = sched.schedule()
    assert [(p.seq_id, round(p.queued_s, 6)) for p in out.prefill] == [(a.seq_id, 0.005)]
    run(sched, out)  # a ends after its one token
    clock.now += 0.010
    out = sched.schedule()
    assert [(p.seq_id, round(p.queued_s, 6)) for p in out.prefill] == [(b.seq_id, 0.013)]


def test_interactive_requests_wait_ahead_of_bulk_ones() -> None:
    """The API key's priority class (:mod:`miaohui.priority`): interactive prompts are prefilled before bulk ones that
    arrived earlier; FIFO within a class."""
    sched = make(max_running_seqs=8, max_batched_tokens=64, max_prefill_seqs=2)
    token = PRIORITY.set("bulk")
    bulk = [sched.add([1, 2, 3], GREEDY) for _ in range(2)]
    PRIORITY.reset(token)
    interactive = [sched.add([1, 2, 3], GREEDY) for _ in range(2)]
    first = sched.schedule()
    assert [p.seq_id for p in first.prefill] == [s.seq_id for s in interactive]
    run(sched, first)
    assert [p.seq_id for p in sched.schedule().prefill] == [s.seq_id for s in bulk]


def test_max_prefill_seqs_spreads_prompts_that_arrive_together() -> None:
    """Four prompts that arrive together are prefilled two per step with ``max_prefill_seqs=2`` (FIFO); the
    token budget and the free slots would have taken all four at once."""
    sched = make(max_running_seqs=8, max_batched_tokens=64, max_prefill_seqs=2)
    seqs = [sched.add([1, 2, 3], GREEDY) for _ in range(4)]
    first = sched.schedule()
    assert [p.seq_id for p in first.prefill] == [s.seq_id for s in seqs[:2]]
    run(sched, first)
    second = sched.schedule()
    assert [p.seq_id for p in second.prefill] == [s.seq_id for s in seqs[2:]]
    assert [d.seq_id for d in second.decode] == [s.seq_id for s in seqs[:2]]


def test_max_prefill_seqs_below_the_joint_prefill_minimum_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"prefill_min_prompts=4 > max_prefill_seqs=2"):
        SchedulerConfig(max_prefill_seqs=2, prefill_min_prompts=4, prefill_max_wait_ms=5)


def test_a_held_prompt_goes_when_no_more_could_fit() -> None:
    clock = FakeClock()
    cfg = SchedulerConfig(max_running_seqs=2, max_batched_tokens=64, prefill_min_prompts=4, prefill_max_wait_ms=50)
    sched = Scheduler(cfg, eos_token_ids=[EOS], clock=clock)
    sched.add([1, 2], GREEDY)
    run(sched, sched.schedule())  # one sequence decodes now
    b = sched.add([3, 4], GREEDY)  # one slot left: waiting for more prompts cannot make a bigger prefill
    out = sched.schedule()
    assert [p.seq_id for p in out.prefill] == [b.seq_id]


def test_holding_prompts_needs_a_wait_bound() -> None:
    with pytest.raises(ConfigError, match="prefill_max_wait_ms"):
        SchedulerConfig(prefill_min_prompts=2)


def test_max_running_seqs() -> None:
    sched = make(max_running_seqs=2, max_batched_tokens=100)
    seqs = [sched.add([1, 2], GREEDY) for _ in range(3)]
    out = sched.schedule()
    assert len(out.prefill) == 2 and sched.num_running == 2 and sched.num_waiting == 1
    run(sched, out)
    out2 = sched.schedule()
    assert out2.prefill == () and len(out2.decode) == 2
    assert seqs[2].status is SequenceStatus.WAITING


def test_abort_frees_the_slot_immediately_and_drops_its_token() -> None:
    sched = make(max_running_seqs=1, max_batched_tokens=100)
    a = sched.add([1, 2], GREEDY)
    b = sched.add([3], GREEDY)
    out = sched.schedule()
    assert [p.seq_id for p in out.prefill] == [a.seq_id]
    update = sched.abort(a.seq_id)  # while the step is "computing"
    assert update == SequenceUpdate(a.seq_id, None, "", 0, "abort")
    assert run(sched, out) == []  # its token is dropped
    out2 = sched.schedule()
    assert [p.seq_id for p in out2.prefill] == [b.seq_id] and out2.decode == ()
    assert out2.finished_ids == (a.seq_id,)  # the runner frees its KV row
    assert a.finish_reason == "abort" and sched.get(a.seq_id) is None
    assert sched.abort(a.seq_id) is None  # idempotent


def test_abort_a_waiting_request() -> None:
    sched = make(max_running_seqs=1, max_batched_tokens=100)
    a = sched.add([1], GREEDY)
    b = sched.add([2], GREEDY)
    assert sched.abort(b.seq_id) is not None
    assert sched.num_waiting == 1 and b.finish_reason == "abort"
    out = sched.schedule()
    assert [p.seq_id for p in out.prefill] == [a.seq_id] and out.finished_ids == (b.seq_id,)


def test_finish_on_eos_without_text() -> None:
    sched = make()
    a = sched.add([1], GREEDY)
    run(sched, sched.schedule(), 1)
    (up,) = run(sched, sched.schedule(), EOS)
    assert up.finish_reason == "stop" and up.token_id == EOS and up.text == ""
    assert a.output_ids == [1, EOS] and a.text == "a"
    assert sched.num_running == 0 and not sched.has_work()


def test_ignore_eos_and_stop_token_ids() -> None:
    sched = make()
    a = sched.add([1], SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=(7,)))
    assert run(sched, sched.schedule(), EOS)[0].finish_reason is None
    assert run(sched, sched.schedule(), 7)[0].finish_reason == "stop"
    assert a.output_ids == [EOS, 7]


def test_finish_on_max_tokens() -> None:
    sched = make()
    sched.add([1], SamplingParams(max_tokens=3))
    reasons = [run(sched, sched.schedule(), 2)[0].finish_reason for _ in range(3)]
    assert reasons == [None, None, "length"]
    assert not sched.has_work()


def test_finish_at_context_length() -> None:
    sched = make(max_model_len=4, max_batched_tokens=16)
    sched.add([1, 2], SamplingParams(max_tokens=100))
    assert run(sched, sched.schedule())[0].finish_reason is None
    assert run(sched, sched.schedule())[0].finish_reason == "length"  # 2 prompt + 2 output = 4


def test_stop_string_is_cut_and_held_back_text_is_released() -> None:
    sched = make()
    a = sched.add([1], SamplingParams(max_tokens=20, stop=("cd",)))
    texts = []
    for tok in (1, 2, 3, 4, 5):  # a b c d e
        ups = run(sched, sched.schedule(), tok)
        texts.append(ups[0].text)
        if ups[0].finish_reason:
            break
    # "a" is safe to show once "b" arrives; "b" could start "cd"... until "c" makes it "bc"
    assert texts == ["", "a", "b", ""]
    assert a.finish_reason == "stop" and a.text == "ab" and a.output_ids == [1, 2, 3, 4]


def test_held_back_text_is_flushed_on_finish() -> None:
    sched = make()
    a = sched.add([1], SamplingParams(max_tokens=2, stop=("xyz",)))
    texts = [run(sched, sched.schedule(), t)[0].text for t in (1, 2)]
    assert texts == ["", "ab"] and a.finish_reason == "length"


def test_a_stop_string_found_after_the_next_step_was_scheduled_drops_that_steps_token() -> None:
    """advance() → schedule() → emit(): what an engine loop does when it makes a step's text while the next step
    computes. A stop string is only seen in emit, so the sequence is already in the next step; its token there
    is dropped and the text is cut as without the overlap."""
    sched = make()
    a = sched.add([1], SamplingParams(max_tokens=20, stop=("cd",)))
    texts: list[str] = []
    out = sched.schedule()
    pending = sched.advance(RunnerOutput(out.step, {a.seq_id: 1}))
    for tok in (2, 3, 4):  # b c d: "cd" completes with token 4
        out = sched.schedule()
        texts += [u.text for u in sched.emit(pending)]
        pending = sched.advance(RunnerOutput(out.step, {a.seq_id: tok}))
    out = sched.schedule()  # a is scheduled again: its stop string has not been emitted yet
    assert [d.seq_id for d in out.decode] == [a.seq_id]
    final = sched.emit(pending)
    assert final[0].finish_reason == "stop" and a.is_finished
    assert sched.advance(RunnerOutput(out.step, {a.seq_id: 5})) == []  # the extra step's token is dropped
    assert [*texts, final[0].text] == ["", "a", "b", ""] and a.text == "ab" and a.output_ids == [1, 2, 3, 4]
    # an abort between advance and emit: no update for the token (the stream already ended)
    b = sched.add([1], GREEDY)
    out = sched.schedule()
    pending = sched.advance(RunnerOutput(out.step, {b.seq_id: 2}))
    sched.abort(b.seq_id)
    assert sched.emit(pending) == []


def test_queue_full() -> None:
    sched = make(max_waiting=2)
    sched.add([1], GREEDY)
    sched.add([1], GREEDY)
    with pytest.raises(QueueFullError, match=re.escape("2 requests are waiting (max_waiting=2)")):
        sched.add([1], GREEDY)
    sched.schedule()  # admitted → no longer waiting
    sched.add([1], GREEDY)


def test_prompt_errors() -> None:
    sched = make(max_batched_tokens=16, max_model_len=32, max_running_seqs=4)
    with pytest.raises(InputError, match="^the prompt has no tokens — send a non-empty prompt$"):
        sched.add([], GREEDY)
    with pytest.raises(InputError, match=re.escape("the prompt has 40 tokens; the context length is 32")):
        sched.add([1] * 40, GREEDY)
    with pytest.raises(InputError, match=re.escape("more than max_batched_tokens=16 (one step's budget)")):
        sched.add([1] * 17, GREEDY)
    sched.add([1], GREEDY, seq_id=7)
    with pytest.raises(InputError, match="sequence id 7 is already in use"):
        sched.add([1], GREEDY, seq_id=7)


def test_config_cross_check() -> None:
    with pytest.raises(ConfigError, match=re.escape("max_batched_tokens=4 < max_running_seqs=8")):
        SchedulerConfig(max_running_seqs=8, max_batched_tokens=4)
    with pytest.raises(ValidationError):
        SchedulerConfig(max_running_seqs=0)


def test_sampling_params_errors_name_the_value() -> None:
    with pytest.raises(InputError, match=re.escape("max_tokens=0: Input should be greater than or equal to 1")):
        SamplingParams.create(max_tokens=0)
    with pytest.raises(InputError, match=re.escape("top_p=1.5")):
        SamplingParams.create(top_p=1.5)
    with pytest.raises(InputError, match="stop sequences must not be empty"):
        SamplingParams.create(stop=[""])
    assert SamplingParams.create(stop="###").stop == ("###",)


def test_many_requests_all_finish_with_continuous_batching() -> None:
    sched = make(max_running_seqs=3, max_batched_tokens=12)
    seqs = [sched.add([1] * (1 + i % 4), SamplingParams(max_tokens=1 + i % 5)) for i in range(10)]
    steps = 0
    while sched.has_work():
        out = sched.schedule()
        assert len(out.decode) + len(out.prefill) <= 3
        assert out.num_batched_tokens <= 12
        run(sched, out)
        steps += 1
    assert all(s.finish_reason == "length" and len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert steps < sum(s.params.max_tokens for s in seqs)  # batching happened


# ---- the runner and the async loop on a fake engine (numpy only, no model) ------------------------------
class CountingEngine(CausalLMEngine):
    """Next token = last input token + 1 (mod vocab); the KV cache holds each token id as its 'key'."""

    def __init__(self, vocab: int = 50, delay: float = 0.0) -> None:
        super().__init__(DecoderDims(1, 4, 1, 1, 2, 4, vocab, 1e4, 1e-5, 256), eos_token_ids=[EOS], pad_token_id=EOS)
        self.delay = delay
        self.calls: list[tuple[int, int]] = []

    def _forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        if self.delay:
            time.sleep(self.delay)
        b, s = input_ids.shape
        self.calls.append((b, s))
        logits = np.zeros((b, self.dims.vocab), np.float32)
        logits[np.arange(b), (input_ids[:, -1] + 1) % self.dims.vocab] = 1.0
        new = np.broadcast_to(input_ids[:, None, :, None].astype(np.float32), (b, 1, s, 2))
        return logits, [np.concatenate([p, new], axis=2) for p in past]


def test_runner_batches_rows_of_different_lengths_and_drops_finished_ones() -> None:
    engine = CountingEngine()
    llm = LLMEngine(engine, None, SchedulerConfig(max_running_seqs=4, max_batched_tokens=64))
    results = llm.generate([[1, 2, 3], [10], [20, 21]], SamplingParams(temperature=0.0, max_tokens=4))
    assert [r[0] for r in results] == [[4, 5, 6, 7], [11, 12, 13, 14], [22, 23, 24, 25]]
    assert engine.calls[0] == (3, 3)  # one left-padded prefill
    assert all(c == (3, 1) for c in engine.calls[1:])  # then one decode call per step for all rows
    assert llm.runner.rows == []  # finished: generate leaves the engine idle, and the runner drops their rows
    a = llm.add_request([5], SamplingParams(temperature=0.0, max_tokens=2))
    llm.step()
    b = llm.add_request([7, 8], SamplingParams(temperature=0.0, max_tokens=3))
    ups = [up for _ in range(3) if (out := llm.step()) is not None for up in out.updates]
    assert [u.token_id for u in ups if u.seq_id == a] == [7]
    assert [u.token_id for u in ups if u.seq_id == b] == [9, 10, 11]
    assert llm.runner.rows == [b]  # a's row went when it stopped decoding; 0, 1, 2 went long before


async def test_async_loop_streams_and_cancel_frees_the_slot() -> None:
    llm = LLMEngine(CountingEngine(delay=0.002), None, SchedulerConfig(max_running_seqs=1, max_batched_tokens=8))
    async with AsyncLLMEngine(llm) as engine:
        long = engine.add([1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        queued = engine.add([3], SamplingParams(temperature=0.0, max_tokens=3))
        got = []
        async for ev in long:
            got.append(ev.token_id)
            if len(got) == 2:
                break
        await long.aclose()
        assert got == [2, 3]
        events = [ev async for ev in queued]
        assert [e.token_id for e in events] == [4, 5, 6] and events[-1].finish_reason == "length"
        assert (engine.num_running, engine.num_waiting) == (0, 0)
        gen = engine.generate([1], SamplingParams(temperature=0.0, max_tokens=40))
        assert (await gen.__anext__()).token_id == 2
        task = asyncio.create_task(gen.__anext__())
        await asyncio.sleep(0)
        task.cancel()  # the consumer task is cancelled (client disconnect)
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        assert (engine.num_running, engine.num_waiting) == (0, 0)
        with pytest.raises(InputError, match=re.escape("prompt token ids must be ints in [0, 50); got [99]")):
            engine.add([99], GREEDY)
    with pytest.raises(EngineStoppedError, match="the generation engine is not running"):
        engine.add([1], GREEDY)


def test_sampling_is_safe_and_seeded() -> None:
    logits = np.array([np.nan, 1.0, np.inf, -np.inf, 0.5], dtype=np.float32)
    assert sample(logits, SamplingParams(temperature=0.0), make_rng(0)) == 2
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    row = np.linspace(0.0, 5.0, 1000).astype(np.float32)
    draws = [sample(row, params, make_rng(3)) for _ in range(3)]
    assert len(set(draws)) == 1
    # top_p keeps the smallest set reaching p: with one dominant token nothing else is drawn
    peaked = np.full(1000, -10.0, np.float32)
    peaked[17] = 10.0
    rng = make_rng(1)
    assert {sample(peaked, SamplingParams(temperature=1.0, top_p=0.5), rng) for _ in range(50)} == {17}
    assert np.isfinite(np.array([sample(np.full(5, -np.inf), SamplingParams(), rng)])).all()


class FailingEngine(CountingEngine):
    """Raises on its ``fail_at``-th forward call (a GPU fault stand-in: a failing step cannot be caused otherwise)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(delay=0.001)
        self.fail_at = fail_at

    def _forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        if len(self.calls) + 1 == self.fail_at:
            self.calls.append((-1, -1))
            raise RuntimeError("device fault")
        return super()._forward(input_ids, attention_mask, position_ids, past)


def test_async_scheduling_needs_a_runner_that_chains_steps() -> None:
    """The CPU runner needs every token on the host: async scheduling is off by default there and a clear
    ConfigError when asked for (the chaining loop itself: tests/unit/test_slot_runner.py)."""
    assert not AsyncLLMEngine(LLMEngine(CountingEngine(), None)).async_scheduling
    on = SchedulerConfig(max_running_seqs=2, max_batched_tokens=8, async_scheduling=True)
    with pytest.raises(ConfigError, match="async scheduling needs an engine that feeds its own greedy picks"):
        AsyncLLMEngine(LLMEngine(CountingEngine(), None, on))
    with pytest.raises(ConfigError, match="async_scheduling: false"):
        AsyncLLMEngine(LLMEngine(CountingEngine(), None), async_scheduling=True)


def test_a_step_scheduled_before_the_previous_was_advanced_feeds_no_token_and_stops_at_the_length() -> None:
    """Async scheduling: schedule() again while a step is in flight. The in-flight sequence's decode item carries
    no token (the engine feeds its own pick); once its in-flight tokens reach max_tokens it is left out."""
    sched = make(max_running_seqs=4, max_batched_tokens=64)
    a = sched.add([1], SamplingParams(temperature=0.0, max_tokens=3))
    first = sched.schedule()  # prefill: 1 token in flight
    second = sched.schedule()
    assert [(d.seq_id, d.token_id) for d in second.decode] == [(a.seq_id, None)]
    assert sched.schedule().decode != ()  # 2 in flight, a third token still fits max_tokens=3
    assert sched.schedule().decode == ()  # 3 in flight reach max_tokens: left out
    ups = [sched.update(RunnerOutput(o.step, {a.seq_id: t})) for o, t in ((first, 2), (second, 3))]
    assert [u[0].text for u in ups] == ["b", "c"] and a.in_flight == 1
    assert sched.update(RunnerOutput(second.step + 1, {a.seq_id: 4}))[0].finish_reason == "length"
    assert a.output_ids == [2, 3, 4]
    # a synchronous schedule (nothing in flight) feeds the host's last token
    b = sched.add([7], GREEDY)
    run(sched, sched.schedule(), 9)
    assert [(d.seq_id, d.token_id) for d in sched.schedule().decode] == [(b.seq_id, 9)]


async def test_steps_run_while_the_event_loop_is_busy() -> None:
    """The engine thread schedules, runs and updates steps back to back: a busy event loop (here blocked for
    80 ms, as by streaming many SSE chunks) does not stall generation; its tokens arrive in order afterwards."""
    engine = CountingEngine(delay=0.002)
    llm = LLMEngine(engine, None, SchedulerConfig(max_running_seqs=2, max_batched_tokens=8))
    async with AsyncLLMEngine(llm) as loop_engine:
        stream = loop_engine.add([1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        first = await stream.__anext__()
        calls = len(engine.calls)
        time.sleep(0.08)  # the event loop is busy: no await
        assert len(engine.calls) - calls >= 10  # steps went on meanwhile
        rest = [ev async for ev in stream]
        assert [first.token_id, *[e.token_id for e in rest]] == list(range(2, 32))
        assert rest[-1].finish_reason == "length"


async def test_a_failing_step_ends_its_requests_and_the_engine_keeps_serving() -> None:
    llm = LLMEngine(FailingEngine(fail_at=3), None, SchedulerConfig(max_running_seqs=2, max_batched_tokens=8))
    async with AsyncLLMEngine(llm) as engine:
        stream = engine.add([1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        with pytest.raises(InternalError, match=r"generation step failed: RuntimeError\('device fault'\)"):
            [ev async for ev in stream]
        assert (engine.num_running, engine.num_waiting) == (0, 0)
        events = [ev async for ev in engine.add([5], SamplingParams(temperature=0.0, max_tokens=3))]
        assert [e.token_id for e in events] == [6, 7, 8]


async def test_a_broken_loop_ends_every_request_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the loop itself (here the scheduler's advance raises: a fault that cannot be caused otherwise)
    stops the engine and ends the open requests with an error."""
    llm = LLMEngine(CountingEngine(delay=0.001), None, SchedulerConfig(max_running_seqs=2, max_batched_tokens=8))
    async with AsyncLLMEngine(llm) as engine:

        def broken(output: RunnerOutput) -> list[SequenceUpdate]:
            raise KeyError("bookkeeping")

        monkeypatch.setattr(llm.scheduler, "advance", broken)
        stream = engine.add([1], SamplingParams(temperature=0.0, max_tokens=5))
        with pytest.raises(EngineStoppedError, match="the generation loop stopped: KeyError"):
            await asyncio.wait_for(stream.__anext__(), 5)
        assert not engine.is_running


def test_prompt_check_returns_plain_ints_and_names_bad_ids() -> None:
    """The C-speed check of a prompt's ids: integers of any kind (numpy's too) in range come back as a list of
    ``int``; a float, a string, an id out of range or past int64 is named in the error."""
    from miaohui.generation.engine.scheduler import SchedulerConfig, check_prompt

    cfg = SchedulerConfig(max_model_len=64, max_batched_tokens=64)
    got = check_prompt((np.int64(3), 4, True), cfg, 50)
    assert got == [3, 4, 1] and all(type(t) is int for t in got)
    assert check_prompt(tuple(range(50)), cfg, 50) == list(range(50))
    for bad, named in (([1, 2.0], "[2.0]"), ([1, "7"], "['7']"), ([49, 50], "[50]"), ([-1], "[-1]"),
                       ([1 << 70], f"[{1 << 70}]"), ([np.int64(60)], "[np.int64(60)]")):  # fmt: skip
        with pytest.raises(InputError, match=re.escape(f"prompt token ids must be ints in [0, 50); got {named}")):
            check_prompt(bad, cfg, 50)
