"""API keys and tenants: who may call the server, which models and pipelines each may use, and how often.

Keys live hashed (SHA-256) in a YAML file (``miaohui keys add`` writes it; in Kubernetes a Secret mounted as that
file) given to ``miaohui serve --api-keys PATH``; without it the server is open (``make run``). Each entry::

    keys:
      - tenant: hotline-12345        # named in logs and metrics (the key never is)
        sha256: 3f1c...              # hex SHA-256 of the key
        models: ["intent", "pipeline/gov_hotline"]   # what it may call; "*" = everything
        requests_per_s: 50           # a token bucket of one second's requests; 0 = no limit
        tokens_per_minute: 20000     # generated + prompt tokens a minute (chat, completions); absent = no limit
        priority: interactive        # interactive | bulk

A request presents its key as ``Authorization: Bearer <key>`` (what the ``openai`` client sends; gRPC: the same
metadata, what ``tritonclient`` sends with ``headers=``). The presented key is hashed and compared with every
entry's hash with :func:`hmac.compare_digest` (constant time, and every entry is compared). Missing or unknown
key → 401; a model or pipeline the key may not use → 403; over its rate or its tokens per minute → 429 with
``Retry-After``. The buckets are per server process (``--workers N``: each worker keeps its own).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miaohui.errors import (
    ConfigError,
    ForbiddenError,
    MiaohuiError,
    RateLimitedError,
    TokenRateLimitedError,
    UnauthorizedError,
)
from miaohui.priority import CALLER, PRIORITY, Priority

__all__ = [
    "ApiKey",
    "Authenticator",
    "GrpcGate",
    "HttpGate",
    "KeyFile",
    "Tenant",
    "TokenBudget",
    "hash_key",
    "model_of_path",
    "new_key",
]

log = logging.getLogger("miaohui.auth")

KEY_PREFIX = "mh-"
NO_TENANT = "(none)"
"""The tenant label of a request refused before a key named its tenant (no key, a malformed or unknown one)."""


def hash_key(key: str) -> str:
    """Hex SHA-256 of a key (what the key file stores)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class ApiKey(BaseModel):
    """One key of the key file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Tenant name: in logs and metrics instead of the key."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex SHA-256 of the key; the key itself is never stored."""
    models: list[str] = Field(default_factory=lambda: ["*"])
    """Models (``pipeline/<name>`` for a pipeline) the key may use; ``*``: all of them."""
    requests_per_s: float = Field(default=0.0, ge=0.0)
    """Requests per second (a bucket of one second's worth); 0: no limit."""
    tokens_per_minute: int | None = Field(default=None, ge=1)
    """Tokens a minute on the generating routes (``/v1/chat/completions``, ``/v1/completions``, the dialogue
    pipelines when they generate): prompt + completion tokens, as OpenAI and LiteLLM count TPM. A bucket of one
    minute's tokens, refilled continuously; a request is admitted while it holds a token and charged its actual
    usage when it ends (so one long request may overdraw it, and the next waits until it refilled). None: no limit
    (the default: a tenant's generation is bounded only by the server's queues unless the operator sets one)."""
    priority: Priority = "interactive"
    """Priority class: interactive (a voice line, a chat) or bulk (batch jobs, training platforms)."""


class KeyFile(BaseModel):
    """The key file: a list of keys."""

    model_config = ConfigDict(extra="forbid")

    keys: list[ApiKey] = Field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> KeyFile:
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
            return cls.model_validate(raw)
        except OSError as exc:
            raise ConfigError(
                f"cannot read the API key file {path}: {exc.strerror or exc}",
                "create it with `miaohui keys add --file PATH --tenant NAME`",
            ) from None
        except (yaml.YAMLError, ValidationError) as exc:
            raise ConfigError(
                f"the API key file {path} is not valid: {str(exc).splitlines()[0]}",
                "write it with `miaohui keys add` (keys: [{tenant, sha256, models, requests_per_s, tokens_per_minute, "
                "priority}])",
            ) from None

    def save(self, path: Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False), encoding="utf-8")


class TokenBudget:
    """A token bucket: holds up to ``capacity``, refilled at ``per_s`` a second. A key's requests per second
    (capacity one second's requests, each takes one) and its tokens per minute (capacity one minute's tokens; a
    request is admitted while it holds at least one, since its size is not known before it runs, and
    :meth:`charge` takes what it used when it ends, which may leave the bucket below zero: it then refuses until
    refilled)."""

    def __init__(self, capacity: float, per_s: float, clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self._rate = per_s
        self._clock = clock
        self._level = float(capacity)
        self._at = clock()

    def level(self) -> float:
        """What the bucket holds now (negative: overdrawn)."""
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self._rate)
        self._at = now
        return self._level

    def wait_s(self) -> float:
        """Seconds until the bucket holds one again (0: it does)."""
        return max(0.0, (1.0 - self.level()) / self._rate)

    def charge(self, amount: float) -> None:
        self._level = self.level() - max(0.0, amount)


