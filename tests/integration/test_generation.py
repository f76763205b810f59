"""Real SmolLM2-135M-Instruct on the CPU: the exported ONNX decoder against HF ``generate``, batching,
sampling, stop conditions and the async streaming engine.

The converted fp32 model is cached between runs under var/test-cache (keyed by the GGUF's digest); the
ONNX export (~15 s + check) and the int8 copy are made once per test session under a temp dir.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.artifacts import scratch_dir
from tests.integration.conftest import hf_greedy_tokens

from miaohui.errors import InputError
from miaohui.generation.build.export import (
    DecoderMeta,
    export_decoder,
    load_meta,
    quantize_decoder,
    quantize_decoder_int4,
)
from miaohui.generation.engine.client import TokenEvent
from miaohui.generation.engine.detok import IncrementalDetokenizer, is_byte_level
from miaohui.generation.engine.engine_loop import AsyncLLMEngine, GenerationObserver, LLMEngine
from miaohui.generation.engine.observer import StepReport
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig, SequenceUpdate
from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = ROOT / "var" / "test-cache" / "smollm2-135m"
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain what a bank deposit is in two sentences.",
    "List three fruits and describe each one briefly.",
    "Hi",
]
# int8 floor: int8 weight-only agrees with fp32 on 97% of teacher-forced greedy steps here (free-running,
# 67% of positions: one prompt diverges at its first token, a near-tie, and then differs everywhere). A
# broken quantization (e.g. per-tensor dynamic activations, which this model's outlier channels ruin)
# gets the first token wrong. 0.7 catches a broken graph without flaking on a near-tie or two.
INT8_TEACHER_FORCED_FLOOR = 0.7


@pytest.fixture(scope="session")
def prompts(smollm: tuple[Any, Any]) -> list[list[int]]:
    from miaohui.zoo.smollm import encode_chat

    return [encode_chat([{"role": "user", "content": q}], tokenizer=smollm[1]) for q in QUESTIONS]


@pytest.fixture(scope="session")
def decoder_dirs(smollm: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    with scratch_dir(tmp_path_factory, "decoders") as root:
        export_decoder(smollm[0], smollm[1], root / "fp32")
        quantize_decoder(root / "fp32", root / "int8")
        quantize_decoder_int4(root / "fp32", root / "int4")
        yield {"fp32": root / "fp32", "int8": root / "int8", "int4": root / "int4"}


@pytest.fixture(scope="session")
def ort_fp32(decoder_dirs: dict[str, Path]) -> OrtCausalLMEngine:
    return OrtCausalLMEngine(decoder_dirs["fp32"])


@pytest.fixture(scope="session")
def hf_greedy(smollm: tuple[Any, Any], prompts: list[list[int]]) -> list[list[int]]:
    """HF ``generate(do_sample=False)`` tokens for the first three prompts (the reference)."""
    return hf_greedy_tokens(smollm[0], prompts[:3], NEW_TOKENS)


def _tokens(llm: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate([prompt], params)[0][0]


def test_incremental_detokenizer_handles_multibyte_and_bpe() -> None:
    from transformers import AutoTokenizer

    from miaohui.zoo.smollm import smollm_gguf_path

    gguf = smollm_gguf_path()  # the tokenizer alone, straight from the GGUF (no model conversion: fast)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True).backend_tokenizer
    text = "Café 秒回 — naïve 🚀 résumé, 12345 wörds!\nNew line."
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, prompt_ids=[1, 520, 9531, 198])
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids) == text
    assert "" in deltas  # some token held an incomplete character back
    assert all("\ufffd" not in d for d in deltas)


def _plain_deltas(tok: Any, prompt: list[int], ids: list[int], skip: bool) -> list[str]:
    """The textbook incremental detokenizer (TGI/vLLM: decode ``[prefix, read)`` and ``[prefix, end)`` for every
    token), the oracle for :class:`IncrementalDetokenizer`'s cached and byte-level fast paths."""
    window, prefix, deltas = list(prompt[-4:]), 0, []
    read = len(window)
    for t in ids:
        window.append(t)
        old = tok.decode(window[prefix:read], skip_special_tokens=skip)
        new = tok.decode(window[prefix:], skip_special_tokens=skip)
        if len(new) > len(old) and not new.endswith("\ufffd"):
            deltas.append(new[len(old) :])
            prefix, read = read, len(window)
        else:
            deltas.append("")
    old = tok.decode(window[prefix:read], skip_special_tokens=skip)
    new = tok.decode(window[prefix:], skip_special_tokens=skip)
    deltas.append(new[len(old) :] if len(new) > len(old) else "")
    return deltas


