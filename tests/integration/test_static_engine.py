"""The GPU generation engine's code path on the CPU with the real SmolLM2-135M-Instruct: the static-KV
decoder (eager, no CUDA graphs here) against HF ``generate``, slot reuse, seeded sampling, the
``inductor`` causal-LM artifact (build → load, corrupt files), and that artifact served by the real
server to the real ``openai`` client. Compile + CUDA graphs are covered by tests/gpu on the H200.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from tests.artifacts import scratch_dir
from tests.integration.conftest import SMOLLM_CACHE as MODEL_CACHE
from tests.integration.conftest import hf_greedy_tokens
from tests.servers import UvicornThread

from miaohui.errors import ArtifactError, ConfigError
from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.static_kv import StaticKVDecoder

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain what a bank deposit is in two sentences.",
    "List three fruits and describe each one briefly.",
]


@pytest.fixture(scope="module")
def prompts(smollm: tuple[Any, Any]) -> list[list[int]]:
    from miaohui.zoo.smollm import encode_chat

    return [encode_chat([{"role": "user", "content": q}], tokenizer=smollm[1]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(smollm: tuple[Any, Any], prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy_tokens(smollm[0], prompts, NEW_TOKENS)


def _engine(smollm: tuple[Any, Any], slots: int, mixed: tuple[int, ...] | None = None) -> TorchSlotEngine:
    """Default options (mixed steps on), or ``mixed`` token buckets (``()``: off)."""
    dec = StaticKVDecoder.from_hf(smollm[0], num_slots=slots, max_len=256)
    extra = {} if mixed is None else {"mixed_prefill_tokens": mixed}
    return TorchSlotEngine(
        dec, [smollm[1].eos_token_id], 0, SlotEngineOptions(num_slots=slots, max_len=256, dtype="fp32", **extra)
    )


def test_static_kv_greedy_is_identical_to_hf_generate(
    smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    engine = _engine(smollm, slots=4)
    assert not engine.compiled and not engine.graphs_on  # CPU: eager
    got = LLMEngine(engine, None).generate(prompts, GREEDY)
    assert [g[0] for g in got] == hf_greedy


def test_more_requests_than_slots_reuse_freed_slots(
    smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    engine = _engine(smollm, slots=2)
    sched = SchedulerConfig(max_running_seqs=2, max_batched_tokens=512, max_model_len=256)
    got = LLMEngine(engine, None, sched).generate(prompts * 2, GREEDY)
    assert [g[0] for g in got] == hf_greedy * 2


async def test_async_scheduling_streams_hf_greedy_tokens_and_text(
    smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    """Async scheduling (opt-in for the GPU engine; here on the CPU): each step is launched before the previous one is
    collected and its tokens are the engine's own greedy picks (``_picked``, fed inside the step) — the same tokens
    as HF, the text the tokenizer decodes, with slots reused while a step is in flight (2 slots, 3 prompts)."""
    tok = smollm[1].backend_tokenizer
    sched = SchedulerConfig(max_running_seqs=2, max_batched_tokens=512, max_model_len=256)
    engine = _engine(smollm, slots=2)
    llm = LLMEngine(engine, tok, sched)
    assert llm.runner.chains and not engine.runs_async  # on a CPU the step computes inside launch
    fed: list[int] = []
    real = engine._decode

    def decode(slots: list[int], tokens: list[int | None], positions: Any) -> Any:
        fed.append(sum(t is None for t in tokens))
        return real(slots, tokens, positions)

    engine._decode = decode  # type: ignore[method-assign]
    async with AsyncLLMEngine(llm, async_scheduling=True) as loop:
        streams = [loop.add(p, GREEDY) for p in prompts]
        events = [[e async for e in st] for st in streams]
    ids = [[e.token_id for e in ev if e.token_id is not None] for ev in events]
    assert ids == hf_greedy
    assert sum(fed) > len(fed)  # most decode rows took the device's pick
    for ev, want in zip(events, hf_greedy, strict=True):
        assert "".join(e.text for e in ev) == tok.decode(want, skip_special_tokens=True)


def _recording_prefill(engine: TorchSlotEngine) -> list[tuple[int, ...]]:
    """Record the token-id shape of every prefill the engine runs (the real prefill still runs)."""
    shapes: list[tuple[int, ...]] = []
    real = engine._prefill_fn

    def prefill(tokens: Any, lengths: Any, slots: Any) -> Any:
        shapes.append(tuple(tokens.shape))
        return real(tokens, lengths, slots)

    engine._prefill_fn = prefill
    return shapes


@pytest.mark.parametrize("slots", [4, 3])
def test_static_prefill_pads_to_buckets_and_keeps_hf_tokens(
    smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]], slots: int
) -> None:
    """The GPU engine's static (CUDA-graph) prefill path, run eagerly: three prompts are padded to the
    4-prompt bucket and a length bucket, the padding row repeating the first prompt into its own slot — and the
    tokens stay HF's. With 3 slots for 3 prompts (none free) too: a padding row that needed a free slot would make
    that prefill run unpadded and eagerly (on the GPU: no graph)."""
    dec = StaticKVDecoder.from_hf(smollm[0], num_slots=slots, max_len=256)
    options = SlotEngineOptions(num_slots=slots, max_len=256, dtype="fp32", static_prefill=True)
    engine = TorchSlotEngine(dec, [smollm[1].eos_token_id], 0, options)
    assert engine.prefill_batches == (1, 2, 4, 8) and engine.prefill_lengths == (16, 32, 64, 128, 256)
    shapes = _recording_prefill(engine)
    got = LLMEngine(engine, None).generate(prompts, GREEDY)
    assert [g[0] for g in got] == hf_greedy
    width = max(map(len, prompts))
    assert shapes == [(4, next(b for b in engine.prefill_lengths if b >= width))]


def test_prefills_are_capped_at_the_largest_static_bucket() -> None:
    """With static prefill the engine tells the scheduler how many prompts one prefill takes at full speed (its
    largest prefill bucket): ten prompts at once are prefilled 8 + 2 over two steps, both through the static path,
    instead of one eager prefill of 10; a scheduler that names its own ``max_prefill_seqs`` keeps it."""
    from tests.tiny_llm import tiny_qwen

    hf = tiny_qwen()
    dec = StaticKVDecoder.from_hf(hf, num_slots=16, max_len=256)
    options = SlotEngineOptions(num_slots=16, max_len=256, dtype="fp32", static_prefill=True, mixed_prefill_tokens=())
    engine = TorchSlotEngine(dec, [999], 0, options)
    assert engine.max_prefill_prompts == 8
    shapes = _recording_prefill(engine)
    prompts = [list(range(10 + i, 30 + i)) for i in range(10)]
    llm = LLMEngine(engine, None)
    assert llm.config.max_prefill_seqs == 8
    got = llm.generate(prompts, GREEDY.model_copy(update={"max_tokens": 3}))
    assert [s[0] for s in shapes] == [8, 2]
    unpadded = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=16, max_len=256), [999], 0,
                               SlotEngineOptions(num_slots=16, max_len=256, dtype="fp32", mixed_prefill_tokens=()))  # fmt: skip
    assert unpadded.max_prefill_prompts is None
    assert [g[0] for g in got] == [w[0] for w in LLMEngine(unpadded, None).generate(prompts, GREEDY.model_copy(
        update={"max_tokens": 3}))]  # fmt: skip
    assert engine.eager_prefills == 0
    own = LLMEngine(engine, None, SchedulerConfig(max_prefill_seqs=16))
    assert own.config.max_prefill_seqs == 16
    shapes.clear()
    own.generate(prompts, GREEDY.model_copy(update={"max_tokens": 2}))
    assert [s[0] for s in shapes] == [10] and engine.eager_prefills == 1  # past the buckets: the eager path


def test_bf16_prefill_logits_are_as_close_to_fp32_as_hf_bf16() -> None:
    """The CPU twin of tests/gpu's bf16 check, on a tiny Qwen2 (QKV bias, GQA, tied embeddings): bf16 weights
    and cache move the last-token logits about as far from HF fp32 as HF's own bf16 model does."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        vocab_size=1000, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    hf = Qwen2ForCausalLM(cfg).eval()
    prompt = list(range(30, 90))
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        hf_bf16 = Qwen2ForCausalLM(cfg).eval()
        hf_bf16.load_state_dict(hf.state_dict())
        hf_err = float((hf_bf16.to(torch.bfloat16)(torch.tensor([prompt])).logits[0, -1].float() - ref).norm())
    dec = StaticKVDecoder.from_hf(hf, num_slots=4, max_len=256, dtype=torch.bfloat16)
    engine = TorchSlotEngine(dec, [999], 0, SlotEngineOptions(num_slots=4, max_len=256, dtype="bf16", device="cpu"))
    row = torch.as_tensor(engine.prefill([2], [prompt]).rows([0])[0])
    err = float((row - ref).norm())
    assert err < 2 * hf_err, (
        f"relative logit error {err / float(ref.norm()):.4f}, HF bf16 {hf_err / float(ref.norm()):.4f}"
    )


