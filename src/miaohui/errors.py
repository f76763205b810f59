"""miaohui's own errors. Each says what was wrong (the value) and how to fix it."""

from __future__ import annotations


class MiaohuiError(Exception):
    """Base class. ``fix`` is a sentence telling the user what to do."""

    def __init__(self, message: str, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(f"{message} — {fix}" if fix else message)


class ConfigError(MiaohuiError):
    """A configuration value is invalid or inconsistent."""


class ShapeError(MiaohuiError):
    """An input's shape or dtype does not match the engine's profile."""


class UnsupportedOperatorError(MiaohuiError):
    """The graph holds operators the chosen backend cannot build."""


class ExportError(MiaohuiError):
    """Export to ONNX failed or the exported graph disagrees with PyTorch."""


class BuildError(MiaohuiError):
    """An engine build failed; no artifact was written."""


class ArtifactError(MiaohuiError):
    """An engine artifact is missing, corrupt, truncated or made for another machine."""


class BackendUnavailableError(MiaohuiError):
    """The backend's library is not installed or cannot run on this machine."""


class ValidationGateError(MiaohuiError):
    """An engine failed the validation gate."""


class ModelNotFoundError(MiaohuiError):
    """No model (or version) of that name is in the repository."""


class QueueFullError(MiaohuiError):
    """The model's queue is full; the request was rejected (HTTP 429)."""


class DeadlineExceededError(MiaohuiError):
    """The request's deadline passed before it was answered (HTTP 504)."""


class InputError(MiaohuiError):
    """A request's input is invalid (HTTP 400)."""


class UnavailableError(MiaohuiError):
    """The server or model is shutting down or not ready (HTTP 503)."""


class ConflictError(MiaohuiError):
    """The request conflicts with how the server runs, e.g. model control with several workers (HTTP 409)."""


class UnauthorizedError(MiaohuiError):
    """No API key, or one the server does not know (HTTP 401)."""


class ForbiddenError(MiaohuiError):
    """The API key may not use that model or pipeline (HTTP 403)."""


class RateLimitedError(QueueFullError):
    """The API key is over its rate limit (HTTP 429 with ``Retry-After``)."""

    def __init__(self, message: str, fix: str | None = None, retry_after_s: int = 1) -> None:
        super().__init__(message, fix)
        self.retry_after_s = retry_after_s


class TokenRateLimitedError(RateLimitedError):
    """The API key spent its tokens-per-minute budget (HTTP 429 with ``Retry-After``: the seconds until it holds a
    token again)."""


class PayloadTooLargeError(InputError):
    """The request body is larger than the server's limit (HTTP 413)."""


class ClientDisconnectedError(MiaohuiError):
    """The client went away before its answer was ready; the work was dropped (HTTP 499, nginx's code)."""


class EngineStoppedError(MiaohuiError):
    """The generation engine stopped (shutdown, a broken loop) while the request was queued or running (HTTP 503)."""


class InternalError(MiaohuiError):
    """A fault inside miaohui (a failed engine step, a bug) hit this request; others go on (HTTP 500)."""
