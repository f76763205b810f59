"""What the load generator talks to. Each target turns one text into one request and says how it ended.

``send(text)`` never raises: it returns ``"ok"`` or an error label, so every request that was sent is
accounted for. Labels are HTTP-style status codes (``"429"``, ``"503"``, ``"504"``, ``"400"``, ...) or
``"connection"`` (refused, reset, closed mid-response), ``"timeout"`` (no answer within the client
timeout) and ``"bad_body"`` (a 200 whose body is not the expected answer). gRPC status codes are mapped
to the HTTP codes the server uses for the same condition (RESOURCE_EXHAUSTED → 429, ...); gRPC cannot
tell a refused connection from a server's UNAVAILABLE, so both count as ``"503"`` there.

Targets:

* ``http``    — ``POST /v1/intent {"text": ...}`` over a small keep-alive HTTP/1.1 client on asyncio
                streams (requests are serialized once per text; a pool of up to ``max_connections``).
                Its cost, measured against a trivial asyncio server on the H200 host: ~28 µs of client
                CPU per request, so one process drives ~34k requests/s and 2 processes ~81k/s
                (on the 2-core CPU box, against the same server: this client 25-30 µs per request,
                httpx.AsyncClient over 1 ms).
* ``v2-http`` — ``POST /v2/models/{model}/infer`` with a KServe v2 JSON body (``TEXT``, BYTES).
* ``grpc``    — KServe v2 ``ModelInfer`` with ``tritonclient``'s protobufs on a ``grpc.aio`` channel.
* ``engine``  — no server: tokenize + ``Engine.infer`` on a batch of one, in worker threads.
* ``chat``    — streamed OpenAI completions: :mod:`miaohui.bench.chat` (made by :func:`miaohui.bench.load.make_target`).
"""

from __future__ import annotations

import abc
import asyncio
import json
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from miaohui.errors import ConfigError

TargetKind = Literal["http", "v2-http", "grpc", "engine", "chat"]
TARGETS: tuple[str, ...] = ("http", "v2-http", "grpc", "engine", "chat")

_GRPC_TO_HTTP = {
    "RESOURCE_EXHAUSTED": "429",
    "DEADLINE_EXCEEDED": "504",
    "UNAVAILABLE": "503",
    "INVALID_ARGUMENT": "400",
    "NOT_FOUND": "404",
    "INTERNAL": "500",
    "UNKNOWN": "500",
    "UNIMPLEMENTED": "501",
    "CANCELLED": "cancelled",
}


@dataclass(frozen=True)
class TargetSpec:
    """How to reach the system under test (picklable: worker processes rebuild the target from it)."""

    kind: TargetKind
    url: str = "http://127.0.0.1:8000"
    grpc_url: str = "127.0.0.1:8001"
    model: str = "intent"
    engine: str | None = None
    """Engine artifact directory (target ``engine``)."""
    engine_threads: int | None = None
    timeout_s: float = 30.0
    max_connections: int = 64
    """Connection (http) or worker-thread (engine) pool size; the load runner sets it to the concurrency."""
    endpoint: str = "chat"
    """Target ``chat``: ``chat`` (``/v1/chat/completions``) or ``completions`` (``/v1/completions``)."""
    max_tokens: int = 64
    """Target ``chat``: ``max_tokens`` of every request."""
    ignore_eos: bool = True
    """Target ``chat``: send ``ignore_eos: true`` (miaohui, vLLM, llama.cpp), so every answer is ``max_tokens`` long."""
    extra_body: str | None = None
    """Target ``chat``: a JSON object merged into every request body (server-specific fields)."""