def test_incremental_detokenizer_fast_paths_equal_the_plain_algorithm(smollm: tuple[Any, Any]) -> None:
    """Every delta equal to the plain algorithm's on 600 streams of SmolLM2's byte-level tokenizer: real text,
    random ids, byte tokens that split characters, special tokens; both ``skip_special_tokens`` settings; one
    shared token-text cache per setting, as the engine's factory shares it."""
    import random

    tok = smollm[1].backend_tokenizer
    assert is_byte_level(tok)
    rng = random.Random(7)
    vocab = tok.get_vocab_size()
    text = "Café 秒回 — naïve 🚀 résumé 今天天气很好，投资有风险，入市需谨慎。 def f(x):\n    return x**2 👨‍👩‍👧"
    corpus = tok.encode(text * 3, add_special_tokens=False).ids
    specials = list(tok.get_added_tokens_decoder())
    partial = [i for i in range(vocab) if "\ufffd" in tok.decode([i])][:2000]  # pieces of multi-byte characters
    assert partial and specials
    for skip in (True, False):
        cache: dict[int, str] = {}
        for trial in range(300):
            start = rng.randrange(len(corpus))
            ids = {
                0: corpus[start : start + rng.randrange(1, 80)],
                1: [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))],
                2: [rng.choice(partial + corpus) for _ in range(rng.randrange(1, 40))],
            }[trial % 3]
            ids = [rng.choice(specials) if rng.random() < 0.05 else t for t in ids]
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
            detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, token_texts=cache)
            got = [detok.push(t) for t in ids] + [detok.flush()]
            assert got == _plain_deltas(tok, prompt, ids, skip), (skip, prompt, ids)


