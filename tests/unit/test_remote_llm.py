"""A chat version of the engine process seen from an HTTP worker (``RemoteLLMEngine``): the version that served a
request is known even when its last token arrived before the admission's reply was read (a short answer under load:
the worker then reported its own, older version in ``system_fingerprint`` after another worker swapped versions); a
worker that connects to a version the engine process has just swapped out follows the serving one."""

from __future__ import annotations

from typing import Any

import pytest

from miaohui.errors import UnavailableError
from miaohui.serving.engine_messages import ChatFacts, ChatStatus, ItemSink
from miaohui.serving.remote_llm import RemoteLLMEngine


class _FastEngineProcess:
    """An engine-process client whose answer is complete before ``generate`` returns the version that served it
    (the order in which the worker's connection reader can hand them over). A fake: that ordering is a race."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def new_generation_id(self) -> int:
        return 7

    async def generate(self, sid: int, model: str, ids: list[int], params: Any, sink: ItemSink, pinned: Any) -> int:
        sink((sid, 42, "hi", 1, "length", len(ids), 1))
        return 2

    def release(self, sid: int) -> None:
        self.released.append(sid)

    def abort(self, sid: int) -> None:
        raise AssertionError("nothing is aborted")


async def test_the_serving_version_is_set_when_the_answer_came_first() -> None:
    client = _FastEngineProcess()
    engine = RemoteLLMEngine(client, "chat", 1, vocab=100, max_model_len=64)  # type: ignore[arg-type]
    await engine.start()
    stream = engine.add([1, 2, 3])
    await stream.admitted()
    assert stream.version == 2  # the engine process's version, not this worker's 1
    assert client.released == [7] and engine.num_running == 0
    events = [e async for e in stream]
    assert [(e.token_id, e.finish_reason) for e in events] == [(42, "length")]


class _SwappedEngineProcess:
    """An engine-process client that already serves version 2 of ``chat`` (another worker loaded it) when this worker,
    still starting, connects to the version 1 it found. A fake: that ordering is a race between processes."""

    async def llm_status(self) -> ChatStatus:
        return {"chat": {2: ChatFacts(vocab=100, max_model_len=64)}}


async def test_an_unpinned_version_follows_a_swap_made_while_it_loaded() -> None:
    client = _SwappedEngineProcess()
    engine = await RemoteLLMEngine.connect(client, "chat", 1)  # type: ignore[arg-type]
    assert (engine.version, engine.vocab, engine.max_model_len) == (1, 100, 64)  # requests go to the serving version
    with pytest.raises(UnavailableError, match=r"does not serve chat version 1 \(it serves \[2\]\)"):
        await RemoteLLMEngine.connect(client, "chat", 1, pinned=True)  # a shadow candidate is that version or nothing
    with pytest.raises(UnavailableError, match="it serves none"):
        await RemoteLLMEngine.connect(client, "other", 1)
