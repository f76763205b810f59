"""The OpenAI routes in-process (httpx ASGI client) over a numpy fake decoder and a character tokenizer:
response and SSE chunk shapes, stop/length/EOS finishes, 429 when the queue is full, 404, errors in
OpenAI's shape, metrics, delegated (pipeline) chat models, and the repository layout helpers. The real
model and a real server are in tests/e2e/test_openai.py."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from miaohui.generation.build.artifact import MARKER_NAME, CausalLMInfo, ChatTokenizer, causal_lm_names
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.base import CausalLMEngine
from miaohui.generation.models.dims import DecoderDims
from miaohui.server.metrics import Metrics
from miaohui.server.observer_metrics import chat_observers
from miaohui.server.openai_api import LLMTextGenerator, openai_router
from miaohui.serving.chat import ChatDefaults
from miaohui.serving.repository import ModelManager

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIALS = ["<unk>", "<s>", "</s>"]
VOCAB = {t: i for i, t in enumerate([*SPECIALS, *LETTERS, " ", ":", "\n"])}
EOS = VOCAB["</s>"]
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def char_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


class CountingEngine(CausalLMEngine):
    """Greedy continuation: after a letter the next letter, after 'z' end-of-sequence, after anything
    else 'a'. ``delay_s`` per call makes streams slow enough to hold a slot."""

    def __init__(self, delay_s: float = 0.0) -> None:
        dims = DecoderDims(1, 2, 1, 1, 2, 2, len(VOCAB), 1e4, 1e-6, 256)
        super().__init__(dims, [EOS], EOS)
        self.delay_s = delay_s
        self._next = np.full(len(VOCAB), VOCAB["a"])
        for i, ch in enumerate(LETTERS):
            self._next[VOCAB[ch]] = VOCAB[LETTERS[i + 1]] if ch != "z" else EOS

    def _forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        if self.delay_s:
            time.sleep(self.delay_s)
        b, s = input_ids.shape
        logits = np.zeros((b, len(VOCAB)), dtype=np.float32)
        logits[np.arange(b), self._next[input_ids[:, -1]]] = 10.0
        new = np.zeros((b, 1, s, 2), dtype=np.float32)
        return logits, [np.concatenate([p, new], axis=2) for p in past]


def info(name: str = "counter") -> CausalLMInfo:
    return CausalLMInfo(
        name=name, version=3, precision="fp32", source="test", build_key="k", chat_template=TEMPLATE,
        created=1_700_000_000, build_seconds=0.0,
    )  # fmt: skip


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ModelManager, Metrics]]:
    metrics = Metrics()
    service = ModelManager(
        tmp_path,
        chat_observer_factory=chat_observers(metrics),
        chat_defaults=ChatDefaults(SchedulerConfig(max_running_seqs=1, max_waiting=2)),
    )
    await service.load_all()  # empty repository: nothing loaded
    await service.add_chat_engine(info(), CountingEngine(), ChatTokenizer(char_tokenizer(), TEMPLATE))

    async def pipeline_reply(body: dict[str, Any]) -> dict[str, Any]:
        text = "echo: " + body["messages"][-1]["content"]
        return {"id": "chatcmpl-p", "object": "chat.completion", "created": 1, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}  # fmt: skip

    def delegate(model: str) -> Any:
        return pipeline_reply if model.startswith("pipeline/") else None

    app = FastAPI()
    app.include_router(openai_router(service, metrics, other_models=lambda: ["intent"], chat_delegate=delegate))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client, service, metrics
    await service.stop()


def sse(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as a string)."""
    assert text.endswith("\n\n")
    events = [block.removeprefix("data: ") for block in text.strip("\n").split("\n\n")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def ask(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "counter", "messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


async def test_chat_completion_shape_and_finishes(served: tuple[httpx.AsyncClient, ModelManager, Metrics]) -> None:
    client, _, _ = served
    r = await client.post("/v1/chat/completions", json=ask(max_tokens=5))
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == "counter"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "abcde", "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    prompt = len("<s>user:hi\n<s>assistant:") - 2 * len("<s>") + 2  # characters, each special token one id
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5}
    r = await client.post("/v1/chat/completions", json=ask())  # runs to end-of-sequence after 'z'
    assert r.json()["choices"][0]["message"]["content"] == LETTERS
    assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 27
    r = await client.post("/v1/chat/completions", json=ask(stop=["fg", "xyz"]))
    assert (r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]) == ("abcde", "stop")


