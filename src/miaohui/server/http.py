"""HTTP: KServe v2 / Open Inference Protocol, ``POST /v1/intent``, repository control, health, statistics,
``/metrics``.

KServe inference takes JSON tensors and Triton's binary tensor extension (what ``tritonclient.http`` sends by
default; see :mod:`miaohui.server.kserve`), and answers with binary outputs when the request asks for them.
Every error is an explicit status with a JSON ``{"error": message}`` body (KServe's error format).
A request is either answered or rejected (400/404/429/503/504); a client that disconnects while its
request is queued has it dropped before compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from miaohui import __version__
from miaohui.errors import InputError, MiaohuiError, ModelNotFoundError, UnavailableError
from miaohui.server import kserve
from miaohui.server.generation_service import GenerationService
from miaohui.server.metrics import Metrics, ModelStateCollector
from miaohui.server.openai_api import openai_router
from miaohui.server.status import http_status, message, reason
from miaohui.serving.repository import ModelManager
from miaohui.serving.served import ServedVersion, deadline_from_ms

if TYPE_CHECKING:
    from miaohui.server.dialogue_api import DialogueService
    from miaohui.serving.shadow import ShadowManager

T = TypeVar("T")
DISCONNECT_POLL_S = 0.05
MAX_BODY_BYTES = 8 << 20
MAX_TEXTS = 256


class ServerState:
    """What the routes share: the model manager, metrics and extension routers' state."""

    def __init__(self, manager: ModelManager, metrics: Metrics) -> None:
        self.manager = manager
        self.metrics = metrics
        self.started = time.time()
        self.shutting_down = False
        self.generation: GenerationService | None = None
        """Causal-LM engines (OpenAI routes); None: the server has no generation models."""
        self.dialogue: DialogueService | None = None
        """Dialogue pipelines (``/v1/dialogue``, ``pipeline/<name>`` chat models); None: not served."""
        self.shadow: ShadowManager | None = None
        """Shadow comparisons of candidate versions (``/v1/shadow``); None: not served."""


def error_response(exc: BaseException) -> JSONResponse:
    return JSONResponse({"error": message(exc)}, status_code=http_status(exc))


