"""``miaohui serve --workers N --shared-engine``: one engine process batches for every HTTP worker.

Why: with ``--workers N`` alone each worker holds its own engines. On a GPU that is N CUDA contexts that
time-slice the device, each launching its own small batches: on the H200 six workers kept the GPU 99 % busy
with batches of 2–7 rows and p99 at 20 ms (docs/gpu.md). Here the HTTP workers parse, tokenize,
extract slots and answer; the rows of all of them go to one process that owns the engines, the dynamic
batcher and the warm-up, so batches form across workers and one context owns the GPU (vLLM's engine-core
split, Triton's single server process).

Layout (parent: :mod:`miaohui.server.workers`):

* the **engine process** loads the repository (:class:`~miaohui.serving.repository.ModelManager`, the usual
  version policy, warm-up and batcher) and serves :class:`EngineServer` on a Unix socket; the supervisor starts
  the HTTP workers only after it reported ready, and restarts it like a worker if it dies;
* each **HTTP worker** gets the socket's path in its ``ServeSpec`` and serves its models as remote versions
  (:class:`~miaohui.serving.served.ServedVersion` with an :class:`EngineClient`): manifest and tokenizer are read
  from the artifact, rows are sent to the engine process and the logits come back.

Protocol: length-prefixed pickles over the Unix socket (both ends are this program, started by the same
supervisor; the socket lives in a private temporary directory) of the typed messages of
:mod:`miaohui.serving.engine_messages`: requests :class:`Infer`, :class:`Cancel`, :class:`Status`, ...;
replies :class:`Ok` or :class:`Err` with the request's id. Errors keep their class across the hop (a full queue
is still a 429, a passed deadline a 504); a lost engine process fails the requests in flight with 503 and the
next request reconnects. :class:`Infer` and :class:`Generate` carry the request's priority class (the worker's
:data:`~miaohui.priority.PRIORITY`, set by its API key gate); the engine process sets it again around the batcher's
and the scheduler's queueing, so interactive requests wait ahead of bulk ones here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np

from miaohui import errors
from miaohui.errors import MiaohuiError, UnavailableError
from miaohui.priority import PRIORITY
from miaohui.serving.engine_messages import (
    REPLY_TYPES,
    REQUEST_TYPES,
    Abort,
    Cancel,
    ChatFacts,
    ChatStatus,
    EngineReply,
    EngineRequest,
    Err,
    Generate,
    Infer,
    ItemSink,
    LlmStatus,
    Load,
    Ok,
    OkValue,
    RemoteError,
    Status,
    StreamError,
    TokenBatch,
    TokenRow,
    Unload,
)

if TYPE_CHECKING:
    from miaohui.generation.engine.client import RequestStream, Sink, TokenEvent
    from miaohui.generation.engine.params import SamplingParams
    from miaohui.serving.repository import ModelManager

log = logging.getLogger("miaohui.engine_process")

_HEADER = struct.Struct("!I")
_FLUSH_BYTES = 1 << 20
"""Wait for the socket to drain once this much is buffered (a slow reader must not grow memory without bound)."""


def _frame(message: EngineRequest | EngineReply) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


async def _unpickle(reader: asyncio.StreamReader) -> object:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))  # our own processes, over a private socket


async def _read_request(reader: asyncio.StreamReader) -> EngineRequest:
    """The next message from a worker; ConnectionError (the connection is dropped) for anything else."""
    message = await _unpickle(reader)
    if not isinstance(message, REQUEST_TYPES):
        raise ConnectionError(f"a worker sent {type(message).__name__}, not an engine request")
    return message


async def _read_reply(reader: asyncio.StreamReader) -> EngineReply:
    """The next message from the engine process; ConnectionError for anything else."""
    message = await _unpickle(reader)
    if not isinstance(message, REPLY_TYPES):
        raise ConnectionError(f"the engine process sent {type(message).__name__}, not a reply")
    return message


def error_fields(exc: BaseException) -> RemoteError:
    """An error as it crosses the socket: miaohui error class (or ``RuntimeError``), message, fix."""
    if isinstance(exc, MiaohuiError):
        return RemoteError(type(exc).__name__, exc.message, exc.fix)
    return RemoteError("RuntimeError", repr(exc), None)


def remote_error(error: RemoteError) -> Exception:
    """The engine process's error as the same miaohui error class (HTTP/gRPC status follows the class)."""
    cls = getattr(errors, error.kind, None)
    if isinstance(cls, type) and issubclass(cls, MiaohuiError):
        return cls(error.message, error.fix)
    return RuntimeError(f"engine process: {error.message}")