def test_seeded_sampling_is_reproducible(smollm: tuple[Any, Any], prompts: list[list[int]]) -> None:
    engine = _engine(smollm, slots=4)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True)
    llm = LLMEngine(engine, None)
    a = llm.generate([prompts[0], prompts[1]], params)
    b = llm.generate([prompts[0]], params)
    assert a[0][0] == b[0][0]
    assert len(a[0][0]) == 12


@pytest.fixture(scope="module")
def static_repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from miaohui.generation.build.artifact import build_causal_lm

    with scratch_dir(tmp_path_factory, "static-repo") as repo:
        build_causal_lm(repo, "smol", "fp32", backend="inductor", source_cache=MODEL_CACHE)
        yield repo


def test_inductor_artifact_loads_and_matches(
    static_repo: Path, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    from miaohui.generation.build.artifact import build_causal_lm, read_info
    from miaohui.generation.build.static_artifact import load_slot_engine, read_static_meta

    version = static_repo / "smol" / "1"
    info, meta = read_info(version), read_static_meta(version)
    assert (info.backend, info.precision) == ("inductor", "fp32")
    assert meta.check_max_abs_error < 2e-3
    engine = load_slot_engine(version, SlotEngineOptions(num_slots=4, max_len=256, dtype="fp32"))
    assert [g[0] for g in LLMEngine(engine, None).generate(prompts, GREEDY)] == hf_greedy
    # close frees the KV cache at once, whoever still holds the engine (a stopped server's cycles)
    engine.close()
    engine.close()  # idempotent
    model = engine.model
    assert all(t.untyped_storage().nbytes() == 0 for t in (*model.k_cache, *model.v_cache))
    assert all(t.untyped_storage().nbytes() > 0 for t in model.parameters())  # weights: left to the collector
    # same build key ⇒ reused, not rebuilt
    assert build_causal_lm(static_repo, "smol", "fp32", backend="inductor", source_cache=MODEL_CACHE) == version


def test_bad_precision_and_corrupt_weights_are_clear_errors(static_repo: Path, tmp_path: Path) -> None:
    import shutil

    from miaohui.generation.build.artifact import build_causal_lm
    from miaohui.generation.build.static_artifact import WEIGHTS_NAME, load_slot_engine

    with pytest.raises(ConfigError, match="use one of"):
        build_causal_lm(tmp_path, "x", "int8", backend="inductor", source_cache=MODEL_CACHE)
    with pytest.raises(ConfigError, match="use one of"):
        build_causal_lm(tmp_path, "x", "bf16", backend="onnxruntime", source_cache=MODEL_CACHE)
    broken = tmp_path / "broken"
    shutil.copytree(static_repo / "smol" / "1", broken)
    weights = broken / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    with pytest.raises(ArtifactError, match="rebuild"):
        load_slot_engine(broken)


def test_validate_gates_int8_at_batch_1_and_stamps_the_version(static_repo: Path, tmp_path: Path) -> None:
    """``miaohui validate``'s decoder gate on the inductor SmolLM2 (fp32, eager on the CPU) runs a second time with
    the engine's int8 batch-1 weights (the int8 kernels' torch form here) and stores the result as causal_lm.json's
    ``validation.int8_batch1``, which serve's defaults read. Three of the gate's prompts (one factual), 16 tokens:
    the CPU's seconds; the whole set is ``miaohui validate smol``."""
    import shutil

    from miaohui.generation.build.artifact import read_info
    from miaohui.generation.build.static_artifact import WEIGHTS_NAME
    from miaohui.generation.executors.slot_defaults import int8_gate_passed
    from miaohui.validate.decoder_gate import (
        DecoderGateConfig,
        _run_int8_batch1,
        int8_summary,
        load_prompts,
        run_decoder_gate,
    )

    version = static_repo / "smol" / "1"
    prompts = [p for p in load_prompts() if p.id in ("en-deposit", "zh-card", "en-france")]
    report = run_decoder_gate(version, DecoderGateConfig(new_tokens=16), prompts)
    assert report.passed and report.exact_match == 1.0  # fp32 static-KV against fp32 HF: the same tokens
    stored = read_info(version).validation
    assert stored is not None and report.int8_batch1 is not None
    int8 = stored["int8_batch1"]
    assert int8 == report.int8_batch1.model_dump(mode="json") and isinstance(int8["passed"], bool)
    f = int8["figures"]
    assert (f["min_exact_match"], f["min_teacher_forced"], f["min_factual"], f["new_tokens"]) == (0.5, 0.95, 1.0, 16)
    assert f["engine"] == "int8 batch-1 weights, gemv_layer kernels, cpu, 1 slot(s)"
    assert 0.0 <= f["exact_match"] <= 1.0 and f["teacher_forced"] >= 0.8  # int8 of a real model stays near it
    assert int8["passed"] == (f["exact_match"] >= 0.5 and f["teacher_forced"] >= 0.95 and f["factual"] in (None, 1.0))
    assert int8_gate_passed(stored) is int8["passed"]  # what serve reads
    print(int8_summary(report.int8_batch1))
    assert ("passed: serve turns" if int8["passed"] else "failed: serve keeps") in int8_summary(report.int8_batch1)

    # a run that cannot run (here: unreadable weights) is stored as failed, with the reason, never as a pass
    broken = tmp_path / "smol" / "1"
    shutil.copytree(version, broken, ignore=shutil.ignore_patterns(WEIGHTS_NAME))
    (broken / WEIGHTS_NAME).write_bytes(b"not safetensors")
    reference = [([1, 2, 3], [4])]  # never reached: the engine does not load
    failed = _run_int8_batch1(broken, read_info(broken), DecoderGateConfig(new_tokens=4), prompts[:1], reference)
    assert not failed.passed and failed.figures is None
    assert failed.failures[0].startswith("the int8 batch-1 run could not run: cannot load the decoder weights")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def server(static_repo: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The real server on the slot engine, with the synchronous loop and with async scheduling."""
    from miaohui.server.metrics import Metrics
    from miaohui.server.observer_metrics import chat_observers
    from miaohui.server.openai_api import create_openai_app
    from miaohui.serving.chat import ChatDefaults
    from miaohui.serving.repository import ModelManager

    metrics = Metrics()
    sched = SchedulerConfig(max_running_seqs=4, max_model_len=256, async_scheduling=request.param)
    service = ModelManager(
        static_repo, chat_observer_factory=chat_observers(metrics), chat_defaults=ChatDefaults(sched)
    )
    with UvicornThread(create_openai_app(service, metrics)) as srv:
        assert service.chat("smol").client.async_scheduling is request.param  # type: ignore[attr-defined]
        yield f"http://127.0.0.1:{srv.port}"


def test_served_by_the_real_server_to_the_openai_client(
    server: str, smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60) as client:
        stream = client.completions.create(
            model="smol", prompt=prompts[0], max_tokens=NEW_TOKENS, temperature=0, stream=True,
        )  # fmt: skip
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == smollm[1].decode(hf_greedy[0], skip_special_tokens=True)
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.completions.create(model="smol", prompt=prompts[0], max_tokens=1000)
        models = [m.id for m in client.models.list().data]
        assert "smol" in models


def test_a_prompt_joining_a_running_stream_runs_mixed(
    server: str, smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    """Through the real server: a request sent while another streams joins it in a mixed step (its prompt as extra
    rows of the running decode step, the default); both answers stay HF's greedy text and ``/metrics`` counts the
    mixed step — or, where its chat template's start is in the prefix cache, a separate prefill from the cached
    prefix (a mixed step starts its prompts at position 0), which ``/metrics`` counts as hit tokens."""
    import httpx

    def counters() -> tuple[float, float]:
        lines = httpx.get(f"{server}/metrics").text.splitlines()
        found = [
            sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name + "{"))
            for name in ("miaohui_mixed_steps_total", "miaohui_prefix_cache_hit_tokens_total")
        ]
        return found[0], found[1]

    before = counters()
    decode = smollm[1].decode
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60) as client:
        chunks = iter(client.completions.create(
            model="smol", prompt=prompts[0], max_tokens=NEW_TOKENS, temperature=0, stream=True,
        ))  # fmt: skip
        first = next(c for c in chunks if c.choices).choices[0].text  # the first request is decoding now
        joined = client.completions.create(model="smol", prompt=prompts[1], max_tokens=NEW_TOKENS, temperature=0)
        rest = "".join(c.choices[0].text for c in chunks if c.choices)
    assert first + rest == decode(hf_greedy[0], skip_special_tokens=True)
    assert joined.choices[0].text == decode(hf_greedy[1], skip_special_tokens=True)
    after = counters()
    assert after[0] >= before[0] + 1 or after[1] >= before[1] + 16


def test_logits_overwritten_by_a_later_step_are_refused(smollm: tuple[Any, Any]) -> None:
    """A step's logits live in static buffers the next step of its kind overwrites: reading sampled rows after that
    is an error, not silently another step's numbers (greedy picks were copied at launch and stay readable)."""
    engine = _engine(smollm, slots=2)
    first = engine.prefill([0], [[1, 2, 3]])
    assert first.rows([0]).shape == (1, engine.dims.vocab)  # fine while it is the latest prefill
    picked = first.argmax()
    later = engine.prefill([1], [[4, 5]])
    with pytest.raises(RuntimeError, match="a later step overwrote these logits"):
        first.rows([0])
    assert first.argmax() == picked and later.rows([0]).shape == (1, engine.dims.vocab)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
async def test_mixed_steps_keep_hf_greedy_tokens(
    smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]], async_scheduling: bool
) -> None:
    """Mixed steps (a decode step and new prompts' tokens as one batch of rows): prompts admitted one per step, so
    steps 2 and 3 decode the running sequences and prefill the next prompt together — HF's tokens still, with
    the slots of the finished sequences reused (3 slots, 6 requests); with async scheduling the decode rows take the
    device's own picks, and a prompt's first token is its mixed step's pick."""
    engine = _engine(smollm, slots=3, mixed=(64, 128))
    sched = SchedulerConfig(
        max_running_seqs=3, max_batched_tokens=512, max_model_len=256, max_prefill_seqs=1, prefix_cache_mb=0
    )  # the second round repeats the prompts: with a prefix cache they would prefill from it, not mixed
    llm = LLMEngine(engine, smollm[1].backend_tokenizer, sched)
    if async_scheduling:
        async with AsyncLLMEngine(llm, async_scheduling=True) as loop:
            streams = [loop.add(p, GREEDY) for p in prompts * 2]
            events = [[e async for e in st] for st in streams]
        ids = [[e.token_id for e in ev if e.token_id is not None] for ev in events]
    else:
        ids = [g[0] for g in llm.generate(prompts * 2, GREEDY)]
    assert ids == hf_greedy * 2
    assert engine.mixed_steps >= 4  # the 2nd and 3rd prompts of each round at least
    assert engine._launched["prefill"] <= 2  # only prompts that met no running sequence prefill alone