async def test_chat_stream_chunks(served: tuple[httpx.AsyncClient, ModelManager, Metrics]) -> None:
    client, _, _ = served
    r = await client.post(
        "/v1/chat/completions", json=ask(max_tokens=4, stream=True, stream_options={"include_usage": True})
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == "abcd"
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_completions_plain_and_streamed(served: tuple[httpx.AsyncClient, ModelManager, Metrics]) -> None:
    client, _, _ = served
    body = {"model": "counter", "prompt": "xy", "temperature": 0}
    r = await client.post("/v1/completions", json=body)
    assert r.json()["object"] == "text_completion"
    assert r.json()["choices"][0] == {"index": 0, "text": "z", "logprobs": None, "finish_reason": "stop"}
    r = await client.post("/v1/completions", json={**body, "prompt": [VOCAB["c"]], "max_tokens": 3, "stream": True})
    events = sse(r.text)
    assert events[-1] == "[DONE]" and "usage" not in events[0]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "def"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_errors_in_openai_shape(served: tuple[httpx.AsyncClient, ModelManager, Metrics]) -> None:
    client, _, _ = served
    r = await client.post("/v1/chat/completions", json=ask(temperature=-1))
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": "Invalid value for 'temperature': -1. Input should be greater than or equal to 0.",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_value",
        }
    }
    r = await client.post("/v1/chat/completions", json={**ask(), "model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model 'nope' does not exist. Fix: chat models served here: counter"
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("model_not_found", "model")
    r = await client.post("/v1/completions", json={"model": "counter", "prompt": "a" * 300})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"model": "counter", "prompt": [999]})
    assert r.json()["error"]["message"] == (
        f"prompt token ids must be ints in [0, {len(VOCAB)}); got [999]. "
        "Fix: encode the prompt with this model's tokenizer"
    )
    r = await client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not valid JSON")
    r = await client.post("/v1/chat/completions", json=ask(max_tokens=2))  # still serving
    assert r.status_code == 200


async def test_queue_full_is_429(served: tuple[httpx.AsyncClient, ModelManager, Metrics]) -> None:
    client, service, _ = served
    engine: Any = service.chat("counter").client
    long = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    engine.llm.engine.delay_s = 0.01  # type: ignore[attr-defined]
    running = engine.add([VOCAB["a"]], long)
    while engine.num_running == 0:
        await asyncio.sleep(0.001)
    waiting = [engine.add([VOCAB["a"]], long) for _ in range(2)]  # max_waiting=2: the queue is now full
    r = await client.post("/v1/chat/completions", json=ask(stream=True))
    assert r.status_code == 429
    assert r.json()["error"] == {
        "message": "2 requests are waiting (max_waiting=2). Fix: retry later, or raise max_waiting / add instances",
        "type": "rate_limit_error",
        "param": None,
        "code": "queue_full",
    }
    for stream in [running, *waiting]:
        stream.abort()
    assert (engine.num_running, engine.num_waiting) == (0, 0)


