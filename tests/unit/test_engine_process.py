"""The engine-process protocol (``--shared-engine``) over a real Unix socket, in one event loop: results and
errors cross the hop with their class, cancellation reaches the engine side, a lost engine process fails
the requests in flight with 503 and the next request reconnects. The model manager is a stand-in here (its
versions answer from a function); the real engines are covered by tests/e2e/test_shared_engine.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from miaohui.errors import DeadlineExceededError, QueueFullError, UnavailableError
from miaohui.serving.engine_process import EngineClient, EngineServer

Answer = Callable[[list[list[int]], float | None], Awaitable[np.ndarray]]


class _Version:
    def __init__(self, answer: Answer) -> None:
        self.answer, self.ready = answer, True

    async def run_rows(self, rows: list[list[int]], deadline: float | None) -> np.ndarray:
        return await self.answer(rows, deadline)


class _State:
    def __init__(self, version: _Version) -> None:
        self.name, self.versions = "m", {3: version}


class _Manager:
    def __init__(self, answer: Answer) -> None:
        self.version = _Version(answer)

    def get(self, name: str, version: int) -> _Version:
        assert (name, version) == ("m", 3)
        return self.version

    def states(self) -> list[_State]:
        return [_State(self.version)]


def _run(answer: Answer, body: Callable[[EngineClient, EngineServer, str], Awaitable[Any]], tmp: Path) -> Any:
    async def main() -> Any:
        path = str(tmp / "engine.sock")
        server = EngineServer(_Manager(answer))
        await server.start(path)
        client = EngineClient(path)
        try:
            return await body(client, server, path)
        finally:
            await client.close()
            await server.stop()

    return asyncio.run(main())


async def _sums(rows: list[list[int]], deadline: float | None) -> np.ndarray:
    return np.array([[float(sum(r)), float(len(r))] for r in rows], dtype=np.float32)


def test_rows_and_status_round_trip(tmp_path: Path) -> None:
    async def body(client: EngineClient, server: EngineServer, path: str) -> None:
        assert await client.status() == {"m": [3]}
        outs = await asyncio.gather(*(client.infer("m", 3, [[i, 1], [2]], None) for i in range(20)))
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, [[i + 1, 2], [2, 1]])

    _run(_sums, body, tmp_path)


@pytest.mark.parametrize(
    ("raised", "expected", "status"),
    [
        (QueueFullError("queue of m is full (8)", "retry later"), QueueFullError, 429),
        (DeadlineExceededError("deadline passed", "give more time"), DeadlineExceededError, 504),
    ],
)
def test_errors_keep_their_class(tmp_path: Path, raised: Exception, expected: type, status: int) -> None:
    from miaohui.server.status import http_status

    async def fail(rows: list[list[int]], deadline: float | None) -> np.ndarray:
        raise raised

    async def body(client: EngineClient, server: EngineServer, path: str) -> None:
        with pytest.raises(expected) as err:
            await client.infer("m", 3, [[1]], None)
        assert str(err.value) == str(raised) and http_status(err.value) == status

    _run(fail, body, tmp_path)


def test_an_engine_failure_is_a_server_error(tmp_path: Path) -> None:
    async def broken(rows: list[list[int]], deadline: float | None) -> np.ndarray:
        raise ValueError("onnxruntime said no")

    async def body(client: EngineClient, server: EngineServer, path: str) -> None:
        with pytest.raises(RuntimeError, match="onnxruntime said no"):
            await client.infer("m", 3, [[1]], None)
        assert await client.status() == {"m": [3]}  # the connection and the engine side still serve

    _run(broken, body, tmp_path)


def test_a_cancelled_request_is_cancelled_in_the_engine_process(tmp_path: Path) -> None:
    seen: list[str] = []

    async def slow(rows: list[list[int]], deadline: float | None) -> np.ndarray:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return np.zeros((1, 1), dtype=np.float32)

    async def body(client: EngineClient, server: EngineServer, path: str) -> None:
        task = asyncio.create_task(client.infer("m", 3, [[1]], None))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):
            if seen:
                break
            await asyncio.sleep(0.02)

    _run(slow, body, tmp_path)
    assert seen == ["cancelled"]


def test_a_lost_engine_process_fails_requests_with_503_then_reconnects(tmp_path: Path) -> None:
    async def slow(rows: list[list[int]], deadline: float | None) -> np.ndarray:
        await asyncio.sleep(30)
        return np.zeros((1, 1), dtype=np.float32)

    async def body(client: EngineClient, server: EngineServer, path: str) -> None:
        from miaohui.server.status import http_status

        task = asyncio.create_task(client.infer("m", 3, [[1]], None))
        await asyncio.sleep(0.2)
        await server.stop()  # what the worker sees when the engine process dies: the connection ends
        with pytest.raises(UnavailableError, match="lost the engine process") as err:
            await asyncio.wait_for(task, 5)
        assert http_status(err.value) == 503
        with pytest.raises(UnavailableError, match="not reachable"):
            await client.status()  # nobody listens on the socket now
        restarted = EngineServer(_Manager(_sums))
        await restarted.start(path)
        try:
            np.testing.assert_array_equal(await client.infer("m", 3, [[4, 5]], None), [[9, 2]])
        finally:
            await restarted.stop()

    _run(slow, body, tmp_path)


def test_shared_engine_needs_several_workers(tmp_path: Path) -> None:
    from miaohui.errors import ConfigError
    from miaohui.server.state import ServeSpec

    with pytest.raises(ConfigError, match="--shared-engine needs --workers 2 or more"):
        ServeSpec(tmp_path, workers=1, shared_engine=True)
    with pytest.raises(ConfigError, match="--workers 0 is not a process count"):
        ServeSpec(tmp_path, workers=0)
    assert ServeSpec(tmp_path, workers=2, shared_engine=True).engine_socket is None


class _Stream:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _LLM:
    """A causal LM stand-in: each admitted request gets two tokens, the second one finishing it; prompt ``[0]`` is
    refused (an InputError at admission) and prompt ``[9]`` fails while generating."""

    def __init__(self) -> None:
        self.streams: list[_Stream] = []

    def add(self, prompt_ids: list[int], params: Any, sink: Callable[[Any], None]) -> _Stream:
        from miaohui.errors import InputError
        from miaohui.generation.engine.client import TokenEvent

        if prompt_ids == [0]:
            raise InputError("prompt is empty", "send a prompt")
        stream = _Stream()
        self.streams.append(stream)
        loop = asyncio.get_running_loop()
        if prompt_ids == [9]:
            loop.call_soon(sink, QueueFullError("no KV blocks left", "retry later"))
            return stream
        n = len(prompt_ids)
        loop.call_soon(sink, TokenEvent(0, 7, "he", 1, None, n, 1))
        loop.call_soon(sink, TokenEvent(0, 8, "llo", 2, "stop", n, 2))
        return stream


class _Chat:
    """A served chat version stand-in: version 4 of ``llm``."""

    version = 4

    def __init__(self) -> None:
        self.client = _LLM()


class _ChatManager(_Manager):
    def __init__(self, answer: Answer) -> None:
        super().__init__(answer)
        self.served = _Chat()

    def chat(self, model: str, version: int | None = None) -> _Chat:
        return self.served

    def chat_states(self) -> list[Any]:
        return []


def test_generation_events_cross_as_typed_messages(tmp_path: Path) -> None:
    """Admission errors keep their class; a request's tokens arrive as :data:`TokenRow` tuples with the engine's
    fields, a failure while generating as a :class:`StreamError` that maps back to the same error class."""
    from miaohui.errors import InputError
    from miaohui.serving.engine_messages import RemoteError, StreamError
    from miaohui.serving.engine_process import remote_error

    async def main() -> None:
        path = str(tmp_path / "engine.sock")
        server = EngineServer(_ChatManager(_sums))  # type: ignore[arg-type]
        await server.start(path)
        client = EngineClient(path)
        got: dict[int, list[Any]] = {1: [], 2: []}
        try:
            with pytest.raises(InputError, match="prompt is empty"):
                await client.generate(5, "llm", [0], None, got[1].append)
            assert await client.generate(1, "llm", [4, 5, 6], None, got[1].append) == 4  # the version admitting it
            await client.generate(2, "llm", [9], None, got[2].append)
            for _ in range(100):
                if len(got[1]) == 2 and got[2]:
                    break
                await asyncio.sleep(0.01)
            assert await client.llm_status() == {}
            client.release(1)  # finished here: the connection's close below must not reach their sinks
            client.release(2)
        finally:
            await client.close()
            await server.stop()
        assert got[1] == [(1, 7, "he", 1, None, 3, 1), (1, 8, "llo", 2, "stop", 3, 2)]
        assert got[2] == [StreamError(2, RemoteError("QueueFullError", "no KV blocks left", "retry later"))]
        err = remote_error(got[2][0].error)
        assert isinstance(err, QueueFullError) and (err.message, err.fix) == ("no KV blocks left", "retry later")

    asyncio.run(main())


def test_the_priority_class_crosses_to_the_engine_process(tmp_path: Path) -> None:
    """:class:`Infer` and :class:`Generate` carry the worker's priority class (what its key gate set); the engine
    process queues by it: the rows' class is the one its batcher reads, and a real :class:`Scheduler` behind the
    engine side puts an interactive request ahead of bulk ones that were sent before it."""
    from miaohui.generation.engine.params import SamplingParams
    from miaohui.generation.engine.scheduler import Scheduler, SchedulerConfig
    from miaohui.priority import PRIORITY
    from miaohui.serving.engine_messages import Generate, Infer

    assert Infer(1, "m", 3, [[1]], None).priority == "interactive"  # a message without a class (an older worker)
    assert Generate(1, 1, "m", [1], SamplingParams()).priority == "interactive"
    seen: list[str] = []

    async def record(rows: list[list[int]], deadline: float | None) -> np.ndarray:
        seen.append(PRIORITY.get())  # what the engine side's batcher would read at enqueue
        return await _sums(rows, deadline)

    scheduler = Scheduler(SchedulerConfig(max_running_seqs=8, max_batched_tokens=64, max_prefill_seqs=1), [0])

    class _QueueingLLM(_LLM):
        def add(self, prompt_ids: list[int], params: Any, sink: Callable[[Any], None]) -> _Stream:
            scheduler.add(prompt_ids, params or SamplingParams())  # reads PRIORITY as the in-process path does
            return _Stream()

    async def main() -> None:
        path = str(tmp_path / "engine.sock")
        manager = _ChatManager(record)
        manager.served.client = _QueueingLLM()
        server = EngineServer(manager)  # type: ignore[arg-type]
        await server.start(path)
        client = EngineClient(path)
        try:
            token = PRIORITY.set("bulk")
            await client.infer("m", 3, [[1]], None)
            bulk = [await client.generate(sid, "llm", [1, 2], None, lambda item: None) for sid in (1, 2)]
            PRIORITY.reset(token)
            await client.infer("m", 3, [[1]], None)
            await client.generate(3, "llm", [3, 4], None, lambda item: None)
        finally:
            await client.close()
            await server.stop()
        assert bulk == [4, 4]
        assert seen == ["bulk", "interactive"]
        order = [scheduler.schedule().prefill[0].prompt_ids for _ in range(3)]  # one prompt per step
        assert order == [(3, 4), (1, 2), (1, 2)]  # the interactive one first, though sent last

    asyncio.run(main())