def test_prompts_past_the_mixed_buckets_take_separate_steps(
    smollm: tuple[Any, Any], prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    """Prompts longer than the largest mixed token bucket (16 here) never run mixed: the runner falls back to a decode
    step and a separate prefill, with HF's tokens."""
    assert min(map(len, prompts)) > 16
    engine = _engine(smollm, slots=3, mixed=(16,))
    sched = SchedulerConfig(max_running_seqs=3, max_batched_tokens=512, max_model_len=256, max_prefill_seqs=1)
    got = [g[0] for g in LLMEngine(engine, None, sched).generate(prompts, GREEDY)]
    assert got == hf_greedy and engine.mixed_steps == 0 and engine._launched["prefill"] == 3


def test_sampled_rows_of_mixed_steps_match_separate_steps(smollm: tuple[Any, Any], prompts: list[list[int]]) -> None:
    """Seeded sampling (temperature, top-p) where prompts join running sequences: the rows' logits come from the mixed
    step's buffers (decode rows, then each prompt's last token) and give the tokens separate steps give."""
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7)
    sched = SchedulerConfig(
        max_running_seqs=3, max_batched_tokens=512, max_model_len=256, max_prefill_seqs=1, prefix_cache_mb=0
    )  # mixed steps against separate ones, without prefills from a prefix cache in between
    mixed, plain = _engine(smollm, slots=3, mixed=(64, 128)), _engine(smollm, slots=3, mixed=())
    got = [g[0] for g in LLMEngine(mixed, None, sched).generate(prompts, params)]
    want = [g[0] for g in LLMEngine(plain, None, sched).generate(prompts, params)]
    assert got == want and mixed.mixed_steps == 2 and plain.mixed_steps == 0


