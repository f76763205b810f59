"""``POST /v1/embeddings`` in OpenAI's shape, and KServe v2's text contract of an embedding model
(``TEXT`` → ``EMBEDDING``). Rows go through the model's dynamic batcher like intent requests.

    {"model": "minilm", "input": "text" | ["text", ...]}
    → {"object": "list", "data": [{"object": "embedding", "embedding": [...], "index": 0}, ...],
       "model": "minilm", "usage": {"prompt_tokens": N, "total_tokens": N}}
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from miaohui.errors import InputError
from miaohui.serving.served import deadline_from_ms

if TYPE_CHECKING:
    from miaohui.server.metrics import Metrics
    from miaohui.serving.repository import ModelManager
    from miaohui.serving.served import ServedVersion

MAX_INPUTS = 256
"""Most texts one request may hold (OpenAI allows 2048; a batch this size already fills several engine batches)."""


def embedding_texts(body: dict[str, Any]) -> list[str]:
    """``input`` as a string or a non-empty list of strings (token-id inputs are not taken)."""
    value = body.get("input")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise InputError(
            "missing 'input' (a string or a non-empty list of strings)",
            'send {"model": "NAME", "input": "text"} or {"model": "NAME", "input": ["a", "b"]}',
        )
    if not all(isinstance(t, str) for t in texts):
        raise InputError("every item of 'input' must be a string", "send text; token-id input is not supported")
    if len(texts) > MAX_INPUTS:
        raise InputError(f"{len(texts)} inputs in one request; the limit is {MAX_INPUTS}", "split the request")
    if body.get("encoding_format") not in (None, "float", "base64"):
        raise InputError(f"encoding_format {body['encoding_format']!r} is not supported", 'use "float" or "base64"')
    return texts


def encode_vector(vector: np.ndarray, encoding: str) -> list[float] | str:
    """A list of floats, or (``base64``, what the openai client asks for by default) the float32 little-endian
    bytes in base64."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def embeddings_router(manager: ModelManager, metrics: Metrics) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        """OpenAI embeddings: ``model`` (an encoder model of the repository) and ``input``."""
        from miaohui.server.http_io import error_response, read_json
        from miaohui.server.kserve import model_label
        from miaohui.server.status import http_status, reason

        started = time.perf_counter()
        served: ServedVersion | None = None
        model, code, why = "", 200, ""
        try:
            body = await read_json(request)
            model = str(body.get("model") or "")
            if not model:
                raise InputError("missing 'model'", "name an embedding model of the repository, e.g. GET /v1/models")
            texts = embedding_texts(body)
            encoding = str(body.get("encoding_format") or "float")
            served = manager.get(model)
            deadline = deadline_from_ms(body.get("timeout_ms") if isinstance(body.get("timeout_ms"), int) else None)
            vectors, tokens = await served.embed(texts, deadline)
            doc = {
                "object": "list",
                "data": [
                    {"object": "embedding", "embedding": encode_vector(v, encoding), "index": i}
                    for i, v in enumerate(vectors)
                ],
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
            return JSONResponse(doc)
        except Exception as exc:
            code, why = http_status(exc), reason(exc)
            return error_response(exc, openai=True)
        finally:
            version = str(served.version) if served else ""
            metrics.done(model_label(manager, model), version, "http", code, time.perf_counter() - started, why)

    return router


async def embed_tensors(
    served: ServedVersion, tensors: dict[str, np.ndarray], deadline: float | None, max_texts: int
) -> dict[str, np.ndarray]:
    """KServe v2 text contract of an encoder model (HTTP and gRPC): ``TEXT`` (BYTES) → ``EMBEDDING`` (FP32)."""
    if set(tensors) != {"TEXT"}:
        raise InputError(
            f"model {served.name!r} takes one input TEXT (BYTES), got {sorted(tensors)}",
            f"send TEXT, or use {served.name + '-raw'!r} for input_ids/attention_mask",
        )
    texts = [t.decode() if isinstance(t, bytes) else str(t) for t in tensors["TEXT"].ravel()]
    if not texts or len(texts) > max_texts:
        raise InputError(f"TEXT holds {len(texts)} strings; send 1..{max_texts}", "split the batch")
    vectors, _ = await served.embed(texts, deadline)
    return {"EMBEDDING": vectors}


def embedding_metadata(name: str, versions: list[int], platform: str, width: int) -> dict[str, Any]:
    return {
        "name": name,
        "versions": [str(v) for v in versions],
        "platform": platform,
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, width]}],
    }
