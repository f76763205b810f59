"""Chat models in the :class:`ModelManager`, in-process (httpx ASGI client, the OpenAI routes) over the numpy fake
decoder of :mod:`tests.unit.test_openai_routes`: a swap and an unload drop no running stream; while a model unloads
new requests get 503; a chat model is not an encoder. The real server and models: tests/e2e/test_chat_versions.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from tests.unit.test_openai_routes import TEMPLATE, CountingEngine, ask, char_tokenizer, info, sse

from miaohui.errors import InputError
from miaohui.generation.build.artifact import ChatTokenizer
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.server.metrics import Metrics
from miaohui.server.openai_api import openai_router
from miaohui.serving.chat import ChatDefaults
from miaohui.serving.repository import ModelManager

SLOW = 0.004
"""Seconds per engine call: a 20-token stream takes ~0.1 s, long enough to be running while the test acts."""


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ModelManager]]:
    manager = ModelManager(tmp_path, chat_defaults=ChatDefaults(SchedulerConfig(max_running_seqs=2, max_waiting=2)))
    await manager.add_chat_engine(info(), CountingEngine(SLOW), ChatTokenizer(char_tokenizer(), TEMPLATE))
    app = FastAPI()
    app.include_router(openai_router(manager, Metrics()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client, manager
    await manager.stop()


async def _running(client: httpx.AsyncClient, manager: ModelManager) -> asyncio.Task[httpx.Response]:
    """A 20-token stream on the serving version, once it runs."""
    served = manager.chat("counter")
    task = asyncio.create_task(client.post("/v1/chat/completions", json=ask(stream=True, max_tokens=20)))
    while served.busy == 0:
        assert not task.done(), task.result().text
        await asyncio.sleep(0.001)
    return task


def _answer(r: httpx.Response) -> tuple[str, str, str]:
    """(fingerprint, text, finish reason) of a streamed answer."""
    assert r.status_code == 200, r.text
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    return events[0]["system_fingerprint"], text, events[-2]["choices"][0]["finish_reason"]


async def test_a_swap_lets_the_old_version_finish_its_streams(
    served: tuple[httpx.AsyncClient, ModelManager],
) -> None:
    client, manager = served
    old = manager.chat("counter")
    running = await _running(client, manager)
    new = info().model_copy(update={"version": 4})
    await manager.add_chat_engine(new, CountingEngine(), ChatTokenizer(char_tokenizer(), TEMPLATE))
    assert manager.chat("counter").version == 4 and not old.ready  # new requests go to version 4 from now on
    r = await client.post("/v1/chat/completions", json=ask(max_tokens=3))
    assert (r.json()["system_fingerprint"], r.json()["choices"][0]["message"]["content"]) == (
        "miaohui-counter-v4-fp32",
        "abc",
    )
    assert _answer(await running) == ("miaohui-counter-v3-fp32", "abcdefghijklmnopqrst", "length")
    for _ in range(200):  # retired once its stream finished
        if not old.client.is_running:
            break
        await asyncio.sleep(0.01)
    assert not old.client.is_running


async def test_unload_answers_503_while_running_streams_finish(
    served: tuple[httpx.AsyncClient, ModelManager],
) -> None:
    client, manager = served
    running = await _running(client, manager)
    unloading = asyncio.create_task(manager.unload("counter"))
    while manager.index()[0]["state"] != "UNLOADING":
        await asyncio.sleep(0.001)
    r = await client.post("/v1/chat/completions", json=ask())
    assert r.status_code == 503
    assert r.json()["error"]["message"] == (
        "model 'counter' is unloading. Fix: load it again (POST /v2/repository/models/counter/load)"
    )
    assert not unloading.done()
    assert _answer(await running) == ("miaohui-counter-v3-fp32", "abcdefghijklmnopqrst", "length")
    await unloading
    r = await client.post("/v1/chat/completions", json=ask())
    assert r.status_code == 404
    assert manager.index() == []


async def test_a_chat_model_is_not_an_encoder(served: tuple[httpx.AsyncClient, ModelManager]) -> None:
    _, manager = served
    with pytest.raises(InputError) as exc:
        manager.get("counter")
    assert (exc.value.message, exc.value.fix) == (
        "model 'counter' is a chat model; this endpoint needs an encoder model",
        "send it to POST /v1/chat/completions or /v1/completions",
    )
    assert manager.version("counter").ready and manager.ready
    assert json.loads(json.dumps(manager.index())) == [
        {"name": "counter", "version": "3", "state": "READY", "reason": ""}
    ]
