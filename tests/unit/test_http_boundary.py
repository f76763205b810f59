"""The one HTTP boundary (server/http_io.py + server/status.py), in-process through the whole app that ``miaohui
serve`` builds (``create_app``, an httpx ASGI client, a numpy fake decoder for the OpenAI routes): every error class
has its row, one body limit (8 MiB → 413) on every route, one disconnect rule (499), OpenAI's error shape on every
OpenAI route and KServe's elsewhere, and an engine fault is a 500 for the request it hit while the server goes on.
429 (queue full) and the in-band error of a stopped engine are pinned in test_openai_routes.py, 504 in
tests/integration/test_http.py."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from tests.unit.test_openai_routes import TEMPLATE, CountingEngine, ask, char_tokenizer, info
from tests.unit.test_slot_runner import CharDetok
from tests.unit.test_slot_runner import CountingEngine as SlotCountingEngine

from miaohui import errors
from miaohui.errors import InternalError, MiaohuiError, QueueFullError
from miaohui.generation.build.artifact import ChatTokenizer
from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import Scheduler, SchedulerConfig
from miaohui.server.http import create_app
from miaohui.server.metrics import Metrics
from miaohui.server.observer_metrics import chat_observers
from miaohui.server.state import ServerState
from miaohui.server.status import TABLE, grpc_status, http_status
from miaohui.serving.chat import ChatDefaults
from miaohui.serving.repository import ModelManager

LIMIT = 8 << 20
TOO_BIG = "request body is larger than the limit of 8388608 bytes. Fix: send smaller batches"


def test_every_error_class_has_an_http_and_a_grpc_status() -> None:
    """A new class in errors.py without its own row would be answered by its base's row silently: fail instead."""
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, MiaohuiError)]
    missing = [c.__name__ for c in classes if c not in TABLE]
    assert missing == [], f"add these to miaohui.server.status.TABLE: {missing}"
    statuses = {c.__name__: (http_status(c("x")), grpc_status(c("x"))) for c in classes}
    assert statuses["EngineStoppedError"] == (503, grpc.StatusCode.UNAVAILABLE)
    assert statuses["InternalError"] == (500, grpc.StatusCode.INTERNAL)
    assert statuses["PayloadTooLargeError"] == (413, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert statuses["ClientDisconnectedError"] == (499, grpc.StatusCode.CANCELLED)
    assert statuses["QueueFullError"] == (429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert (http_status(RuntimeError("bug")), grpc_status(RuntimeError("bug"))) == (500, grpc.StatusCode.INTERNAL)


class FaultyEngine(CountingEngine):
    """The counting decoder; ``fail`` makes its next forward raise, as a bug in a model step would."""

    fail = False

    def _forward(self, *args: Any) -> Any:
        if self.fail:
            self.fail = False
            raise RuntimeError("kernel launch failed")
        return super()._forward(*args)


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ModelManager, Metrics, Any]]:
    metrics = Metrics()
    service = ModelManager(
        tmp_path / "repo",
        observer_factory=metrics.observer,
        chat_observer_factory=chat_observers(metrics),
        chat_defaults=ChatDefaults(SchedulerConfig(max_running_seqs=2)),
    )
    await service.load_all()
    await service.add_chat_engine(info(), FaultyEngine(), ChatTokenizer(char_tokenizer(), TEMPLATE))
    application = create_app(ServerState(service, metrics))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://test") as client:
        yield client, service, metrics, application
    await service.stop()