class Target(abc.ABC):
    """One system under test. ``open`` before the first ``send``; ``close`` at the end."""

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect or load; called once, before timing starts."""

    @abc.abstractmethod
    async def send(self, text: str) -> str:
        """Send one request and wait for its answer: ``"ok"`` or an error label. Never raises."""

    async def send_detailed(self, text: str) -> tuple[str, Any]:
        """:meth:`send`, plus this request's record for the report (``None`` for targets that keep none)."""
        return await self.send(text), None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections, threads, engines."""

    def reset_stats(self) -> None:  # noqa: B027 - optional hook
        """Forget what :meth:`stats` gathered so far (called when the warm-up ends)."""

    def stats(self) -> dict[str, Any]:
        """Target-specific figures for the report (e.g. the engine's tokenize/infer split). Lists of
        samples are concatenated across worker processes; other values are taken from the first."""
        return {}


def make_target(spec: TargetSpec) -> Target:
    if spec.kind == "http":
        return RawHttpTarget(spec.url, "/v1/intent", lambda t: {"text": t, "model": spec.model}, b'"intent"', spec)
    if spec.kind == "v2-http":

        def body(text: str) -> dict[str, Any]:
            return {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [text]}]}

        return RawHttpTarget(spec.url, f"/v2/models/{spec.model}/infer", body, b'"outputs"', spec)
    if spec.kind == "grpc":
        return GrpcTarget(spec)
    if spec.kind == "engine":
        return EngineTarget(spec)
    raise ConfigError(f"unknown bench target {spec.kind!r}", f"use one of {', '.join(TARGETS)}")


# ---------------------------------------------------------------------------------------------- HTTP


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class RawHttpTarget(Target):
    """Keep-alive HTTP/1.1 POSTs on asyncio streams. Far less client CPU per request than httpx, so the
    client is not what limits the measured throughput (the report shows client CPU and loop lag)."""

    def __init__(self, url: str, path: str, body: Any, expect: bytes, spec: TargetSpec) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(
                f"bench URL {url!r} is not a plain http://host:port URL",
                "give e.g. --url http://127.0.0.1:8000 (https is not supported by the load client)",
            )
        self.host, self.port = parts.hostname, parts.port or 80
        self.path, self._body, self._expect = parts.path.rstrip("/") + path, body, expect
        self.timeout_s, self.max_connections = spec.timeout_s, max(1, spec.max_connections)
        self._requests: dict[str, bytes] = {}
        self._idle: list[_Conn] = []
        self._waiters: deque[asyncio.Future[_Conn | None]] = deque()
        self._open = 0

    def request_bytes(self, text: str) -> bytes:
        raw = self._requests.get(text)
        if raw is None:
            payload = json.dumps(self._body(text), ensure_ascii=False).encode()
            head = (
                f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            )
            raw = self._requests[text] = head.encode() + payload
        return raw

    async def send(self, text: str) -> str:
        request = self.request_bytes(text)
        conn: _Conn | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = await self._acquire()
                conn.writer.write(request)
                status, body, keep = await _read_response(conn.reader)
        except TimeoutError:
            if conn is not None:
                self._discard(conn)
            return "timeout"
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
            if conn is not None:
                self._discard(conn)
            return "connection"
        if keep:
            self._release(conn)
        else:
            self._discard(conn)
        if status != 200:
            return str(status)
        return "ok" if self._expect in body else "bad_body"

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def _acquire(self) -> _Conn:
        """An idle connection, a new one while under ``max_connections``, or wait for one to come back."""
        while True:
            if self._idle:
                return self._idle.pop()
            if self._open < self.max_connections:
                break
            waiter: asyncio.Future[_Conn | None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            conn = await waiter
            if conn is not None:
                return conn  # handed over by _release; None means a slot freed up: try again
        self._open += 1
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except BaseException:
            self._open -= 1
            self._wake(None)
            raise
        return _Conn(reader, writer)

    def _wake(self, conn: _Conn | None) -> bool:
        """Hand ``conn`` (or news of a free slot) to the first caller still waiting."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    def _release(self, conn: _Conn) -> None:
        if not self._wake(conn):
            self._idle.append(conn)

    def _discard(self, conn: _Conn) -> None:
        conn.close()
        self._open -= 1
        self._wake(None)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """Status, body and whether the connection stays open. Content-Length and chunked bodies."""
    head = await reader.readuntil(b"\r\n\r\n")
    first, _, rest = head.partition(b"\r\n")
    status = int(first.split(b" ", 2)[1])
    length, chunked, keep = -1, False, not first.startswith(b"HTTP/1.0")
    for line in rest.lower().split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            keep = b"close" not in value
    if chunked:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(data[:-2])
        return status, b"".join(parts), keep
    if length < 0:
        return status, await reader.read(), False
    return status, await reader.readexactly(length), keep


# ---------------------------------------------------------------------------------------------- gRPC


class GrpcTarget(Target):
    """KServe v2 ``ModelInfer`` on a ``grpc.aio`` channel; the request protobuf is built once per text."""

    def __init__(self, spec: TargetSpec) -> None:
        self.spec = spec
        self._requests: dict[str, Any] = {}
        self._channel: Any = None
        self._stub: Any = None

    async def open(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self._channel = grpc.aio.insecure_channel(self.spec.grpc_url, options=opts)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def request(self, text: str) -> Any:
        req = self._requests.get(text)
        if req is None:
            from tritonclient.grpc import service_pb2

            req = service_pb2.ModelInferRequest(model_name=self.spec.model)
            tensor = req.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
            tensor.contents.bytes_contents.append(text.encode())
            self._requests[text] = req
        return req

    async def send(self, text: str) -> str:
        import grpc

        try:
            reply = await self._stub.ModelInfer(self.request(text), timeout=self.spec.timeout_s)
        except grpc.aio.AioRpcError as exc:
            name = exc.code().name
            return (
                "timeout"
                if name == "DEADLINE_EXCEEDED" and exc.details() == "Deadline Exceeded"
                else _GRPC_TO_HTTP.get(name, f"grpc:{name}")
            )
        except Exception:
            return "connection"
        return "ok" if reply.outputs or reply.raw_output_contents else "bad_body"

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


# ---------------------------------------------------------------------------------------------- engine


class EngineTarget(Target):
    """The bare engine: tokenize one text and run a batch of one, in a pool of worker threads."""

    def __init__(self, spec: TargetSpec) -> None:
        if not spec.engine:
            raise ConfigError("target 'engine' needs an engine artifact", "pass --engine PATH (a version directory)")
        self.spec = spec
        self._pool: ThreadPoolExecutor | None = None
        self._engine: Any = None
        self._tok: Any = None
        self._lock = threading.Lock()
        self.tokenize_s: list[float] = []
        self.infer_s: list[float] = []

    async def open(self) -> None:
        from miaohui.engines.loader import load_engine
        from miaohui.nlp.tokenizer import TextTokenizer

        path = Path(self.spec.engine or "")
        self._engine = load_engine(path, threads=self.spec.engine_threads)
        manifest = self._engine.manifest
        if not manifest.tokenizer_file:
            raise ConfigError(
                f"{path} has no tokenizer (task {manifest.task})",
                "bench an intent/encoder text artifact, or use a server target",
            )
        max_len = manifest.max_length or 512
        self._tok = TextTokenizer.from_file(path / manifest.tokenizer_file, max_len)
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.spec.max_connections), thread_name_prefix="bench")

    def _infer_one(self, text: str) -> str:
        from miaohui.nlp.tokenizer import pad_batch, truncate_ids

        t0 = time.perf_counter()
        ids, mask = pad_batch([truncate_ids(self._tok.token_ids([text])[0], self._tok.max_length)], self._tok.pad_id)
        feeds = {"input_ids": ids, "attention_mask": mask}
        for name in self._engine.input_names:
            feeds.setdefault(name, ids * 0)
        t1 = time.perf_counter()
        self._engine.infer(feeds)
        t2 = time.perf_counter()
        with self._lock:
            self.tokenize_s.append(t1 - t0)
            self.infer_s.append(t2 - t1)
        return "ok"

    async def send(self, text: str) -> str:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._infer_one, text)
        except Exception as exc:
            return f"engine:{type(exc).__name__}"

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._engine is not None:
            self._engine.close()

    def stats(self) -> dict[str, Any]:
        m = self._engine.manifest if self._engine is not None else None
        with self._lock:
            return {
                "engine_path": self.spec.engine,
                "engine_backend": m.backend if m else None,
                "engine_precision": m.precision if m else None,
                "tokenize_s": list(self.tokenize_s),
                "infer_s": list(self.infer_s),
            }

    def reset_stats(self) -> None:
        with self._lock:
            self.tokenize_s.clear()
            self.infer_s.clear()
