"""The slot runner with a deterministic fake slot engine (no torch): slot allocation, release, errors."""

from __future__ import annotations

import numpy as np
import pytest

from miaohui.errors import InputError
from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.engine.slot_runner import SlotModelRunner
from miaohui.generation.executors.base import NumpyLogits, SlotCausalLMEngine, StepLogits
from miaohui.generation.models.dims import DecoderDims

VOCAB = 50
DIMS = DecoderDims(
    num_layers=1, hidden=4, num_heads=1, num_kv_heads=1, head_dim=4, intermediate=8, vocab=VOCAB,
    rope_theta=1e4, rms_eps=1e-6, max_positions=64,
)  # fmt: skip


class CountingEngine(SlotCausalLMEngine):
    """Next token = (last token + 1) % VOCAB, computed from what each *slot* holds (so a slot mix-up shows)."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(DIMS, [0], 0, num_slots, 64)
        self.last = np.zeros(num_slots, dtype=np.int64)
        self.calls: list[tuple[str, list[int]]] = []

    def _logits(self, slots: list[int]) -> StepLogits:
        out = np.zeros((len(slots), VOCAB), dtype=np.float32)
        for r, s in enumerate(slots):
            out[r, (self.last[s] + 1) % VOCAB] = 1.0
        return NumpyLogits(out)

    def _prefill(self, slots: list[int], prompts: list[list[int]]) -> StepLogits:
        self.calls.append(("prefill", list(slots)))
        for s, p in zip(slots, prompts, strict=True):
            self.last[s] = p[-1]
        return self._logits(slots)

    def _decode(self, slots: list[int], tokens: list[int], positions: np.ndarray) -> StepLogits:
        self.calls.append(("decode", list(slots)))
        for s, t in zip(slots, tokens, strict=True):
            self.last[s] = t
        return self._logits(slots)


GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_each_sequence_keeps_its_slot_and_freed_slots_are_reused_lowest_first() -> None:
    engine = CountingEngine(num_slots=2)
    llm = LLMEngine(engine, None, SchedulerConfig(max_running_seqs=8, max_batched_tokens=64, max_model_len=64))
    assert llm.config.max_running_seqs == 2  # capped to the engine's slots
    out = llm.generate([[1], [10], [20, 30]], GREEDY)
    assert [o[0] for o in out] == [[2, 3, 4, 5, 6], [11, 12, 13, 14, 15], [31, 32, 33, 34, 35]]
    prefills = [slots for kind, slots in engine.calls if kind == "prefill"]
    assert prefills[0] == [0, 1] and prefills[1] == [0]  # the third request got slot 0 back
    # finished sequences give their slots back at the next step: a new request starts in slot 0 again
    assert llm.generate([[40]], GREEDY)[0][0] == [41, 42, 43, 44, 45]
    assert [slots for kind, slots in engine.calls if kind == "prefill"][-1] == [0]


def test_sampled_rows_use_host_logits_and_their_seed() -> None:
    engine = CountingEngine(num_slots=4)
    llm = LLMEngine(engine, None)
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([[3], [3]], seeded)
    b = llm.generate([[3]], seeded)
    assert a[0][0] == a[1][0] == b[0][0]


def test_greedy_sequences_make_no_generator() -> None:
    """A generator costs 7-15 µs to make: a greedy request's first token does not wait for one."""
    llm = LLMEngine(CountingEngine(num_slots=4), None)
    runner = llm.runner
    assert isinstance(runner, SlotModelRunner)
    made = []
    runner._rngs = _Recording(made)
    llm.generate([[3], [4]], GREEDY)
    llm.generate([[3]], SamplingParams(max_tokens=2, temperature=1.0, seed=7, ignore_eos=True))
    assert len(made) == 1


class _Recording(dict):  # type: ignore[type-arg]
    """The runner's generators by sequence, recording each one made."""

    def __init__(self, made: list[int]) -> None:
        super().__init__()
        self.made = made

    def __setitem__(self, key, value):  # type: ignore[no-untyped-def]
        self.made.append(key)
        super().__setitem__(key, value)


def test_bad_slot_calls_are_input_errors() -> None:
    engine = CountingEngine(num_slots=2)
    with pytest.raises(InputError, match="prefill the slot first"):
        engine.decode([0], [1])
    with pytest.raises(InputError, match="distinct"):
        engine.prefill([1, 1], [[1], [2]])
    with pytest.raises(InputError, match="slots hold 64"):
        engine.prefill([0], [list(range(1, 40)) * 2])
    with pytest.raises(InputError, match="token ids"):
        engine.prefill([0], [[VOCAB + 3]])
    with pytest.raises(InputError, match="token ids"):  # a prefix hit's rest is checked
        engine.prefill([0], [[1, 2, VOCAB + 3]], starts=[1])
    with pytest.raises(NotImplementedError):  # its cached prefix is not (equal to a prompt checked before)
        engine.prefill([0], [[VOCAB + 3, 2, 3]], starts=[1])
    with pytest.raises(InputError, match="needs every token"):
        engine.prefill([0], [[1]])
        engine.decode([0], [None])