async def _send(writer: asyncio.StreamWriter, message: EngineRequest | EngineReply) -> None:
    if writer.is_closing():
        return
    writer.write(_frame(message))
    if writer.transport.get_write_buffer_size() > _FLUSH_BYTES:
        await writer.drain()


# ---------------------------------------------------------------------------------------------- engine side


class EngineServer:
    """Answers the HTTP workers' rows with the versions of ``manager`` (run in the engine process)."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=path)

    async def stop(self) -> None:
        """Stop listening and close the workers' connections (their requests in flight fail with 503)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    def status(self) -> dict[str, list[int]]:
        """The versions that are ready, by model."""
        return {s.name: sorted(v for v, served in s.versions.items() if served.ready) for s in self.manager.states()}

    def llm_status(self) -> ChatStatus:
        """The chat versions that are ready, by model and version: their vocabulary and context length."""
        return {
            s.name: {v: ChatFacts(c.vocab, c.max_model_len) for v, c in s.versions.items() if c.ready}
            for s in self.manager.chat_states()
        }

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: dict[int, asyncio.Task[None]] = {}
        streams = _GenerationStreams(writer)
        self._connections.add(writer)
        try:
            while True:
                message = await _read_request(reader)
                match message:
                    case Infer():
                        tasks[message.rid] = asyncio.create_task(self._infer(writer, tasks, message))
                    case Cancel(rid):
                        task = tasks.pop(rid, None)
                        if task is not None:
                            task.cancel()
                    case Status(rid):
                        await _send(writer, Ok(rid, self.status()))
                    case LlmStatus(rid):
                        await _send(writer, Ok(rid, self.llm_status()))
                    case Generate():
                        await _send(writer, self._generate(streams, message))
                    case Abort(sid):
                        streams.abort(sid)
                    case Load() | Unload():
                        tasks[message.rid] = asyncio.create_task(self._repository(writer, tasks, message))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went away: its requests are dropped below
        finally:
            for task in tasks.values():
                task.cancel()
            streams.abort_all()
            self._connections.discard(writer)
            writer.close()

    def _generate(self, streams: _GenerationStreams, request: Generate) -> Ok | Err:
        """Admit a worker's generation request on the model's serving version (its tokens follow in
        :class:`TokenBatch` frames); the reply names the version."""
        token = PRIORITY.set(request.priority)  # the scheduler queues the request by the worker's class
        try:
            served = self.manager.chat(request.model, request.version)
            stream = served.client.add(request.prompt_ids, request.params, sink=streams.sink(request.sid))
        except MiaohuiError as exc:
            return Err(request.rid, error_fields(exc))
        finally:
            PRIORITY.reset(token)
        streams.add(request.sid, stream)
        return Ok(request.rid, served.version)

    async def _repository(
        self, writer: asyncio.StreamWriter, tasks: dict[int, asyncio.Task[None]], request: Load | Unload
    ) -> None:
        """A worker's ``POST /v2/repository/models/<m>/load|unload``, done here where the models run."""
        reply: Ok | Err
        try:
            if isinstance(request, Load):
                await self.manager.load(request.model)
            else:
                await self.manager.unload(request.model)
            reply = Ok(request.rid, None)
        except asyncio.CancelledError:
            return
        except Exception as exc:
            if not isinstance(exc, MiaohuiError):
                log.exception("%s of %s failed", type(request).__name__.lower(), request.model)
            reply = Err(request.rid, error_fields(exc))
        finally:
            tasks.pop(request.rid, None)
        await _send(writer, reply)

    async def _infer(self, writer: asyncio.StreamWriter, tasks: dict[int, asyncio.Task[None]], request: Infer) -> None:
        from miaohui.serving.served import deadline_from_ms

        rid, model, version = request.rid, request.model, request.version
        PRIORITY.set(request.priority)  # this task's own context: the batcher queues its rows by the worker's class
        reply: Ok | Err
        try:
            out = await self.manager.get(model, version).run_rows(request.rows, deadline_from_ms(request.timeout_ms))
            reply = Ok(rid, out)
        except asyncio.CancelledError:
            return  # the worker cancelled (client gone): the rows were dropped from the queue
        except Exception as exc:  # an engine failure (not a MiaohuiError): the worker answers it as a server error
            if not isinstance(exc, MiaohuiError):
                log.exception("model %s v%d failed a request", model, version)
            reply = Err(rid, error_fields(exc))
        finally:
            tasks.pop(rid, None)
        await _send(writer, reply)