async def test_stopping_the_service_ends_open_streams_with_an_error(
    served: tuple[httpx.AsyncClient, ModelManager, Metrics],
) -> None:
    client, service, _ = served
    service.chat("counter").client.llm.engine.delay_s = 0.005  # type: ignore[attr-defined]
    request = asyncio.create_task(client.post("/v1/chat/completions", json=ask(stream=True, max_tokens=200)))
    while service.chat("counter").client.num_running == 0:
        assert not request.done(), request.result().text
        await asyncio.sleep(0.001)
    await service.stop()
    events = sse((await request).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "the generation engine stopped. Fix: retry on a running server"
    assert events[-2]["error"]["type"] == "server_error"
    r = await client.post("/v1/chat/completions", json=ask())
    assert r.status_code == 404  # nothing is served after stop()


async def test_models_metrics_and_delegates(served: tuple[httpx.AsyncClient, ModelManager, Metrics]) -> None:
    client, _, metrics = served
    r = await client.get("/v1/models")
    assert r.json() == {
        "object": "list",
        "data": [
            {"id": "counter", "object": "model", "created": 1_700_000_000, "owned_by": "miaohui"},
            {"id": "intent", "object": "model", "created": r.json()["data"][1]["created"], "owned_by": "miaohui"},
        ],
    }
    assert (await client.get("/v1/models/counter")).json()["id"] == "counter"
    assert (await client.get("/v1/models/other")).status_code == 404
    r = await client.post("/v1/completions", json={"model": "intent", "prompt": "hi"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "model 'intent' is not a text-generation model; it has its own endpoint"
    r = await client.post("/v1/chat/completions", json={**ask("hello"), "model": "pipeline/bank"})
    assert r.json()["choices"][0]["message"]["content"] == "echo: hello"
    r = await client.post("/v1/chat/completions", json={**ask("hello"), "model": "pipeline/bank", "stream": True})
    events = sse(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "echo: hello"}
    assert events[1]["choices"][0]["finish_reason"] == "stop" and events[2] == "[DONE]"
    await client.post("/v1/chat/completions", json=ask(max_tokens=3))
    text = metrics.render().decode()
    assert 'miaohui_time_to_first_token_seconds_count{model="counter"}' in text
    assert 'miaohui_generated_tokens_total{model="counter"} 3.0' in text
    # each prompt's wait for its prefill step (TTFT's queue part) goes to the queue histogram
    assert re.search(r'miaohui_queue_duration_seconds_count\{model="counter",version="3"\} [1-9]', text)
    assert re.search(r'miaohui_prefill_sequences_count\{model="counter"\} [1-9]', text)  # prompts per prefill step
    assert 'miaohui_requests_total{code="200",model="counter",protocol="openai",version="3"} 1.0' in text
    assert 'miaohui_running_sequences{model="counter"} 0.0' in text
    assert 'miaohui_inflight_requests{model="openai"} 0.0' in text


async def test_text_generator_for_dialogue_pipelines(
    served: tuple[httpx.AsyncClient, ModelManager, Metrics],
) -> None:
    _, service, _ = served
    generator = LLMTextGenerator(service, "counter")
    assert await generator.generate([{"role": "user", "content": "hi"}], max_tokens=5) == "abcde"


async def test_dialogue_generation_is_charged_to_the_tenant(
    served: tuple[httpx.AsyncClient, ModelManager, Metrics],
) -> None:
    """A pipeline's reply spends the tokens per minute of the request's key: prompt + completion tokens."""
    from miaohui.priority import CALLER

    class Tenant:
        name = "hotline"

        def __init__(self) -> None:
            self.charged: list[int] = []

        def charge(self, tokens: int) -> None:
            self.charged.append(tokens)

    _, service, _ = served
    tenant = Tenant()
    token = CALLER.set(tenant)
    try:
        messages = [{"role": "user", "content": "hi"}]
        assert await LLMTextGenerator(service, "counter").generate(messages, max_tokens=5) == "abcde"  # type: ignore[arg-type]
    finally:
        CALLER.reset(token)
    prompt = len(service.chat("counter").tokenizer.encode_chat(messages))
    assert tenant.charged == [prompt + 5]


async def test_repository_models_are_found_and_broken_ones_reported(tmp_path: Path) -> None:
    (tmp_path / "intent" / "1").mkdir(parents=True)  # an encoder model: not a causal LM
    broken = tmp_path / "llm" / "2"
    broken.mkdir(parents=True)
    (broken / MARKER_NAME).write_text(info("llm").model_dump_json())
    assert causal_lm_names(tmp_path) == ["llm"]
    service = ModelManager(tmp_path)
    await service.load_all()
    assert service.chat_states() == []
    row = next(row for row in service.index() if row["name"] == "llm")
    assert row["state"] == "UNAVAILABLE" and row["reason"].startswith("load failed: cannot load")
    with pytest.raises(Exception, match=r"^model 'llm' is not loaded \(load failed: cannot load .*tokenizer.json"):
        service.chat("llm")
    await service.stop()


def test_chat_template_rendering() -> None:
    tok = ChatTokenizer(char_tokenizer(), TEMPLATE)
    text = tok.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert text == "<s>system:s\n<s>user:u\n<s>assistant:"
    assert tok.encode_chat([{"role": "user", "content": "ab"}])[:2] == [VOCAB["<s>"], VOCAB["u"]]
    strict = ChatTokenizer(char_tokenizer(), "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(Exception, match="^the chat template rejected the messages: roles must alternate"):
        strict.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_text_event_template_is_the_chunk_byte_for_byte(chat: bool, include_usage: bool) -> None:
    from types import SimpleNamespace

    from miaohui.server.openai_api import _Call, _sse

    llm = SimpleNamespace(name='m"型号', version=3, info=SimpleNamespace(precision="bf16"))
    call = _Call(chat, llm, None, 5, include_usage)  # type: ignore[arg-type]
    for text in ["hello", ' "quoted" \\ ', "投资有风险，入市需谨慎\n", "\t\x01", "a" * 300]:
        assert call.text_event(text) == _sse(call.chunk(text, None))
        choice = json.loads(call.text_event(text)[len(b"data: ") :])["choices"][0]
        assert (choice["delta"]["content"] if chat else choice["text"]) == text


async def _chunks_of(events: list[Any], chat: bool = False) -> list[Any]:
    """What ``_stream_chunks`` sends for a stream whose events all queued up before it was read (a reader that
    fell behind the engine), JSON-decoded like :func:`sse`."""
    from types import SimpleNamespace

    from miaohui.generation.engine.client import RequestStream
    from miaohui.server.openai_api import _Call, _stream_chunks

    stream = RequestStream(SimpleNamespace(abort=lambda rid: True), 7, 2)
    for e in events:
        stream._push(e)
    llm = SimpleNamespace(name="m", version=1, info=SimpleNamespace(precision="fp32"))
    call = _Call(chat, llm, stream, 2, True)  # type: ignore[arg-type]
    body = b"".join([chunk async for chunk in _stream_chunks(call, lambda status, why: None)])
    return sse(body.decode())


async def test_tokens_queued_behind_a_slow_reader_go_out_in_one_chunk() -> None:
    from miaohui.generation.engine.client import EngineStoppedError, TokenEvent

    def tok(i: int, text: str, finish: str | None = None) -> TokenEvent:
        return TokenEvent(7, 10 + i, text, i, finish, 2, i)  # type: ignore[arg-type]

    events = await _chunks_of([tok(1, "投资"), tok(2, ""), tok(3, "有风险"), tok(4, "。", "length")])
    assert [e["choices"][0]["text"] for e in events[:-2]] == ["投资有风险。", ""]  # the text, then the finish
    assert events[1]["choices"][0]["finish_reason"] == "length" and events[2]["usage"]["completion_tokens"] == 4
    assert events[-1] == "[DONE]"
    # an error after queued tokens: their text first, then the error in-band
    failed = await _chunks_of([tok(1, "ab"), tok(2, "c"), EngineStoppedError("engine stopped", "retry")])
    assert failed[0]["choices"][0]["text"] == "abc" and failed[1]["error"]["message"].startswith("engine stopped")
    # an abort finish: the text before it, then its error
    aborted = await _chunks_of([tok(1, "x"), TokenEvent(7, None, "", 1, "abort", 2, 1)], chat=True)
    assert aborted[1]["choices"][0]["delta"] == {"content": "x"} and "error" in aborted[2]
