"""One mapping from miaohui errors to HTTP status codes and gRPC status codes."""

from __future__ import annotations

import grpc

from miaohui.errors import (
    ArtifactError,
    ConfigError,
    ConflictError,
    DeadlineExceededError,
    ForbiddenError,
    InputError,
    MiaohuiError,
    ModelNotFoundError,
    QueueFullError,
    RateLimitedError,
    ShapeError,
    UnauthorizedError,
    UnavailableError,
)

_TABLE: list[tuple[type[MiaohuiError], int, grpc.StatusCode, str]] = [
    (InputError, 400, grpc.StatusCode.INVALID_ARGUMENT, "bad_input"),
    (ShapeError, 400, grpc.StatusCode.INVALID_ARGUMENT, "bad_input"),
    (ConfigError, 400, grpc.StatusCode.INVALID_ARGUMENT, "bad_input"),
    (ModelNotFoundError, 404, grpc.StatusCode.NOT_FOUND, "not_found"),
    (UnauthorizedError, 401, grpc.StatusCode.UNAUTHENTICATED, "unauthorized"),
    (ForbiddenError, 403, grpc.StatusCode.PERMISSION_DENIED, "forbidden"),
    (RateLimitedError, 429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limited"),
    (QueueFullError, 429, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full"),
    (DeadlineExceededError, 504, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
    (UnavailableError, 503, grpc.StatusCode.UNAVAILABLE, "unavailable"),
    (ConflictError, 409, grpc.StatusCode.FAILED_PRECONDITION, "conflict"),
    (ArtifactError, 500, grpc.StatusCode.INTERNAL, "artifact"),
]


def http_status(exc: BaseException) -> int:
    for cls, code, _, _ in _TABLE:
        if isinstance(exc, cls):
            return code
    return 500


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    for cls, _, code, _ in _TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def reason(exc: BaseException) -> str:
    """Short label for metrics (``miaohui_request_failures_total{reason=...}``)."""
    for cls, _, _, label in _TABLE:
        if isinstance(exc, cls):
            return label
    return "internal"


def message(exc: BaseException) -> str:
    if isinstance(exc, MiaohuiError):
        return f"{exc.message}. Fix: {exc.fix}" if exc.fix else exc.message
    return f"internal error: {type(exc).__name__}: {exc}"