class _GenerationStreams:
    """One worker connection's generation requests in the engine process. Their events are collected as the engine
    publishes them and sent in one :class:`TokenBatch` frame per event-loop turn (one per decode step, not one
    per token) of :data:`TokenRow` tokens, and :class:`StreamError` for a request that failed."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.streams: dict[int, RequestStream] = {}
        self.tokens: list[TokenRow] = []
        self.errors: list[StreamError] = []

    def add(self, sid: int, stream: RequestStream) -> None:
        self.streams[sid] = stream

    def sink(self, sid: int) -> Sink:
        def push(item: TokenEvent | BaseException) -> None:
            if isinstance(item, BaseException):
                self.streams.pop(sid, None)
                self.errors.append(StreamError(sid, error_fields(item)))
            else:
                if item.finish_reason is not None:
                    self.streams.pop(sid, None)
                self.tokens.append(
                    (sid, item.token_id, item.text, item.index, item.finish_reason, item.prompt_tokens,
                     item.completion_tokens)
                )  # fmt: skip
            if len(self.tokens) + len(self.errors) == 1:
                asyncio.get_running_loop().call_soon(self.flush)

        return push

    def flush(self) -> None:
        tokens, errors, self.tokens, self.errors = self.tokens, self.errors, [], []
        if (tokens or errors) and not self.writer.is_closing():
            self.writer.write(_frame(TokenBatch(tokens, errors)))

    def abort(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        if stream is not None:
            stream.abort()

    def abort_all(self) -> None:
        """The worker went away: its requests stop generating."""
        for sid in list(self.streams):
            self.abort(sid)


# ---------------------------------------------------------------------------------------------- worker side


class EngineClient:
    """One HTTP worker's connection to the engine process (opened on first use, reopened after a loss)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[OkValue]] = {}
        self._ids = itertools.count(1)
        self._lock: asyncio.Lock | None = None
        self._reader: asyncio.Task[None] | None = None
        self._generation_ids = itertools.count(1)
        self._token_sinks: dict[int, ItemSink] = {}
        """Generation requests by id: called with each :data:`TokenRow` / :class:`StreamError` for them."""

    async def _connection(self) -> asyncio.StreamWriter:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            return writer
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._writer is None or self._writer.is_closing():
                try:
                    reader, writer = await asyncio.open_unix_connection(self.path)
                except OSError as exc:
                    raise UnavailableError(
                        f"the engine process ({self.path}) is not reachable: {exc.strerror or exc}",
                        "retry shortly: the supervisor restarts a failed engine process (see the server log)",
                    ) from None
                self._writer = writer
                self._reader = asyncio.get_running_loop().create_task(self._read_replies(reader, writer))
            return self._writer

    async def _read_replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                message = await _read_reply(reader)
                if isinstance(message, TokenBatch):
                    sinks = self._token_sinks
                    for row in message.tokens:
                        sink = sinks.get(row[0])
                        if sink is not None:
                            sink(row)
                    for failed in message.errors:
                        sink = sinks.get(failed.sid)
                        if sink is not None:
                            sink(failed)
                    continue
                future = self._pending.pop(message.rid, None)
                if future is None or future.done():
                    continue
                if isinstance(message, Ok):
                    future.set_result(message.value)
                elif isinstance(message, Err):
                    future.set_exception(remote_error(message.error))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            lost, self._pending = self._pending, {}
            sinks, self._token_sinks = self._token_sinks, {}
            for sink in sinks.values():  # generation requests in flight end with the same 503
                sink(StreamError(0, RemoteError("UnavailableError", "lost the engine process while generating",
                                                "retry: the supervisor restarts it (see the server log)")))  # fmt: skip
            for future in lost.values():
                if not future.done():
                    future.set_exception(
                        UnavailableError(
                            "lost the engine process while the request was in flight",
                            "retry: the supervisor restarts it (see the server log)",
                        )
                    )

    async def _call(self, request: Callable[[int], EngineRequest]) -> OkValue:
        """Send ``request(rid)`` with a fresh ``rid`` and wait for its reply's value."""
        writer = await self._connection()
        rid = next(self._ids)
        future: asyncio.Future[OkValue] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        await _send(writer, request(rid))
        if writer.is_closing():  # lost before or while sending: the reader's sweep may have missed this request
            self._pending.pop(rid, None)
            raise UnavailableError(
                "lost the engine process before the request was sent",
                "retry: the supervisor restarts it (see the server log)",
            )
        try:
            return await future
        except asyncio.CancelledError:
            if self._pending.pop(rid, None) is not None:
                await asyncio.shield(_send(writer, Cancel(rid)))
            raise

    async def infer(self, model: str, version: int, rows: list[list[int]], deadline: float | None) -> np.ndarray:
        """The model version's output rows for ``rows`` (batched with every worker's rows in the engine process).
        ``deadline`` (``time.monotonic()``) travels as the time left, the request's priority class with it."""
        timeout_ms = None if deadline is None else max(0.001, (deadline - time.monotonic()) * 1000.0)
        priority = PRIORITY.get()
        out = await self._call(lambda rid: Infer(rid, model, version, rows, timeout_ms, priority))
        assert isinstance(out, np.ndarray)
        return out

    async def status(self) -> dict[str, list[int]]:
        """Ready versions by model, as the engine process sees them."""
        return cast("dict[str, list[int]]", await self._call(Status))

    async def llm_status(self) -> ChatStatus:
        """The engine process's chat versions (:meth:`EngineServer.llm_status`)."""
        return cast("ChatStatus", await self._call(LlmStatus))

    async def load(self, model: str) -> None:
        """Load (or reload) ``model`` in the engine process; returns once its new versions serve there."""
        await self._call(lambda rid: Load(rid, model))

    async def unload(self, model: str) -> None:
        """Unload ``model`` in the engine process; returns once its running streams finished."""
        await self._call(lambda rid: Unload(rid, model))

    async def generate(
        self,
        sid: int,
        model: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: ItemSink,
        version: int | None = None,
    ) -> int:
        """Start generation request ``sid`` on ``model``'s serving version (or on ``version``) in the engine
        process; returns that version once admitted (raises its InputError / QueueFullError otherwise). ``sink``
        gets the request's items until one finishes it. The request's priority class goes with it."""
        self._token_sinks[sid] = sink
        priority = PRIORITY.get()
        try:
            served = await self._call(lambda rid: Generate(rid, sid, model, prompt_ids, params, version, priority))
        except BaseException:
            self._token_sinks.pop(sid, None)
            raise
        return cast(int, served)

    def new_generation_id(self) -> int:
        """An id for a generation request, unique on this connection whichever model it is for."""
        return next(self._generation_ids)

    def release(self, sid: int) -> None:
        """Generation request ``sid`` is finished here: forget its sink."""
        self._token_sinks.pop(sid, None)

    def abort(self, sid: int) -> None:
        """Stop generation request ``sid`` in the engine process (no reply)."""
        self._token_sinks.pop(sid, None)
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(_frame(Abort(sid)))

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