def openai_error(message: str, kind: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def test_one_body_limit_on_every_route(app: tuple[httpx.AsyncClient, Any, Any, Any]) -> None:
    client = app[0]
    big = b"x" * (LIMIT + 1)
    for path in ("/v1/intent", "/v2/models/intent/infer", "/v2/repository/models/m/load"):
        r = await client.post(path, content=big)
        assert (r.status_code, r.json()) == (413, {"error": TOO_BIG}), path
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        r = await client.post(path, content=big)
        assert (r.status_code, r.json()) == (413, openai_error(TOO_BIG, "invalid_request_error", "body_too_large"))
    r = await client.post("/v1/chat/completions", json=ask("x" * 100, max_tokens=2))  # a body under the limit
    assert r.status_code == 200


async def test_openai_shape_on_every_openai_route_and_kserve_elsewhere(
    app: tuple[httpx.AsyncClient, Any, Any, Any],
) -> None:
    client = app[0]
    r = await client.post("/v1/embeddings", json={"model": "minilm", "input": "hi"})
    missing = "model 'minilm' is not loaded. Fix: loaded models: counter"
    assert (r.status_code, r.json()) == (
        404,
        openai_error(missing, "invalid_request_error", "model_not_found", "model"),
    )
    r = await client.post("/v1/embeddings", json={"model": "minilm"})
    bad = (
        "missing 'input' (a string or a non-empty list of strings). "
        'Fix: send {"model": "NAME", "input": "text"} or {"model": "NAME", "input": ["a", "b"]}'
    )
    assert (r.status_code, r.json()) == (400, openai_error(bad, "invalid_request_error", "bad_input"))
    r = await client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = await client.get("/v1/chat/completions")  # a method the route does not take: still OpenAI's shape
    assert (r.status_code, r.json()) == (405, openai_error("Method Not Allowed", "invalid_request_error", None))
    r = await client.post("/v1/intent", content=b"{")
    assert r.status_code == 400 and r.json()["error"].startswith("request body is not valid JSON")
    r = await client.post("/v2/models/nope/infer", json={"inputs": []})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = await client.get("/v1/no-such-route")
    assert (r.status_code, r.json()) == (404, {"error": "Not Found"})


async def test_an_engine_fault_is_a_500_for_its_request_and_the_server_goes_on(
    app: tuple[httpx.AsyncClient, ModelManager, Metrics, Any],
) -> None:
    client, service, metrics, _ = app
    service.chat("counter").client.llm.engine.fail = True  # type: ignore[attr-defined]
    r = await client.post("/v1/chat/completions", json=ask(max_tokens=3))
    message = (
        "generation step failed: RuntimeError('kernel launch failed'). "
        "Fix: retry; if it persists, check the engine logs"
    )
    assert (r.status_code, r.json()) == (500, openai_error(message, "server_error", "internal"))
    service.chat("counter").client.llm.engine.fail = True  # type: ignore[attr-defined]
    r = await client.post("/v1/chat/completions", json=ask(max_tokens=3, stream=True))
    assert r.status_code == 200  # admitted before the fault: the stream ends with the error in-band
    assert openai_error(message, "server_error", "internal") in [e for e in _events(r.text) if e != "[DONE]"]
    r = await client.post("/v1/chat/completions", json=ask(max_tokens=3))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "abc"
    text = metrics.render().decode()
    assert 'miaohui_requests_total{code="500",model="counter",protocol="openai",version="3"} 2.0' in text
    assert 'code="429"' not in text


async def test_a_runner_fault_is_an_internal_error_not_a_full_queue() -> None:
    """The slot runner handed more new sequences than it has KV slots (a scheduler configured past the engine,
    which LLMEngine prevents): every sequence of that step ends with InternalError (500), not QueueFullError (429)."""
    llm = LLMEngine(SlotCountingEngine(num_slots=1), None, SchedulerConfig(max_running_seqs=1, max_model_len=64))
    llm.scheduler = Scheduler(llm.config.model_copy(update={"max_running_seqs": 2}), [0], CharDetok)
    async with AsyncLLMEngine(llm) as loop:
        streams = [loop.add([5], SamplingParams(max_tokens=3, temperature=0.0)) for _ in range(2)]
        for stream in streams:
            with pytest.raises(InternalError, match="2 new sequences but 1 free KV slots") as info:
                [e async for e in stream]
            assert not isinstance(info.value, QueueFullError) and http_status(info.value) == 500
        assert (loop.num_running, loop.num_waiting) == (0, 0)


async def test_a_stopped_engine_is_503_in_openai_shape(
    app: tuple[httpx.AsyncClient, ModelManager, Metrics, Any],
) -> None:
    client, service, _, _ = app
    await service.chat("counter").client.stop()
    r = await client.post("/v1/chat/completions", json=ask())
    stopped = "the generation engine is not running. Fix: await engine.start() first"
    assert (r.status_code, r.json()) == (503, openai_error(stopped, "server_error", "engine_stopped"))


async def _call(application: Any, path: str, body: bytes, *, disconnect_at: int) -> tuple[int, bytes]:
    """One request straight through ASGI whose client goes away: ``receive`` gives the body in one message, then
    (from call ``disconnect_at`` on) ``http.disconnect``; httpx's clients cannot drop a connection mid-request."""
    calls = 0
    gone = asyncio.Event()
    sent: dict[str, Any] = {}

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls < disconnect_at:
            return {"type": "http.request", "body": body, "more_body": False}
        if calls > disconnect_at:
            await gone.wait()
        await asyncio.sleep(0.02)  # the request is queued or running by now
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.setdefault("status", message.get("status"))
        sent["body"] = sent.get("body", b"") + message.get("body", b"")
        gone.set()

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http"}
    scope |= {"path": path, "raw_path": path.encode(), "query_string": b"", "headers": headers, "root_path": ""}
    scope |= {"client": ("127.0.0.1", 1), "server": ("test", 80), "state": {}, "app": application}
    await application(scope, receive, send)
    return sent["status"], sent["body"]


async def test_a_client_gone_is_499_and_its_work_is_dropped(
    app: tuple[httpx.AsyncClient, ModelManager, Metrics, Any],
) -> None:
    _, service, metrics, application = app
    engine: Any = service.chat("counter").client
    engine.llm.engine.delay_s = 0.005  # type: ignore[attr-defined]
    body = httpx.Request("POST", "/", json=ask(max_tokens=200, ignore_eos=True)).content
    status, _ = await _call(application, "/v1/chat/completions", body, disconnect_at=2)
    assert status == 499
    while engine.num_running:  # aborted: its slot is free for the next step
        await asyncio.sleep(0.001)
    status, _ = await _call(application, "/v1/intent", b'{"text": "hi"}', disconnect_at=1)  # gone mid-body
    assert status == 499
    text = metrics.render().decode()
    assert 'miaohui_requests_total{code="499",model="counter",protocol="openai",version="3"} 1.0' in text
    assert 'miaohui_requests_total{code="499",model="_unknown",protocol="http",version=""} 1.0' in text


def _events(text: str) -> list[Any]:
    return [b if b == "[DONE]" else json.loads(b) for b in (x.removeprefix("data: ") for x in text.split("\n\n")) if b]