class ChainingEngine(CountingEngine):
    """A :class:`CountingEngine` that feeds its own greedy picks, as the GPU engine does on the device: a ``None``
    token is the slot's previous pick. Counts the decode calls that were fed that way."""

    feeds_tokens = True

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.picked = np.zeros(num_slots, dtype=np.int64)
        self.fed = 0

    def _logits(self, slots: list[int]) -> StepLogits:
        for s in slots:
            self.picked[s] = (self.last[s] + 1) % VOCAB
        return super()._logits(slots)

    def _decode(self, slots: list[int], tokens: list[int | None], positions: np.ndarray) -> StepLogits:
        self.fed += any(t is None for t in tokens)
        known = [int(self.picked[s]) if t is None else t for s, t in zip(slots, tokens, strict=True)]
        return super()._decode(slots, known, positions)


class CharDetok:
    """Token id t ↦ one character; the end-of-sequence token 0 has no text."""

    def __init__(self, prompt: object) -> None:
        pass

    def push(self, token_id: int) -> str:
        return "" if token_id == 0 else chr(ord("A") + token_id)

    def flush(self) -> str:
        return ""


async def test_async_scheduling_streams_exactly_what_the_synchronous_loop_streams() -> None:
    """Async scheduling (step N+1 launched before step N is collected, its tokens fed by the engine) against the
    synchronous loop on the same requests: end-of-sequence one step before the next was scheduled (its extra token
    dropped), max_tokens, a stop string, more requests than slots (slots reused while a step is in flight) and a
    sampled request (the loop falls back to collect-then-schedule while it runs). Same events, token for token."""
    prompts = [[45], [3], [10], [20], [30], [1], [5]]
    params = [
        SamplingParams(max_tokens=9, temperature=0.0),  # 46..49, then 0 = end-of-sequence
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.0, stop=("OP",)),  # 11 12 13 14 15 = L M N O P: cut
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=7, temperature=0.0),
        SamplingParams(max_tokens=5, temperature=1.0, seed=3),
        SamplingParams(max_tokens=8, temperature=0.0),
    ]
    from miaohui.generation.engine.engine_loop import AsyncLLMEngine
    from miaohui.generation.engine.scheduler import Scheduler

    runs, fed = [], []
    for chained in (False, True):
        engine = ChainingEngine(num_slots=3)
        llm = LLMEngine(engine, None, SchedulerConfig(max_running_seqs=3, max_batched_tokens=64, max_model_len=64))
        llm.scheduler = Scheduler(llm.config, engine.eos_token_ids, CharDetok)
        async with AsyncLLMEngine(llm, async_scheduling=chained) as loop:
            assert loop.async_scheduling is chained
            streams = [loop.add(p, sp) for p, sp in zip(prompts, params, strict=True)]
            runs.append([[(e.token_id, e.text, e.finish_reason) async for e in st] for st in streams])
            assert (loop.num_running, loop.num_waiting) == (0, 0)
        fed.append(engine.fed)
    assert runs[0] == runs[1]
    assert fed[0] == 0 and fed[1] >= 5  # the synchronous loop always passes tokens; the chained one mostly not
    assert [r[-1][2] for r in runs[0]] == ["stop", "length", "stop", "length", "length", "length", "length"]
    assert [t for t, _, _ in runs[0][0]] == [46, 47, 48, 49, 0]
    assert "".join(x for _, x, _ in runs[0][2]) == "LMN"


async def test_async_scheduling_cancel_frees_the_slot_while_a_step_is_in_flight() -> None:
    """An abort under async scheduling (the next step is usually already launched with the sequence in it): its
    token from that step is dropped, its slot goes back to the pool at the next launch, and the request waiting for
    the only slot then runs with the right tokens — the slot's stale device pick is not fed to it."""
    from miaohui.generation.engine.engine_loop import AsyncLLMEngine

    engine = ChainingEngine(num_slots=1)
    llm = LLMEngine(engine, None, SchedulerConfig(max_running_seqs=1, max_batched_tokens=64, max_model_len=64))
    async with AsyncLLMEngine(llm, async_scheduling=True) as loop:
        long = loop.add([1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        queued = loop.add([20], SamplingParams(max_tokens=4, temperature=0.0))
        got = []
        async for ev in long:
            got.append(ev.token_id)
            if len(got) == 3:
                break
        await long.aclose()
        assert got == [2, 3, 4]
        events = [ev async for ev in queued]
        assert [e.token_id for e in events] == [21, 22, 23, 24] and events[-1].finish_reason == "length"
        assert (loop.num_running, loop.num_waiting) == (0, 0)
    assert engine.fed > 0 and [slots for kind, slots in engine.calls if kind == "prefill"][-2:] == [[0], [0]]