class Tenant:
    """The caller a key names, with its request bucket and its tokens-per-minute budget."""

    def __init__(self, key: ApiKey, clock: Callable[[], float]) -> None:
        self.key = key
        self.name = key.tenant
        self.priority: Priority = key.priority
        rate, per_minute = key.requests_per_s, key.tokens_per_minute
        self._requests = TokenBudget(max(1.0, rate), rate, clock) if rate > 0 else None
        self.budget = TokenBudget(per_minute, per_minute / 60.0, clock) if per_minute else None
        """Tokens per minute; None: no limit."""

    def allows(self, model: str) -> bool:
        return "*" in self.key.models or model in self.key.models

    def check_model(self, model: str) -> None:
        """ForbiddenError (403) when this tenant may not use ``model``."""
        if not self.allows(model):
            raise ForbiddenError(
                f"tenant {self.name!r} may not use model {model!r}",
                f"use one of {', '.join(self.key.models)}, or ask the operator to add it to this key",
            )

    def take(self) -> None:
        """Count one request; RateLimitedError (429) when over ``requests_per_s``."""
        if self._requests is None:
            return
        wait = self._requests.wait_s()
        if wait > 0:
            raise RateLimitedError(
                f"tenant {self.name!r} is over its limit of {self.key.requests_per_s:g} requests/s",
                f"retry after {math.ceil(wait)} s, or ask the operator for a higher limit",
                retry_after_s=max(1, math.ceil(wait)),
            )
        self._requests.charge(1.0)

    def check_tokens(self) -> None:
        """TokenRateLimitedError (429) while the tokens-per-minute budget is spent; ``Retry-After``: the seconds
        until it holds a token again."""
        if self.budget is None:
            return
        wait = self.budget.wait_s()
        if wait > 0:
            after = max(1, math.ceil(wait))
            raise TokenRateLimitedError(
                f"tenant {self.name!r} spent its {self.key.tokens_per_minute} tokens per minute",
                f"retry after {after} s, or ask the operator for a higher tokens_per_minute",
                retry_after_s=after,
            )

    def charge(self, tokens: int) -> None:
        """Count a request's prompt + completion tokens against the budget (nothing without a limit)."""
        if self.budget is not None:
            self.budget.charge(tokens)


class Authenticator:
    """The keys of a key file, checked in constant time."""

    def __init__(self, keys: KeyFile, clock: Callable[[], float] = time.monotonic) -> None:
        self._tenants = [(bytes.fromhex(k.sha256), Tenant(k, clock)) for k in keys.keys]

    @classmethod
    def from_file(cls, path: Path) -> Authenticator:
        return cls(KeyFile.load(path))

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer <key>`` value; UnauthorizedError (401) otherwise."""
        if not authorization:
            raise UnauthorizedError(
                "no API key: the request has no Authorization header",
                "send Authorization: Bearer <your key> (the openai client's api_key; gRPC metadata authorization)",
            )
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise UnauthorizedError(
                "the Authorization header is not 'Bearer <key>'", "send Authorization: Bearer <your key>"
            )
        digest = hashlib.sha256(key.strip().encode()).digest()
        found: Tenant | None = None
        for stored, tenant in self._tenants:  # compare with every entry: the time does not depend on which matched
            if hmac.compare_digest(stored, digest):
                found = tenant
        if found is None:
            raise UnauthorizedError("the API key is not valid", "check the key, or ask the operator for one")
        return found


# ------------------------------------------------------------------------------------------------ HTTP

OPEN_PATHS = ("/v2/health/", "/metrics", "/ui", "/favicon.ico")
"""Paths answered without a key: probes, the Prometheus scrape (no keys in it), the console's static page (its API
calls need a key)."""
BODY_MODEL_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
BODY_LIMIT = 64 << 20


def model_of_path(path: str) -> str | None:
    """The model (``pipeline/<name>`` for a pipeline) a path names, ``*`` for repository control, else None."""
    if path.startswith("/v2/models/"):
        return path.split("/")[3] or None
    if path.startswith("/v1/dialogue/"):
        return "pipeline/" + path.split("/")[3]
    if path == "/v1/intent":
        return "intent"
    if path.startswith("/v2/repository/"):
        return "*"
    return None


GENERATING_PATHS = ("/v1/chat/completions", "/v1/completions")
"""Routes whose requests generate tokens: a key's ``tokens_per_minute`` is checked there."""


