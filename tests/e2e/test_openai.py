"""A real uvicorn server on localhost serving the real SmolLM2-135M-Instruct (fp32 ONNX decoder on CPU),
driven by the real ``openai`` client: chat and text completions, streaming, stop and length finishes,
seeded sampling, bad parameters, and a cancelled stream that frees its slot while the server keeps
serving.

The causal-LM repository is built once with :func:`build_causal_lm` under var/test-cache (keyed by the
export code; the build key inside makes a rebuild only when source or libraries change), so later runs
only load it. The converted fp32 model is shared with tests/integration/test_generation.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.prebuild import SMOLLM_CACHE as MODEL_CACHE
from tests.prebuild import ensure_llm_repository
from tests.servers import UvicornThread

from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.server.metrics import Metrics
from miaohui.server.observer_metrics import chat_observers
from miaohui.server.openai_api import create_openai_app
from miaohui.serving.chat import ChatDefaults
from miaohui.serving.repository import ModelManager

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_MODEL_LEN = 512
QUESTION = [{"role": "user", "content": "Explain what a bank deposit is in two sentences."}]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llm_repository() -> Path:
    """SmolLM2-135M-Instruct built into a repository once per cache key (:mod:`tests.prebuild`)."""
    return ensure_llm_repository()


@pytest.fixture(scope="module")
def server(llm_repository: Path) -> Iterator[tuple[str, ModelManager]]:
    metrics = Metrics()
    sched = SchedulerConfig(max_running_seqs=4, max_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN)
    service = ModelManager(
        llm_repository, chat_observer_factory=chat_observers(metrics), chat_defaults=ChatDefaults(sched)
    )
    with UvicornThread(create_openai_app(service, metrics)) as srv:
        assert service.chat(MODEL).ready
        yield f"http://127.0.0.1:{srv.port}", service


@pytest.fixture(scope="module")
def client(server: tuple[str, ModelManager]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from miaohui.zoo.smollm import load_smollm_tokenizer

    return load_smollm_tokenizer(MODEL_CACHE)


def metric(url: str, sample: str) -> float:
    """One sample's value from ``/metrics`` (0 when absent)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return 0.0


def client_closed(service: ModelManager) -> str:
    """The sample counting requests whose client went away (HTTP 499)."""
    version = service.chat(MODEL).version
    return f'miaohui_requests_total{{code="499",model="{MODEL}",protocol="openai",version="{version}"}}'


def wait_until_idle(service: ModelManager, timeout_s: float = 10.0) -> None:
    engine: Any = service.chat(MODEL).client
    deadline = time.monotonic() + timeout_s
    while (engine.num_running, engine.num_waiting) != (0, 0):
        assert time.monotonic() < deadline, "an abandoned request still holds its slot"
        time.sleep(0.02)


def engine_greedy(service: ModelManager, prompt_ids: list[int], max_tokens: int) -> tuple[str, str | None, int]:
    """The same decoder, run offline in this thread: (text, finish reason, tokens) of greedy decoding."""
    llm = service.chat(MODEL)
    offline = LLMEngine(llm.client.llm.engine, llm.tokenizer.tokenizer)  # type: ignore[attr-defined]
    ids, text, reason = offline.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    return text, reason, len(ids)


@pytest.fixture(scope="module")
def greedy(server: tuple[str, ModelManager], hf_tokenizer: Any) -> tuple[str, str | None, int, int]:
    """(text, finish reason, completion tokens, prompt tokens) of QUESTION, the prompt encoded by HF."""
    from miaohui.zoo.smollm import encode_chat

    prompt = encode_chat(QUESTION, tokenizer=hf_tokenizer)
    text, reason, n = engine_greedy(server[1], prompt, NEW_TOKENS)
    assert n >= 16 and text
    return text, reason, n, len(prompt)


def test_chat_completion_is_the_engines_greedy_output(
    client: openai.OpenAI, greedy: tuple[str, str | None, int, int]
) -> None:
    text, reason, n, prompt_tokens = greedy
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=NEW_TOKENS)  # type: ignore[arg-type]
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == reason
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt_tokens, n)
    assert resp.usage.total_tokens == prompt_tokens + n


def test_streamed_chat_concatenates_to_the_same_text(
    client: openai.OpenAI, greedy: tuple[str, str | None, int, int]
) -> None:
    text, reason, n, prompt_tokens = greedy
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=NEW_TOKENS,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 5  # really streamed
    assert chunks[-2].choices[0].finish_reason == reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_tokens, n)