def test_mixed_step_equals_a_decode_then_a_prefill(smollm: tuple[Any, Any], prompts: list[list[int]]) -> None:
    """One mixed step against the same decode and prefill run separately from the same cache: the same logits
    (fp32) for every decode row and prompt, the same keys and values in the slots; prompts that fit no token bucket
    (or more prompts than ``mixed_prefill_prompts``) are not run mixed (None: the runner takes two steps)."""
    mixed, plain = _engine(smollm, slots=4, mixed=(64, 128)), _engine(smollm, slots=4, mixed=())
    assert mixed.max_prefill_prompts == 4 and plain.max_prefill_prompts is None  # the scheduler's cap per step
    for e in (mixed, plain):
        e.prefill([0, 2], prompts[:2])
    for e in (mixed, plain):
        e.decode([0, 2], [11, 12])  # a decode step before: the rows' positions differ from the prompts' lengths
    out = mixed.decode_and_prefill([0, 2], [13, 14], [1, 3], [prompts[2], prompts[0][:5]])
    assert out is not None and mixed.mixed_steps == 1
    want_decode = plain.decode([0, 2], [13, 14])
    want_prefill = plain.prefill([1, 3], [prompts[2], prompts[0][:5]])
    assert np.allclose(out[0].rows([0, 1]), want_decode.rows([0, 1]), atol=2e-4)
    assert np.allclose(out[1].rows([0, 1]), want_prefill.rows([0, 1]), atol=2e-4)
    assert list(mixed.lengths) == list(plain.lengths)
    for a, b in zip(mixed.model.k_cache, plain.model.k_cache, strict=True):
        for slot, n in enumerate(plain.lengths):  # each slot's tokens (past them: stale rows, never attended)
            assert torch.allclose(a[slot, :, :n], b[slot, :, :n], atol=2e-4), slot
    too_long = [list(range(1, 100)), list(range(1, 60))]  # 159 tokens > the largest bucket (128)
    assert mixed.decode_and_prefill([0, 2], [1, 2], [1, 3], too_long) is None
    assert mixed.mixed_steps == 1