@pytest.mark.slow
def test_export_is_checked_against_torch_and_hf(decoder_dirs: dict[str, Path]) -> None:
    meta = load_meta(decoder_dirs["fp32"])
    print(f"\nexport {meta.export_seconds}s, errors {meta.check}")
    assert meta.precision == "fp32" and meta.dims["num_layers"] == 30
    assert meta.input_names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert meta.input_names[3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert meta.output_names[:2] == ["logits", "present.0.key"]
    assert max(meta.check.values()) < 2e-3
    int8: DecoderMeta = load_meta(decoder_dirs["int8"])
    assert int8.precision == "int8" and int8.int8_method == "weight-only"


@pytest.mark.slow
def test_ort_fp32_greedy_is_identical_to_hf_generate(
    ort_fp32: OrtCausalLMEngine, smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    llm = LLMEngine(ort_fp32, smollm[1].backend_tokenizer)
    for prompt, ref in zip(prompts[:3], hf_greedy, strict=True):
        assert len(ref) >= 16
        assert _tokens(llm, prompt) == ref


@pytest.mark.slow
def test_batched_decode_matches_each_alone(ort_fp32: OrtCausalLMEngine, prompts: list[list[int]]) -> None:
    three = [prompts[0], prompts[1], prompts[3]]
    assert len({len(p) for p in three}) == 3  # different lengths: left padding is exercised
    llm = LLMEngine(ort_fp32, None)
    alone = [_tokens(llm, p) for p in three]
    together = [r[0] for r in llm.generate(three, GREEDY)]
    assert together == alone
    # staggered: the others join while the first is decoding (KV rows padded and merged mid-flight)
    first = llm.add_request(three[0], GREEDY)
    got: dict[int, list[int]] = {first: []}
    for step in range(6):
        if step == 3:
            got.update({llm.add_request(p, GREEDY): [] for p in three[1:]})
        for up in _updates(llm):
            got[up.seq_id].append(up.token_id or 0)
    while llm.scheduler.has_work():
        for up in _updates(llm):
            got[up.seq_id].append(up.token_id or 0)
    assert list(got.values()) == alone


@pytest.mark.slow
def test_int8_agreement_with_fp32(
    decoder_dirs: dict[str, Path], ort_fp32: OrtCausalLMEngine, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    int8 = OrtCausalLMEngine(decoder_dirs["int8"])
    free_run = [_tokens(LLMEngine(int8, None), p) for p in prompts[:3]]
    same = sum(a == b for ref, got in zip(hf_greedy, free_run, strict=True) for a, b in zip(ref, got, strict=False))
    free_frac = same / sum(len(r) for r in hf_greedy)
    # teacher-forced: feed the fp32 tokens, compare each step's argmax (no divergence cascade)
    agree = total = 0
    for prompt, ref in zip(prompts[:3], hf_greedy, strict=True):
        logits, kv = int8.prefill([prompt])
        for tok in ref:
            agree += int(int(np.argmax(logits[0])) == tok)
            total += 1
            logits, kv = int8.decode([tok], kv)
    forced = agree / total
    print(f"\nint8 (weight-only) vs fp32: free-running identical tokens {free_frac:.1%}, teacher-forced {forced:.1%}")
    assert forced >= INT8_TEACHER_FORCED_FLOOR


@pytest.mark.slow
def test_int4_greedy_is_identical_to_hf_generate(
    decoder_dirs: dict[str, Path], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    """The shipped SmolLM2 is a Q4_1 GGUF converted to fp32: its weights lie on the 4-bit grid ``int4`` stores, and
    ``int4`` multiplies in fp32 (the head's largest logits too), so its greedy tokens are HF's (llama.cpp's Q4_1,
    which rounds activations, are not). The logits below the head's top carry int8-rounded activations."""
    meta = load_meta(decoder_dirs["int4"])
    assert meta.precision == "int4" and meta.check["top1_agrees"] == 1.0
    assert meta.check["top_logits_vs_fp32"] < 1e-3 < meta.check["logits_vs_fp32"] < 1.0
    import onnx

    graph = onnx.load(str(decoder_dirs["int4"] / "model.onnx"), load_external_data=False).graph
    assert [n.op_type for n in graph.node][-1] == "If"  # one-row steps: the 4-bit branch; the others: fp32
    int4 = OrtCausalLMEngine(decoder_dirs["int4"])
    llm = LLMEngine(int4, None)
    assert [_tokens(llm, p) for p in prompts[:3]] == hf_greedy
    three = [prompts[0], prompts[1], prompts[3]]  # a padded batch through the 4-bit kernels' batched path
    assert [r[0] for r in llm.generate(three, GREEDY)] == [_tokens(llm, p) for p in three]


@pytest.mark.slow
def test_int4_runs_its_fused_graph_only_for_an_unpadded_row(
    decoder_dirs: dict[str, Path], prompts: list[list[int]]
) -> None:
    """int4's one-row steps run the fused graph (GroupQueryAttention: positions from lengths), which is right only
    for a cache without padding. A lone row whose cache holds padding (here: kept from a padded batch) must run the
    fp32 graph, so its logits are exactly fp32's; an unpadded row's are the 4-bit head's (the int8 tail differs)."""
    from miaohui.generation.executors.base import KVCache

    assert load_meta(decoder_dirs["int4"]).one_row_graph == "fused"
    int4, fp32 = OrtCausalLMEngine(decoder_dirs["int4"]), OrtCausalLMEngine(decoder_dirs["fp32"])
    batch = [prompts[0], prompts[1][:3]]  # the second row is left-padded in the batch's cache
    (_, kv_a), (b, kv_b) = int4.prefill(batch), fp32.prefill(batch)
    token = int(b[1].argmax())

    def padded_row(kv: KVCache) -> KVCache:
        return KVCache(tuple(k[1:2] for k in kv.keys), tuple(v[1:2] for v in kv.values), kv.mask[1:2])

    assert padded_row(kv_a).mask.min() == 0
    (a, _), (b, _) = int4.decode([token], padded_row(kv_a)), fp32.decode([token], padded_row(kv_b))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)  # the fp32 graph: summation order only
    alone = [prompts[1][:3]]
    (_, kv_a), (_, kv_b) = int4.prefill(alone), fp32.prefill(alone)
    assert kv_a.mask.min() == 1
    (a, _), (b, _) = int4.decode([token], kv_a), fp32.decode([token], kv_b)
    assert int(a.argmax()) == int(b.argmax()) and float(np.abs(a - b).max()) > 1e-2  # the fused 4-bit graph


@pytest.mark.slow
def test_int4_top_logprobs_are_the_fp32_heads(decoder_dirs: dict[str, Path], prompts: list[list[int]]) -> None:
    """One-row steps run int4's head: int8 logits with the largest rescored in fp32. The log-probabilities of fp32's
    20 best tokens (what ``top_logprobs`` returns) stay within the e2e tolerance against transformers (2e-3); the
    tail does not (it is the int8 pass's), which is what makes this path the rescored one."""

    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max()
        return x - np.log(np.exp(x).sum())

    int4, fp32 = OrtCausalLMEngine(decoder_dirs["int4"]), OrtCausalLMEngine(decoder_dirs["fp32"])
    (a, kv_a), (b, kv_b) = int4.prefill([prompts[0]]), fp32.prefill([prompts[0]])
    top_err = tail_err = 0.0
    for _ in range(12):
        token = int(b.argmax())
        (a, kv_a), (b, kv_b) = int4.decode([token], kv_a), fp32.decode([token], kv_b)
        la, lb = log_softmax(a[0]), log_softmax(b[0])
        top = np.argsort(-lb)[:20]
        assert int(a.argmax()) == int(b.argmax())
        top_err = max(top_err, float(np.abs(la[top] - lb[top]).max()))
        tail_err = max(tail_err, float(np.abs(la - lb).max()))
    assert top_err < 2e-3 < tail_err


@pytest.mark.slow
def test_stop_sequences_and_max_tokens(
    ort_fp32: OrtCausalLMEngine, smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    tok = smollm[1].backend_tokenizer
    llm = LLMEngine(ort_fp32, tok)
    full = tok.decode(hf_greedy[0], skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    ids, text, reason = llm.generate([prompts[0]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=stop))[0]
    assert reason == "stop" and text == full[: full.index(stop)]
    ids, text, reason = llm.generate([prompts[0]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert reason == "length" and ids == hf_greedy[0][:5] and text == tok.decode(ids, skip_special_tokens=True)
    with pytest.raises(InputError, match="the prompt has no tokens"):
        llm.add_request([], GREEDY)


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(ort_fp32: OrtCausalLMEngine, prompts: list[list[int]]) -> None:
    llm = LLMEngine(ort_fp32, None)
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=s) for s in (7, 7, 8, 9)]
    runs = [_tokens(llm, prompts[2], p) for p in params]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs}) > 1
    # the same seed inside a batch with other requests gives the same tokens
    batch = llm.generate([prompts[0], prompts[2]], params[0])
    assert batch[1][0] == runs[0]


class Recorder(GenerationObserver):
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.finished: list[tuple[int, int, str]] = []
        self.queue: list[tuple[int, int]] = []
        self.steps: list[StepReport] = []

    def on_step(self, step: StepReport) -> None:
        self.steps.append(step)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.append(ttft_s)

    def on_token(self, itl_s: float) -> None:
        self.itl.append(itl_s)

    def on_finish(self, e2e_s: float, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        self.finished.append((prompt_tokens, completion_tokens, reason))

    def on_queue(self, running: int, waiting: int) -> None:
        self.queue.append((running, waiting))


@pytest.mark.slow
async def test_async_engine_streams_and_cancellation_frees_the_slot(
    ort_fp32: OrtCausalLMEngine, smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    tok = smollm[1].backend_tokenizer
    rec = Recorder()
    llm = LLMEngine(ort_fp32, tok, SchedulerConfig(max_running_seqs=1, max_batched_tokens=512))
    async with AsyncLLMEngine(llm, rec) as engine:
        long = engine.add(prompts[0], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
        queued = engine.add(prompts[1], GREEDY)  # waits: only one slot
        # the loop may have scheduled the first request before the second arrived
        assert engine.num_running <= 1 and engine.num_running + engine.num_waiting == 2
        events: list[TokenEvent] = []
        async for ev in long:
            events.append(ev)
            if len(events) == 3:
                break
        await long.aclose()  # the client went away
        assert [e.token_id for e in events] == hf_greedy[0][:3]
        streamed = [ev async for ev in queued]
        assert streamed[-1].finish_reason is not None
        token_ids = [e.token_id for e in streamed if e.token_id is not None]
        assert token_ids == hf_greedy[1]
        assert "".join(e.text for e in streamed) == tok.decode(token_ids, skip_special_tokens=True)
        assert [e.index for e in streamed] == list(range(1, len(streamed) + 1))
        await asyncio.sleep(0)
        assert (engine.num_running, engine.num_waiting) == (0, 0)
        # the async-generator form: closing it aborts too
        gen = engine.generate(prompts[3], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        first = await gen.__anext__()
        assert first.index == 1
        await gen.aclose()
        assert (engine.num_running, engine.num_waiting) == (0, 0)
    reasons = [r for _, _, r in rec.finished]
    assert reasons.count("abort") == 2 and reasons.count("stop") + reasons.count("length") == 1
    assert len(rec.ttft) == 3 and all(t > 0 for t in rec.ttft) and rec.itl
    # every step says where its time went: three prompts prefilled, model time within the step's time
    assert sum(s.prefill_seqs for s in rec.steps) == 3
    assert all(0 <= s.decode_s + s.prefill_s <= s.step_s for s in rec.steps)
    loops = [s.loop_s for s in rec.steps if s.loop_s is not None]
    assert loops and all(x >= 0 for x in loops)


@pytest.mark.slow
def test_torch_engine_matches_hf(smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]) -> None:
    from miaohui.generation.executors.torch_engine import TorchCausalLMEngine

    llm = LLMEngine(TorchCausalLMEngine(smollm[0], smollm[1]), None)
    assert _tokens(llm, prompts[1]) == hf_greedy[1]


def test_missing_decoder_dir_is_a_clear_error(tmp_path: Path) -> None:
    from miaohui.errors import ArtifactError

    with pytest.raises(ArtifactError, match="cannot read decoder metadata"):
        OrtCausalLMEngine(tmp_path)


def _updates(llm: LLMEngine) -> list[SequenceUpdate]:
    """One synchronous step's updates (none when nothing was scheduled)."""
    out = llm.step()
    return out.updates if out is not None else []
