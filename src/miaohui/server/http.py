"""HTTP: KServe v2 / Open Inference Protocol, ``POST /v1/intent``, repository control, health, statistics,
``/metrics``.

KServe inference takes JSON tensors and Triton's binary tensor extension (what ``tritonclient.http`` sends by
default; see :mod:`miaohui.server.kserve`), and answers with binary outputs when the request asks for them.
Every error is an explicit status (the table in :mod:`miaohui.server.status`) with a JSON ``{"error": message}``
body (KServe's error format), or OpenAI's error body on the OpenAI routes. A request is either answered or
rejected (400/404/413/429/500/503/504); a client that disconnects while its request is queued has it dropped
before compute (499 in the metrics).

The two inference routes, ``POST /v1/intent`` and ``POST /v2/models/{m}[/versions/{v}]/infer``, are the hot
path: :class:`MiaohuiApp` answers them straight from ASGI (:class:`HotPaths`), without FastAPI's middleware
stack, routing, dependency solving and Response objects, with orjson where it is installed. Every other route
is plain FastAPI.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from miaohui import __version__
from miaohui.errors import InputError, MiaohuiError, ModelNotFoundError
from miaohui.server import kserve
from miaohui.server.auth import GENERATING_PATHS, HttpGate
from miaohui.server.embeddings_api import embeddings_router
from miaohui.server.http_io import (
    JSON_ERRORS,
    dumps,
    error_response,
    is_openai_path,
    loads,
    parse_timeout_ms,
    read_body,
    receive_body,
    until_disconnect,
)
from miaohui.server.metrics import ModelStateCollector
from miaohui.server.openai_api import openai_router
from miaohui.server.state import ServerState, check_model_control
from miaohui.server.status import kserve_body, reason
from miaohui.serving.served import ServedVersion, deadline_from_ms

T = TypeVar("T")
logger = logging.getLogger("miaohui.server")


def create_app(state: ServerState) -> FastAPI:
    app = MiaohuiApp(title="miaohui", version=__version__, docs_url="/docs", redoc_url=None)
    app.state.miaohui = state
    hot = app.hot = HotPaths(state)
    manager, metrics = state.manager, state.metrics
    dialogue = state.dialogue
    if state.auth is not None:
        generating = GENERATING_PATHS + (("/v1/dialogue/",) if dialogue is not None and dialogue.generates else ())
        app.gate = HttpGate(
            state.auth, lambda who, model, code, why: metrics.refused(who, model, "http", code, why), generating
        )
    with contextlib.suppress(ValueError):  # already registered when an app is built twice on one Metrics
        metrics.register(
            ModelStateCollector(
                lambda: [
                    (st.name, v.version, v.ready, v.start_timings() if v.ready else {})
                    for st in manager.all_states()  # encoders and chat models
                    for v in st.versions.values()
                ]
            )
        )

    def encoders() -> list[str]:
        pipelines = dialogue.model_names() if dialogue is not None else []
        return [s.name for s in manager.states() if s.versions] + pipelines

    delegate = dialogue.chat_delegate if dialogue is not None else None
    app.include_router(openai_router(manager, metrics, other_models=encoders, chat_delegate=delegate))
    if dialogue is not None or state.shadow is not None:
        from miaohui.server.dialogue_api import dialogue_router, shadow_router

        if dialogue is not None:
            app.include_router(dialogue_router(dialogue))
        if state.shadow is not None:
            app.include_router(shadow_router(state.shadow))

    app.include_router(embeddings_router(manager, metrics))

    # Errors that leave a route (or never reach one: an unknown path, a bad method, FastAPI's validation) are
    # answered here, in OpenAI's shape on the OpenAI routes and KServe's elsewhere, from the one status table.
    @app.exception_handler(MiaohuiError)
    async def _miaohui_error(request: Request, exc: MiaohuiError) -> JSONResponse:
        return error_response(exc, openai=is_openai_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        error = InputError(f"invalid request at {where}: {first.get('msg', 'bad value')}")
        return error_response(error, openai=is_openai_path(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if not is_openai_path(request.url.path):
            return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug in a route: 500 for this request, logged with its traceback (the server goes on)."""
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(exc, openai=is_openai_path(request.url.path))

    # ------------------------------------------------------------------ health & metadata

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        ok = manager.ready and state.listening and not state.shutting_down
        body: dict[str, Any] = {"ready": ok}
        if state.workers > 1:  # which worker answered (each reports ready only once its own models are warm)
            body |= {"worker": state.worker, "workers": state.workers, "pid": os.getpid()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v2")
    async def server_metadata() -> dict[str, Any]:
        return {"name": "miaohui", "version": __version__, "extensions": ["model_repository", "statistics"]}

    # registered before /v2/models/{model}, which would otherwise take "stats" for a model name
    @app.get("/v2/models/stats")
    async def all_statistics() -> dict[str, Any]:
        rows = [metrics.model_stats(s.name, v, _aliases(s.name)) for s in manager.states() for v in sorted(s.versions)]
        return {"model_stats": rows}

    @app.get("/v2/models/{model}/stats")
    @app.get("/v2/models/{model}/versions/{version}/stats")
    async def model_statistics(model: str, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics extension (both interfaces of a model, ``M`` and ``M-raw``, count together)."""
        base = kserve.split_name(model)[0]
        served = manager.get(base, version)
        loaded = [v for s in manager.states() if s.name == base for v in sorted(s.versions)]
        chosen = [served.version] if version else loaded
        return {"model_stats": [metrics.model_stats(base, v, _aliases(base)) for v in chosen]}

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(model: str, version: str | None = None) -> dict[str, Any]:
        return kserve.model_metadata(manager, model, version)

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str | None = None) -> Response:
        try:
            served = manager.version(kserve.split_name(model)[0], version)
        except ModelNotFoundError:
            return JSONResponse({"name": model, "ready": False}, status_code=404)
        return JSONResponse({"name": model, "ready": served.ready}, status_code=200 if served.ready else 503)

    # ------------------------------------------------------------------ repository

    @app.post("/v2/repository/index")
    async def repository_index() -> list[dict[str, str]]:
        return manager.index()

    @app.post("/v2/repository/models/{model}/load")
    async def load_model(model: str, request: Request) -> dict[str, Any]:
        check_model_control(state, model)
        body = await read_body(request)
        if body.strip():  # tritonclient sends {"parameters": {...}} only for inline config or files
            params = kserve.parse_json_object(body).get("parameters") or {}
            kserve.check_load_parameters(list(params) if isinstance(params, dict) else ["parameters"])
        st = await manager.load(model)
        return {"name": model, "versions": sorted(st.versions), "state": st.state}

    @app.post("/v2/repository/models/{model}/unload")
    async def unload_model(model: str) -> dict[str, Any]:
        check_model_control(state, model)
        await manager.unload(model)
        return {"name": model, "state": "UNAVAILABLE"}

    # ------------------------------------------------------------------ inference

    # The inference routes are answered by HotPaths before routing (see MiaohuiApp); these are their
    # entries in the OpenAPI document, and they answer the same way should a request reach the router.
    @app.post("/v2/models/{model}/infer")
    @app.post("/v2/models/{model}/versions/{version}/infer")
    async def infer(model: str, request: Request, version: str | None = None) -> Response:
        """KServe v2 inference (JSON tensors or Triton's binary tensor extension)."""
        return await _captured(lambda send: hot.infer(request.scope, request.receive, send, model, version))

    @app.post("/v1/intent")
    async def intent(request: Request) -> Response:
        """``{"text": ...}`` or ``{"texts": [...]}`` → intent, confidence, candidate, out_of_scope, slots, model,
        version."""
        return await _captured(lambda send: hot.intent(request.scope, request.receive, send))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _intent_texts(body: dict[str, Any]) -> tuple[list[str], bool]:
    if "text" in body and "texts" in body:
        raise InputError("give either 'text' or 'texts', not both", 'send {"text": "..."} or {"texts": [...]}')
    if "text" in body:
        if not isinstance(body["text"], str):
            raise InputError(f"'text' must be a string, got {type(body['text']).__name__}", 'send {"text": "..."}')
        return [body["text"]], True
    texts = body.get("texts")
    if not isinstance(texts, list) or not texts:
        raise InputError(
            "missing 'text' (a string) or 'texts' (a non-empty list of strings)",
            'send {"text": "查社保"} or {"texts": ["查社保", "hi"]}',
        )
    if len(texts) > kserve.MAX_TEXTS:
        raise InputError(f"{len(texts)} texts in one request; the limit is {kserve.MAX_TEXTS}", "split the batch")
    if not all(isinstance(t, str) for t in texts):
        raise InputError("every item of 'texts' must be a string", "send a list of strings")
    return texts, False


def _aliases(model: str) -> set[str]:
    """The request-level names of a repository model: ``M`` and ``M-raw``."""
    return {model, model + kserve.RAW_SUFFIX}


def _infer_response(body: bytes, header_length: int | None) -> Response:
    if header_length is None:
        return Response(body, media_type="application/json")
    headers = {kserve.INFERENCE_HEADER: str(header_length)}
    return Response(body, media_type="application/octet-stream", headers=headers)


# ---------------------------------------------------------------------------------------------- hot path

_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_JSON_TYPE = (b"content-type", b"application/json")
_BINARY_TYPE = (b"content-type", b"application/octet-stream")
_BINARY_HEADER = kserve.INFERENCE_HEADER.lower().encode()


class MiaohuiApp(FastAPI):
    """FastAPI whose inference routes are answered by :class:`HotPaths` before the middleware stack."""

    hot: HotPaths | None = None
    gate: HttpGate | None = None
    """API keys (``--api-keys``): checked before any route; None: an open server."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.gate is not None and scope["type"] == "http":
            admitted = await self.gate.admit(scope, receive, send)
            if admitted is None:
                return
            receive = admitted
        hot = self.hot
        if hot is not None and scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            if path == "/v1/intent":
                await hot.intent(scope, receive, send)
                return
            if path.startswith("/v2/models/") and path.endswith("/infer"):
                match = _INFER_PATH.fullmatch(path)
                if match is not None:
                    await hot.infer(scope, receive, send, match[1], match[2])
                    return
        await super().__call__(scope, receive, send)


class _Head:
    """The request headers the hot path reads (one pass over the ASGI header list)."""

    __slots__ = ("binary", "encoding", "length", "timeout")

    def __init__(self, scope: Scope) -> None:
        self.length = self.encoding = self.timeout = self.binary = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                self.length = value.decode("latin-1")
            elif name == b"x-request-timeout-ms":
                self.timeout = value.decode("latin-1")
            elif name == b"content-encoding":
                self.encoding = value.decode("latin-1")
            elif name == _BINARY_HEADER:
                self.binary = value.decode("latin-1")


class HotPaths:
    """``POST /v1/intent`` and KServe ``infer`` on raw ASGI: same contract, errors and metrics as every route."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.manager = state.manager
        self.metrics = state.metrics

    async def intent(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        metrics, manager = self.metrics, self.manager
        served: ServedVersion | None = None
        why = ""
        model = "intent"
        in_flight = metrics.child(metrics.in_flight, "v1/intent")
        in_flight.inc()
        try:
            head = _Head(scope)
            body = _json_object(await receive_body(receive, head.length, head.encoding))
            model = str(body.get("model") or "intent")
            texts, single = _intent_texts(body)
            served = manager.get(model, body.get("version"))
            deadline = deadline_from_ms(parse_timeout_ms(head.timeout, body))
            work = served.classify(texts, deadline, bool(body.get("slots", True)))
            results = await until_disconnect(receive, work)
            rows = [
                {
                    "intent": r.intent,
                    "confidence": round(r.confidence, 6),
                    "candidate": r.candidate,
                    "out_of_scope": r.out_of_scope,
                    "slots": [slot.model_dump() for slot in r.slots],
                    "model": r.model,
                    "version": r.version,
                }
                for r in results
            ]
            code, payload, headers = 200, dumps(rows[0] if single else rows), [_JSON_TYPE]
        except Exception as exc:
            code, doc = kserve_body(exc)
            payload, headers, why = dumps(doc), [_JSON_TYPE], reason(exc)
        finally:
            in_flight.dec()
        await _reply(send, code, payload, headers)
        metrics.done(
            kserve.model_label(manager, model),
            str(served.version) if served else "",
            "http",
            code,
            time.perf_counter() - started,
            why,
        )

    async def infer(self, scope: Scope, receive: Receive, send: Send, model: str, version: str | None) -> None:
        started = time.perf_counter()
        metrics, manager = self.metrics, self.manager
        label = kserve.model_label(manager, model)
        served: ServedVersion | None = None
        why = ""
        in_flight = metrics.child(metrics.in_flight, label)
        in_flight.inc()
        try:
            head = _Head(scope)
            body = await receive_body(receive, head.length, head.encoding)
            header, binary = kserve.split_body(body, head.binary)
            base, raw = kserve.split_name(model)
            served = manager.get(base, version)
            tensors = kserve.inputs_from_request(header, binary)
            deadline = deadline_from_ms(parse_timeout_ms(head.timeout, header))
            outputs = await until_disconnect(receive, kserve.infer_tensors(served, raw, tensors, deadline))
            payload, header_length = kserve.infer_response(model, served.version, header, outputs)
            code = 200
            if header_length is None:
                headers = [_JSON_TYPE]
            else:
                headers = [_BINARY_TYPE, (_BINARY_HEADER, str(header_length).encode())]
        except Exception as exc:
            code, doc = kserve_body(exc)
            payload, headers, why = dumps(doc), [_JSON_TYPE], reason(exc)
        finally:
            in_flight.dec()
        await _reply(send, code, payload, headers)
        metrics.done(label, str(served.version) if served else "", "http", code, time.perf_counter() - started, why)


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        doc = loads(data)
    except JSON_ERRORS:
        return kserve.parse_json_object(data)  # the standard library's message names the position
    if not isinstance(doc, dict):
        raise InputError(f"request body is a JSON {type(doc).__name__}, not an object", "send a JSON object")
    return doc


async def _captured(handler: Callable[[Send], Awaitable[None]]) -> Response:
    """Run a hot-path handler and return what it sent as a Response (the router's way to call it)."""
    sent: dict[str, Any] = {}

    async def capture(msg: Any) -> None:
        sent.update(msg)

    await handler(capture)
    headers = {k.decode(): v.decode() for k, v in sent["headers"] if k != b"content-length"}
    return Response(sent["body"], status_code=sent["status"], headers=headers)


async def _reply(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