async def read_body(request: Request) -> bytes:
    """The request body, read no further than :data:`MAX_BODY_BYTES` (a bigger one is refused as it arrives)."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise InputError(f"Content-Encoding {encoding!r} is not supported", "send the body uncompressed")
    too_big = InputError(f"request body is larger than the limit of {MAX_BODY_BYTES} bytes", "send smaller batches")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    chunks, size = [], 0
    try:
        async with contextlib.aclosing(request.stream()) as stream:
            async for chunk in stream:
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise too_big
                chunks.append(chunk)
    except ClientDisconnect:
        raise InputError("client disconnected", "nothing to do") from None
    return b"".join(chunks)


async def read_json(request: Request) -> dict[str, Any]:
    return kserve.parse_json_object(await read_body(request))


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (the batcher then drops it before compute)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise InputError("client disconnected", "nothing to do")


def timeout_ms(request: Request, body: dict[str, Any] | None = None) -> float | None:
    """Per-request deadline in ms: header ``X-Request-Timeout-Ms``, body ``timeout_ms``, or KServe
    ``parameters.timeout`` (µs, as Triton clients send it)."""
    header = request.headers.get("x-request-timeout-ms")
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


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="miaohui", version=__version__, docs_url="/docs", redoc_url=None)
    app.state.miaohui = state
    manager, metrics = state.manager, state.metrics
    with contextlib.suppress(ValueError):  # already registered when an app is built twice on one Metrics
        metrics.registry.register(
            ModelStateCollector(
                lambda: [(st.name, v.version, v.ready) for st in manager.states() for v in st.versions.values()]
            )
        )
    dialogue = state.dialogue
    if state.generation is not None:

        def encoders() -> list[str]:
            pipelines = dialogue.model_names() if dialogue is not None else []
            return [s.name for s in manager.states() if s.versions] + pipelines

        delegate = dialogue.chat_delegate if dialogue is not None else None
        app.include_router(openai_router(state.generation, metrics, other_models=encoders, chat_delegate=delegate))
    if dialogue is not None or state.shadow is not None:
        from miaohui.server.dialogue_api import dialogue_router, shadow_router  # it imports this module

        if dialogue is not None:
            app.include_router(dialogue_router(dialogue))
        if state.shadow is not None:
            app.include_router(shadow_router(state.shadow))

    @app.exception_handler(MiaohuiError)
    async def _miaohui_error(_: Request, exc: MiaohuiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse({"error": f"invalid request at {where}: {first.get('msg', 'bad value')}"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    # ------------------------------------------------------------------ health & metadata

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        encoders = any(s.versions for s in manager.states())
        llms = state.generation is not None and bool(state.generation.loaded())
        llm_ok = state.generation is None or state.generation.ready
        ok = (encoders or llms) and (manager.ready or not encoders) and llm_ok and not state.shutting_down
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

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
            served = manager.get(kserve.split_name(model)[0], version)
        except ModelNotFoundError:
            return JSONResponse({"name": model, "ready": False}, status_code=404)
        return JSONResponse({"name": model, "ready": served.ready}, status_code=200 if served.ready else 503)

    # ------------------------------------------------------------------ repository

    @app.post("/v2/repository/index")
    async def repository_index() -> list[dict[str, str]]:
        return manager.index()

    @app.post("/v2/repository/models/{model}/load")
    async def load_model(model: str, request: Request) -> dict[str, Any]:
        body = await read_body(request)
        if body.strip():  # tritonclient sends {"parameters": {...}} only for inline config or files
            params = kserve.parse_json_object(body).get("parameters") or {}
            kserve.check_load_parameters(list(params) if isinstance(params, dict) else ["parameters"])
        st = await manager.load(model)
        return {"name": model, "versions": sorted(st.versions), "state": st.state}

    @app.post("/v2/repository/models/{model}/unload")
    async def unload_model(model: str) -> dict[str, Any]:
        await manager.unload(model)
        return {"name": model, "state": "UNAVAILABLE"}

    # ------------------------------------------------------------------ inference

    @app.post("/v2/models/{model}/infer")
    @app.post("/v2/models/{model}/versions/{version}/infer")
    async def infer(model: str, request: Request, version: str | None = None) -> Response:
        started = time.perf_counter()
        label = kserve.model_label(manager, model)
        served: ServedVersion | None = None
        why = ""
        metrics.in_flight.labels(label).inc()
        try:
            body = await read_body(request)
            header, binary = kserve.split_body(body, request.headers.get(kserve.INFERENCE_HEADER))
            base, raw = kserve.split_name(model)
            served = manager.get(base, version)
            tensors = kserve.inputs_from_request(header, binary)
            deadline = deadline_from_ms(timeout_ms(request, header))
            outputs = await until_disconnect(request, infer_tensors(served, raw, tensors, deadline))
            code, resp = 200, _infer_response(*kserve.infer_response(model, served.version, header, outputs))
        except Exception as exc:
            code, resp, why = http_status(exc), error_response(exc), reason(exc)
        finally:
            metrics.in_flight.labels(label).dec()
        metrics.done(label, str(served.version) if served else "", "http", code, time.perf_counter() - started, why)
        return resp

    @app.post("/v1/intent")
    async def intent(request: Request) -> Response:
        started = time.perf_counter()
        served: ServedVersion | None = None
        why = ""
        model = "intent"
        metrics.in_flight.labels("v1/intent").inc()
        try:
            body = await read_json(request)
            model = str(body.get("model") or "intent")
            texts, single = _intent_texts(body)
            served = manager.get(model, body.get("version"))
            deadline = deadline_from_ms(timeout_ms(request, body))
            results = await until_disconnect(request, served.classify(texts, deadline, bool(body.get("slots", True))))
            rows = [
                {
                    "intent": r.intent,
                    "confidence": round(r.confidence, 6),
                    "slots": [s.model_dump() for s in r.slots],
                    "model": r.model,
                    "version": r.version,
                }
                for r in results
            ]
            code, resp = 200, JSONResponse(rows[0] if single else rows)
        except Exception as exc:
            code, resp, why = http_status(exc), error_response(exc), reason(exc)
        finally:
            metrics.in_flight.labels("v1/intent").dec()
        label = kserve.model_label(manager, model)
        metrics.done(label, str(served.version) if served else "", "http", code, time.perf_counter() - started, why)
        return resp

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
    if len(texts) > MAX_TEXTS:
        raise InputError(f"{len(texts)} texts in one request; the limit is {MAX_TEXTS}", "split the batch")
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


async def infer_tensors(
    served: ServedVersion, raw: bool, tensors: dict[str, np.ndarray], deadline: float | None
) -> dict[str, np.ndarray]:
    """Shared by HTTP and gRPC: the text contract (TEXT → INTENT, CONFIDENCE) or the tensor contract."""
    if served.manifest.task == "intent" and not raw:
        if set(tensors) != {"TEXT"}:
            raise InputError(
                f"model {served.name!r} takes one input TEXT (BYTES), got {sorted(tensors)}",
                f"send TEXT, or use {served.name + kserve.RAW_SUFFIX!r} for input_ids/attention_mask",
            )
        texts = [t.decode() if isinstance(t, bytes) else str(t) for t in tensors["TEXT"].ravel()]
        if not texts or len(texts) > MAX_TEXTS:
            raise InputError(f"TEXT holds {len(texts)} strings; send 1..{MAX_TEXTS}", "split the batch")
        results = await served.classify(texts, deadline, with_slots=False)
        return {
            "INTENT": np.array([r.intent for r in results], dtype=object),
            "CONFIDENCE": np.array([r.confidence for r in results], dtype=np.float32),
        }
    expected = {"input_ids", "attention_mask"}
    if set(tensors) != expected:
        raise InputError(f"model takes inputs {sorted(expected)}, got {sorted(tensors)}", "send both INT64 tensors")
    for name, arr in tensors.items():
        if arr.dtype != np.int64:
            raise InputError(
                f"input {name!r} has datatype {kserve.v2_dtype(arr)}; the model expects INT64",
                "send INT64 token ids and mask",
            )
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise InputError(
            f"input_ids {list(ids.shape)} and attention_mask {list(mask.shape)} must both be [batch, sequence]",
            "send two int64 tensors of the same 2-D shape",
        )
    if ids.shape[0] > served.max_batch:
        raise InputError(f"batch of {ids.shape[0]} rows exceeds max_batch_size {served.max_batch}", "split the request")
    out = await served.infer_tensors(ids, mask, deadline)
    return {served.output_name: out.astype(np.float32)}


def check_not_shutting_down(state: ServerState) -> None:
    if state.shutting_down:
        raise UnavailableError("the server is shutting down", "retry on another replica")