def test_completions_endpoint(client: openai.OpenAI, server: tuple[str, ModelManager], hf_tokenizer: Any) -> None:
    prompt = "The capital of France is"
    text, _, _ = engine_greedy(server[1], hf_tokenizer(prompt)["input_ids"], 8)
    resp = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    assert resp.object == "text_completion"
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (text, "length")
    streamed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_stop_sequences_and_max_tokens(client: openai.OpenAI, greedy: tuple[str, str | None, int, int]) -> None:
    text = greedy[0]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=NEW_TOKENS, stop=[stop, "\n\n\n"])  # type: ignore[arg-type]  # fmt: skip
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == text[: text.index(stop)]
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=3)  # type: ignore[arg-type]
    assert resp.choices[0].finish_reason == "length" and resp.usage is not None and resp.usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name three fruits."}], temperature=1.0, top_p=0.95,
            seed=seed, max_tokens=12,
        )  # fmt: skip
        return resp.choices[0].message.content or ""

    first = sample(7)
    assert sample(7) == first
    assert {sample(8), sample(9)} != {first}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -1}, "Invalid value for 'temperature': -1. Input should be greater than or equal to 0."),
        ({"top_p": 0}, "Invalid value for 'top_p': 0. Input should be greater than 0."),
        ({"top_p": 1.5}, "Invalid value for 'top_p': 1.5. Input should be less than or equal to 1."),
        ({"max_tokens": 0}, "Invalid value for 'max_tokens': 0. Input should be greater than or equal to 1."),
        ({"n": 2}, "n=2 is not supported: only one choice per request (n=1)"),
        ({"messages": []}, "messages is empty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role is 'wizard'"),
        ({"max_tokens": MAX_MODEL_LEN}, f"This model's maximum context length is {MAX_MODEL_LEN} tokens."),
        ({"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}, "your messages resulted in"),
    ],
)
def test_bad_parameters_are_400_with_the_reason(client: openai.OpenAI, fields: dict[str, Any], message: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    assert info.value.status_code == 400
    assert message in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_404_and_models_are_listed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-9' does not exist"):
        client.chat.completions.create(model="gpt-9", messages=QUESTION)  # type: ignore[arg-type]
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_cancelled_stream_frees_its_slot(client: openai.OpenAI, server: tuple[str, ModelManager]) -> None:
    url, service = server
    engine: Any = service.chat(MODEL).client
    closed_before = metric(url, client_closed(service))
    story = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]
    stream = client.chat.completions.create(model=MODEL, messages=story, temperature=0, max_tokens=400, stream=True)  # type: ignore[arg-type]
    got = []
    for chunk in stream:
        got.append(chunk)
        if len(got) == 3:  # the role chunk and two content chunks
            break
    assert engine.num_running == 1
    stream.close()  # the client goes away mid-generation
    wait_until_idle(service)
    assert metric(url, client_closed(service)) == closed_before + 1  # recorded as abandoned, not as finished
    # the server keeps serving
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4)  # type: ignore[arg-type]
    assert resp.choices[0].finish_reason == "length"


def test_abandoned_non_streamed_request_frees_its_slot(server: tuple[str, ModelManager]) -> None:
    url, service = server
    closed_before = metric(url, client_closed(service))
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 400}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    wait_until_idle(service)
    assert metric(url, client_closed(service)) == closed_before + 1


def test_metrics_record_generation(client: openai.OpenAI, server: tuple[str, ModelManager]) -> None:
    client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=2)  # type: ignore[arg-type]
    samples = {}
    for line in httpx.get(f"{server[0]}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples[f'miaohui_time_to_first_token_seconds_count{{model="{MODEL}"}}'] > 0
    assert samples[f'miaohui_inter_token_latency_seconds_count{{model="{MODEL}"}}'] > 0
    assert samples[f'miaohui_generation_duration_seconds_count{{model="{MODEL}"}}'] > 0
    assert samples[f'miaohui_generated_tokens_total{{model="{MODEL}"}}'] > 0
    assert samples[f'miaohui_prompt_tokens_total{{model="{MODEL}"}}'] > 0
    assert samples[f'miaohui_running_sequences{{model="{MODEL}"}}'] == 0
