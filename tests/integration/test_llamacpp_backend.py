"""The ``llamacpp`` causal-LM backend, for real: the shipped SmolLM2-135M-Instruct Q4_1 GGUF built with
``--backend llamacpp`` into a temporary repository (the file itself, no export), served by a real ``miaohui serve``
subprocess (llama.cpp's server in-process, through the ``xllamacpp`` wheel) and called with the ``openai`` client.

The build is made once for the module (the GGUF's fp32 conversion is the integration tests' cache: no new
conversion); answers are short (few tokens) to keep the module to seconds of llama.cpp time.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from tests.e2e.test_workers import Served, serve_workers
from tests.integration.conftest import SMOLLM_CACHE

from miaohui.errors import ArtifactError, ConfigError
from miaohui.generation.build.artifact import build_causal_lm, read_info
from miaohui.generation.engine.scheduler import SchedulerConfig

pytestmark = pytest.mark.slow  # a real build, llama.cpp in three served processes

pytest.importorskip("xllamacpp", reason="the llamacpp extra: pip install 'miaohui[llamacpp]'")

MODEL = "smol-q4"
MAX_MODEL_LEN = 256
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("llamacpp-repo")
    build_causal_lm(repo, MODEL, "gguf", backend="llamacpp", source="smollm2", source_cache=SMOLLM_CACHE)
    sched = SchedulerConfig(max_running_seqs=2, max_waiting=4, max_batched_tokens=256, max_model_len=MAX_MODEL_LEN)
    config = {"scheduler": sched.model_dump(mode="json"), "threads": 2}
    (repo / MODEL / "generation.yaml").write_text(yaml.safe_dump(config))
    return repo


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Served]:
    yield from serve_workers(repository, models=MODEL)


@pytest.fixture(scope="module")
def client(server: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_the_version_is_the_gguf_itself(repository: Path) -> None:
    from miaohui.generation.build.llamacpp_artifact import read_llamacpp_meta
    from miaohui.zoo.smollm import smollm_gguf_path

    version = repository / MODEL / "1"
    info, meta = read_info(version), read_llamacpp_meta(version)
    assert (info.backend, info.precision, info.source_format) == ("llamacpp", "q4_1", "gguf")
    assert info.source == f"{smollm_gguf_path().name}@sha256:{meta.sha256}"
    assert (version / "model.gguf").stat().st_size == smollm_gguf_path().stat().st_size
    assert not list(version.glob("*.onnx")) and (version / "tokenizer.json").is_file()
    assert info.chat_template is not None and meta.eos_token_ids == [2] and meta.vocab == 49152
    again = build_causal_lm(repository, MODEL, "gguf", backend="llamacpp", source="smollm2", source_cache=SMOLLM_CACHE)
    assert again == version  # same GGUF: the build key reuses the version


def test_chat_streamed_and_not_greedy_and_deterministic(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)  # type: ignore[arg-type]
    again = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)  # type: ignore[arg-type]
    text = whole.choices[0].message.content or ""
    assert text == again.choices[0].message.content and text.strip()
    assert whole.usage is not None and whole.usage.completion_tokens <= 12
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=12, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_max_tokens_ends_with_length_and_completions_endpoint(client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3)
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 3 and done.choices[0].text.strip()
    stop = client.completions.create(
        model=MODEL, prompt="One, two, three, four,", temperature=0, max_tokens=12, stop=[" six"]
    )
    assert stop.choices[0].finish_reason == "stop" and "six" not in stop.choices[0].text


def test_errors_over_long_prompt_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_MODEL_LEN} tokens"):
        client.completions.create(model=MODEL, prompt="word " * (MAX_MODEL_LEN + 10), max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
    ok = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens >= 1  # still serving


def test_metrics_count_the_llamacpp_model(client: openai.OpenAI, server: Served) -> None:
    client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=2)
    lines = httpx.get(server.url + "/metrics", timeout=10).text.splitlines()

    def value(prefix: str) -> float:
        found = [float(line.split()[-1]) for line in lines if line.startswith(prefix) and f'"{MODEL}"' in line]
        assert found, f"no {prefix} for {MODEL}"
        return sum(found)

    assert value("miaohui_time_to_first_token_seconds_count") >= 1
    assert value("miaohui_inter_token_latency_seconds_count") >= 1
    assert value("miaohui_generated_tokens_total") >= 2


def test_corrupt_or_foreign_sources_are_clear_build_errors(tmp_path: Path) -> None:
    from miaohui.zoo.smollm import smollm_gguf_path

    broken = tmp_path / "broken.gguf"
    with smollm_gguf_path().open("rb") as src, broken.open("wb") as dst:
        dst.write(src.read(1 << 16))  # the header and part of the metadata, no tensors
    with pytest.raises(ArtifactError, match="broken.gguf is not a readable GGUF file"):
        build_causal_lm(tmp_path / "repo", "broken", "gguf", backend="llamacpp", source=broken)
    with pytest.raises(ConfigError, match="runs the GGUF as it is"):
        build_causal_lm(tmp_path / "repo", "x", "int8", backend="llamacpp", source="smollm2", source_cache=SMOLLM_CACHE)
    assert not (tmp_path / "repo" / "broken").exists() or not list((tmp_path / "repo" / "broken").iterdir())
    shutil.rmtree(tmp_path / "repo", ignore_errors=True)


def test_engine_queue_full_abort_and_stop(repository: Path) -> None:
    """The engine alone (one slot, one waiting place): a third request is QueueFullError, an abort frees the slot
    for the waiting one at once, stop ends what is left with EngineStoppedError."""
    import asyncio

    from miaohui.errors import QueueFullError
    from miaohui.generation.engine.client import EngineStoppedError
    from miaohui.generation.engine.llamacpp_engine import LlamaCppLLMEngine
    from miaohui.generation.engine.params import SamplingParams

    async def run() -> None:
        sched = SchedulerConfig(max_running_seqs=1, max_waiting=1, max_batched_tokens=64, max_model_len=64)
        engine = LlamaCppLLMEngine(repository / MODEL / "1", sched, threads=2)
        await engine.start(warmup=False)
        long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        first = engine.add([1, 2, 3, 4], long)
        second = engine.add([1, 2, 3, 5], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        with pytest.raises(QueueFullError, match="max_waiting=1"):
            engine.add([1, 2, 3, 6], long)
        assert (engine.num_running, engine.num_waiting) == (1, 1)
        event = await first.__anext__()
        assert event.completion_tokens == 1 and event.finish_reason is None
        first.abort()
        assert [e.finish_reason async for e in first][-1] == "abort"
        done = [e async for e in second]
        assert done[-1].finish_reason == "length" and done[-1].completion_tokens == 2
        third = engine.add([1, 2, 3, 7], long)
        await engine.stop()
        with pytest.raises(EngineStoppedError):
            _ = [e async for e in third]
        assert not engine.is_running

    asyncio.run(run())


def test_shared_engine_serves_the_llamacpp_model(repository: Path, client: openai.OpenAI) -> None:
    """``--workers 2 --shared-engine``: the engine process holds llama.cpp; a worker's answer equals the
    one-process server's."""
    want = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=6)  # type: ignore[arg-type]
    served = serve_workers(repository, "--workers", "2", "--shared-engine", models=MODEL)
    shared = next(served)
    try:
        with openai.OpenAI(base_url=f"{shared.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            got = c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=6)  # type: ignore[arg-type]
            stream = c.chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                temperature=0,
                max_tokens=6,
                stream=True,  # type: ignore[arg-type]
            )
            streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert got.choices[0].message.content == want.choices[0].message.content == streamed
    finally:
        served.close()


def test_decoder_gate_runs_on_llama_cpp(repository: Path) -> None:
    """The gate's candidate is llama.cpp's greedy pick (its native ``/completion`` ids, prompt cache on), the reference
    the dequantized fp32 source in PyTorch; two short prompts keep it to seconds."""
    from miaohui.validate.decoder_gate import DecoderGateConfig, GatePrompt, run_decoder_gate

    prompts = [
        GatePrompt(id="en-week", lang="en", text="How many days are in a week?", expect="7|seven"),
        GatePrompt(id="zh-greeting", lang="zh", text="你好！请简单介绍一下你自己。"),
    ]
    report = run_decoder_gate(repository / MODEL / "1", DecoderGateConfig(new_tokens=8), prompts)
    assert (report.backend, report.precision) == ("llamacpp", "q4_1")
    by_id = {r.id: r for r in report.results}
    assert by_id["en-week"].exact and by_id["en-week"].candidate_has_fact
    assert by_id["zh-greeting"].teacher_forced[0] >= 7  # Chinese: byte tokens of a character have their own ids
    assert "\ufffd" not in by_id["zh-greeting"].candidate_text
    assert read_info(repository / MODEL / "1").validation is not None
