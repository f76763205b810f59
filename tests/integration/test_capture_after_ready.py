"""Graphs captured after ready (``SlotEngineOptions.capture_after_ready``), the parts that run on a CPU: which buckets
a serve captures before ready, and that a bucket's warm run between served steps (what the capture thread does on a
GPU, one bucket at a time under the step lock) leaves the sequences being served as they were — the same greedy tokens
as HF ``generate``, with static prefill and mixed steps on. The capture itself is covered by tests/gpu."""

from __future__ import annotations

from typing import Any

import pytest
from tests.integration.conftest import hf_greedy_tokens

from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.static_kv import StaticKVDecoder

NEW_TOKENS = 12
QUESTIONS = ["Write a short poem about the sea.", "Explain what a bank deposit is.", "Name three fruits."]


def test_the_buckets_before_ready_are_the_small_decode_and_prefill_ones() -> None:
    opts = SlotEngineOptions()  # 64 slots x 2048: 35 decode, 32 prefill, 21 mixed buckets
    batch, length = opts.buckets()
    pb, pl = opts.prefill_buckets()
    decode = [(b, t) for b in batch for t in length if opts.before_ready("decode", b, t)]
    prefill = [(n, s) for n in pb for s in pl if opts.before_ready("prefill", n, n * s)]
    assert decode == [(b, t) for b in (1, 2, 4) for t in (128, 256, 512)]
    assert len(prefill) == 15 and max(n * s for n, s in prefill) == 512
    assert not any(opts.before_ready("mixed", b, p) for b in batch for p in opts.mixed_prefill_tokens)
    assert opts.model_copy(update={"ready_rows": 64, "ready_tokens": 2048}).before_ready("decode", 64, 2048)


def test_a_cpu_engine_defers_nothing(smollm: tuple[Any, Any]) -> None:
    dec = StaticKVDecoder.from_hf(smollm[0], num_slots=2, max_len=64)
    engine = TorchSlotEngine(dec, [smollm[1].eos_token_id], 0, SlotEngineOptions(num_slots=2, max_len=64, dtype="fp32"))
    engine.warmup(defer=True)
    assert not engine.defers_capture and engine.pending_graphs == 0 and engine.capture_deferred() is None
    engine.close()


@pytest.mark.parametrize("mixed", [(), (64, 128)], ids=["prefill", "mixed"])
def test_warm_runs_between_served_steps_leave_the_greedy_tokens(
    smollm: tuple[Any, Any], mixed: tuple[int, ...]
) -> None:
    from miaohui.zoo.smollm import encode_chat

    model, tok = smollm
    prompts = [encode_chat([{"role": "user", "content": q}], tokenizer=tok) for q in QUESTIONS]
    want = hf_greedy_tokens(model, prompts, NEW_TOKENS)
    opts = SlotEngineOptions(
        num_slots=4, max_len=256, dtype="fp32", static_prefill=True, prefill_batch_buckets=(1, 2, 4),
        mixed_prefill_tokens=mixed, mixed_prefill_prompts=2,
    )  # fmt: skip
    engine = TorchSlotEngine(StaticKVDecoder.from_hf(model, num_slots=4, max_len=256), [tok.eos_token_id], 0, opts)
    batch, length = opts.buckets()
    pb, pl = opts.prefill_buckets()
    buckets: list[tuple[Any, tuple[int, ...]]] = [("decode", (b, t)) for b in batch for t in length]
    buckets += [("prefill", (n, s)) for n in pb for s in pl[:3]]
    buckets += [("mixed", (b, p, opts.max_len)) for b in batch for p in mixed]
    runs = {"n": 0}
    real = engine._decode

    def decode(*args: Any) -> Any:  # before every served decode step, the next bucket's isolated warm run
        kind, key = buckets[runs["n"] % len(buckets)]
        with engine._step_lock:
            engine._isolated_warm_run(kind, engine._step_for(kind, key))
        runs["n"] += 1
        return real(*args)

    engine._decode = decode  # type: ignore[method-assign]
    sched = SchedulerConfig(max_running_seqs=4, max_batched_tokens=512, max_model_len=256)
    got = LLMEngine(engine, None, sched).generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert runs["n"] >= NEW_TOKENS - 1
    assert [g[0] for g in got] == want
    engine.close()
