"""The HTTP boundary every router shares (the raw-ASGI hot path, FastAPI routes, the OpenAI routes): one body
reader and one limit (8 MiB, 413), one disconnect watcher (499), the error response in KServe's or OpenAI's
shape from the one status table (:mod:`miaohui.server.status`), JSON (orjson where installed), per-request
deadlines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import Receive

from miaohui.errors import ClientDisconnectedError, InputError, PayloadTooLargeError
from miaohui.server import kserve
from miaohui.server.status import kserve_body, openai_body

T = TypeVar("T")
MAX_BODY_BYTES = 8 << 20
"""The largest request body any route takes (KServe tensors in JSON or Triton's binary extension need room)."""

try:  # orjson: ~8x faster JSON for the small bodies of the hot path; the standard library otherwise
    import orjson

    def dumps(doc: Any) -> bytes:
        return orjson.dumps(doc)

    loads: Callable[[bytes], Any] = orjson.loads
    JSON_ERRORS: tuple[type[Exception], ...] = (orjson.JSONDecodeError, UnicodeDecodeError)
except ImportError:  # pragma: no cover - orjson is a dependency

    def dumps(doc: Any) -> bytes:
        return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")

    loads = json.loads
    JSON_ERRORS = (json.JSONDecodeError, UnicodeDecodeError)


OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models")
"""Routes answered in OpenAI's error shape (``/v1/models/{m}`` too); every other route in KServe's."""


def is_openai_path(path: str) -> bool:
    return path in OPENAI_PATHS or path.startswith("/v1/models/")


def error_response(exc: BaseException, *, openai: bool = False) -> JSONResponse:
    """The one error response: the status of ``exc``'s row in :mod:`~miaohui.server.status`, in OpenAI's shape
    or KServe's."""
    code, body = openai_body(exc) if openai else kserve_body(exc)
    return JSONResponse(body, status_code=code)


async def receive_body(receive: Receive, length: str | None, encoding: str | None) -> bytes:
    """The request body from ASGI ``receive``, read no further than :data:`MAX_BODY_BYTES`: a body declared
    (``length``, the Content-Length header) or found bigger is refused as it arrives (413). ``encoding``: the
    Content-Encoding header; only identity is taken. A client gone before the body is complete: 499."""
    encoding = (encoding or "identity").strip().lower()
    if encoding != "identity":
        raise InputError(f"Content-Encoding {encoding!r} is not supported", "send the body uncompressed")
    too_big = PayloadTooLargeError(
        f"request body is larger than the limit of {MAX_BODY_BYTES} bytes", "send smaller batches"
    )
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise disconnected()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        if not msg.get("more_body", False):
            if not chunks:
                return chunk
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)


async def read_body(request: Request) -> bytes:
    """:func:`receive_body` for a FastAPI route."""
    headers = request.headers
    return await receive_body(request.receive, headers.get("content-length"), headers.get("content-encoding"))


async def read_json(request: Request) -> dict[str, Any]:
    return kserve.parse_json_object(await read_body(request))


def disconnected() -> ClientDisconnectedError:
    return ClientDisconnectedError("client disconnected", "nothing to do")


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (the batcher then drops it before compute; the
    generation engine aborts it) and raise :class:`~miaohui.errors.ClientDisconnectedError` (499).

    Once the body is read, the server's ``receive()`` returns only at disconnect (or after the response):
    one waiter instead of polling."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(receive())
    try:
        while True:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            if watcher.result().get("type") == "http.disconnect":
                task.cancel()
                raise disconnected()
            watcher = asyncio.ensure_future(receive())
    except BaseException:
        if not task.done():
            task.cancel()
        raise
    finally:
        if not watcher.done():
            watcher.cancel()


def timeout_ms(request: Request, body: dict[str, Any] | None = None) -> float | None:
    """Per-request deadline in ms: header ``X-Request-Timeout-Ms``, body ``timeout_ms``, or KServe
    ``parameters.timeout`` (µs, as Triton clients send it)."""
    return parse_timeout_ms(request.headers.get("x-request-timeout-ms"), body)


def parse_timeout_ms(header: str | None, body: dict[str, Any] | None) -> float | None:
    try:
        if header is not None:
            return float(header)
        if body is not None:
            if body.get("timeout_ms") is not None:
                return float(body["timeout_ms"])
            params = body.get("parameters") or {}
            if isinstance(params, dict) and params.get("timeout") is not None:
                return float(params["timeout"]) / 1000.0
    except (TypeError, ValueError):
        raise InputError(f"timeout {header or body!r} is not a number", "give milliseconds, e.g. 200") from None
    return None