class HttpGate:
    """Admits an HTTP request (ASGI) when its key is valid, under its rate and its tokens per minute and allowed the
    model it names; else it answers 401/403/429 itself, counts the rejection (``miaohui_request_failures_total
    {reason}``) and logs the tenant (never the key). ``generating``: path prefixes whose requests spend tokens
    (:data:`GENERATING_PATHS`, plus ``/v1/dialogue/`` where the pipelines generate)."""

    def __init__(
        self,
        auth: Authenticator,
        on_reject: Callable[[str, str, int, str], None] | None = None,
        generating: tuple[str, ...] = GENERATING_PATHS,
    ) -> None:
        self.auth = auth
        self.on_reject = on_reject
        self.generating = generating

    async def admit(self, scope: Any, receive: Any, send: Any) -> Any:
        """The ``receive`` to serve the request with, or None when it was answered here."""
        path: str = scope["path"]
        if path == "/" or path.startswith(OPEN_PATHS):
            return receive
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        model = model_of_path(path)
        tenant: Tenant | None = None
        try:
            tenant = self.auth.tenant(header)
            tenant.take()
            scope.setdefault("state", {})["tenant"] = tenant
            PRIORITY.set(tenant.priority)  # the batcher queues interactive requests ahead of bulk ones
            CALLER.set(tenant)  # later refusals are counted under its name; generation charges its tokens
            if model is None and scope["method"] == "POST" and path in BODY_MODEL_PATHS:
                body, receive = await _buffer(receive)
                model = _body_model(body)
            if model is not None:
                tenant.check_model(model)
            if path.startswith(self.generating):
                tenant.check_tokens()
        except MiaohuiError as exc:
            await self._reject(exc, tenant.name if tenant else NO_TENANT, model, path, send)
            return None
        return receive

    async def _reject(self, exc: MiaohuiError, tenant: str, model: str | None, path: str, send: Any) -> None:
        from miaohui.server.http_io import is_openai_path
        from miaohui.server.status import http_status, message, openai_body, reason

        code = http_status(exc)
        headers = [(b"content-type", b"application/json")]
        if isinstance(exc, RateLimitedError):
            headers.append((b"retry-after", str(exc.retry_after_s).encode()))
        log.info("rejected (%d %s, tenant %s): %s", code, reason(exc), tenant, exc.message)
        if self.on_reject is not None:
            self.on_reject(tenant, model or "", code, reason(exc))
        body = openai_body(exc)[1] if is_openai_path(path) else {"error": message(exc)}
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


async def _buffer(receive: Any) -> tuple[bytes, Any]:
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            break
        chunks.append(msg.get("body", b""))
        size += len(chunks[-1])
        if size > BODY_LIMIT or not msg.get("more_body"):
            break
    body = b"".join(chunks)
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


def _body_model(body: bytes) -> str | None:
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None  # the route answers the bad body with its own 400
    return model if isinstance(model, str) else None


# ------------------------------------------------------------------------------------------------ gRPC

GRPC_OPEN_METHODS = ("/ServerLive", "/ServerReady")


class GrpcGate(grpc.aio.ServerInterceptor):
    """The same checks for gRPC: the key from the ``authorization`` metadata, the model from the request's
    ``model_name`` (or ``name``); rejected calls end with UNAUTHENTICATED, PERMISSION_DENIED or RESOURCE_EXHAUSTED
    and are counted like HTTP's."""

    def __init__(self, auth: Authenticator, on_reject: Callable[[str, str, int, str], None] | None = None) -> None:
        self.auth = auth
        self.on_reject = on_reject

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        method: str = details.method or ""
        if handler is None or handler.unary_unary is None or method.endswith(GRPC_OPEN_METHODS):
            return handler
        metadata = dict(details.invocation_metadata or ())
        header = metadata.get("authorization")
        inner = handler.unary_unary
        gate = self

        async def guarded(request: Any, context: Any) -> Any:
            model = getattr(request, "model_name", "") or getattr(request, "name", "")
            if method.endswith(("RepositoryModelLoad", "RepositoryModelUnload")):
                model = "*"
            tenant: Tenant | None = None
            try:
                tenant = gate.auth.tenant(header if isinstance(header, str) else None)
                tenant.take()
                if model:
                    tenant.check_model(model)
                PRIORITY.set(tenant.priority)
                CALLER.set(tenant)
            except MiaohuiError as exc:
                from miaohui.server.status import grpc_status, http_status, message, reason

                name = tenant.name if tenant else NO_TENANT
                log.info("rejected (%s %s, tenant %s): %s", grpc_status(exc).name, reason(exc), name, exc.message)
                if gate.on_reject is not None:
                    gate.on_reject(name, model, http_status(exc), reason(exc))
                await context.abort(grpc_status(exc), message(exc))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
