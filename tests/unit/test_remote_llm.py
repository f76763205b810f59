"""A chat version of the engine process seen from an HTTP worker (``RemoteLLMEngine``): the version that served a
request is known even when its last token arrived before the admission's reply was read (a short answer under load:
the worker then reported its own, older version in ``system_fingerprint`` after another worker swapped versions)."""

from __future__ import annotations

from typing import Any

from miaohui.serving.engine_messages import ItemSink
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
