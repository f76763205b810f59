"""One mapping from miaohui errors to HTTP statuses, gRPC statuses and metric reasons, and the two error bodies
built from it: KServe's ``{"error": message}`` and OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(as TEI's router maps one error type to one status and one body).

Every class of :mod:`miaohui.errors` has its own row (tests/unit/test_status_table.py fails when one is missing);
an error class defined elsewhere takes the row of its nearest base. Anything that is not a
:class:`~miaohui.errors.MiaohuiError` is a fault of the server: 500 for the request it hit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import grpc

from miaohui import errors
from miaohui.errors import MiaohuiError, ModelNotFoundError
from miaohui.server.openai_schema import OpenAIError


class Status(NamedTuple):
    http: int
    grpc: grpc.StatusCode
    reason: str
    """Short label for metrics (``miaohui_request_failures_total{reason=...}``) and the OpenAI error ``code``."""


_C = grpc.StatusCode
TABLE: dict[type[MiaohuiError], Status] = {
    errors.InputError: Status(400, _C.INVALID_ARGUMENT, "bad_input"),
    errors.ShapeError: Status(400, _C.INVALID_ARGUMENT, "bad_input"),
    errors.ConfigError: Status(400, _C.INVALID_ARGUMENT, "bad_input"),
    errors.PayloadTooLargeError: Status(413, _C.RESOURCE_EXHAUSTED, "body_too_large"),
    errors.ModelNotFoundError: Status(404, _C.NOT_FOUND, "not_found"),
    errors.ConflictError: Status(409, _C.FAILED_PRECONDITION, "conflict"),
    errors.UnauthorizedError: Status(401, _C.UNAUTHENTICATED, "unauthorized"),
    errors.ForbiddenError: Status(403, _C.PERMISSION_DENIED, "forbidden"),
    errors.RateLimitedError: Status(429, _C.RESOURCE_EXHAUSTED, "rate_limited"),
    errors.TokenRateLimitedError: Status(429, _C.RESOURCE_EXHAUSTED, "token_rate_limited"),
    errors.QueueFullError: Status(429, _C.RESOURCE_EXHAUSTED, "queue_full"),
    errors.ClientDisconnectedError: Status(499, _C.CANCELLED, "client_closed"),
    errors.UnavailableError: Status(503, _C.UNAVAILABLE, "unavailable"),
    errors.EngineStoppedError: Status(503, _C.UNAVAILABLE, "engine_stopped"),
    errors.BackendUnavailableError: Status(503, _C.UNAVAILABLE, "backend_unavailable"),
    errors.DeadlineExceededError: Status(504, _C.DEADLINE_EXCEEDED, "deadline"),
    errors.ArtifactError: Status(500, _C.INTERNAL, "artifact"),
    errors.UnsupportedOperatorError: Status(500, _C.INTERNAL, "build"),
    errors.ExportError: Status(500, _C.INTERNAL, "build"),
    errors.BuildError: Status(500, _C.INTERNAL, "build"),
    errors.ValidationGateError: Status(500, _C.INTERNAL, "validation_gate"),
    errors.InternalError: Status(500, _C.INTERNAL, "internal"),
    errors.MiaohuiError: Status(500, _C.INTERNAL, "internal"),
}
INTERNAL = TABLE[errors.InternalError]
_OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error"}
_OPENAI_TYPES |= {401: "invalid_request_error", 403: "invalid_request_error"}  # what OpenAI answers for a bad key
_OPENAI_TYPES |= {429: "rate_limit_error", 499: "invalid_request_error"}


def status(exc: BaseException) -> Status:
    """The row of ``exc``'s class or its nearest base in :data:`TABLE`; :data:`INTERNAL` for any other error."""
    for cls in type(exc).__mro__:
        row = TABLE.get(cls)
        if row is not None:
            return row
    return INTERNAL


def http_status(exc: BaseException) -> int:
    return status(exc).http


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    return status(exc).grpc


def reason(exc: BaseException) -> str:
    return status(exc).reason


def message(exc: BaseException) -> str:
    if isinstance(exc, MiaohuiError):
        return f"{exc.message}. Fix: {exc.fix}" if exc.fix else exc.message
    return f"internal error: {type(exc).__name__}: {exc}"


def kserve_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and KServe's error body ``{"error": message}`` (the KServe, intent, dialogue and console routes)."""
    return http_status(exc), {"error": message(exc)}


def openai_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and OpenAI's error body. An :class:`~miaohui.server.openai_schema.OpenAIError` brings its own
    status, type, param and code (a request parameter it names); every other error takes its row of the table."""
    if isinstance(exc, OpenAIError):
        return exc.status, exc.body()
    row = status(exc)
    code, param = ("model_not_found", "model") if isinstance(exc, ModelNotFoundError) else (row.reason, None)
    kind = _OPENAI_TYPES.get(row.http, "server_error")
    return row.http, {"error": {"message": message(exc), "type": kind, "param": param, "code": code}}
