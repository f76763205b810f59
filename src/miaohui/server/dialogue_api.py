"""HTTP for the dialogue pipelines and shadow reports (FastAPI routers, included by ``create_app``).

* ``POST /v1/dialogue/{pipeline}`` — body ``{"text", "session_id"?, "lang"?, "timings"?, "timeout_ms"?}`` (the
  session id may come as the ``X-Session-Id`` header instead, what the ingress routes by) →
  the :class:`~miaohui.dialogue.pipeline.DialogueResponse` as JSON (``timings`` only when asked) plus
  ``engine: {model, version}`` (the intent model version that answered) and, with ``--workers N``, ``worker``.
  Unknown pipeline → 404 with the list (``pipelines``); a bad body → 400; a deadline (``X-Request-Timeout-Ms``
  or ``timeout_ms``) → 504.
* ``GET /v1/dialogue`` — the pipelines and their OpenAI model names.
* ``GET /v1/shadow`` and ``GET /v1/shadow/{model}`` — :class:`~miaohui.serving.shadow.ShadowStatus`.

Every turn records ``miaohui_pipeline_stage_seconds{pipeline, stage}`` (normalize, intent, reply,
compliance, total) and ``miaohui_compliance_interventions_total{pipeline, rule, action}``, whether or not
the client asked for timings.

OpenAI model names: pipeline ``P`` is the model ``pipeline/P`` (``pipeline:P`` is accepted too). A ``/``
cannot occur in a repository model name, so the two never clash. :meth:`DialogueService.chat_delegate`
(the OpenAI router's ``chat_delegate``) and :func:`dialogue_chat_completion` answer a
``/v1/chat/completions`` request for such a model; :meth:`DialogueService.model_names` lists them for
``/v1/models``. The last message must be the user's; ``system`` messages are ignored (the pipeline has its
own prompt); the session is the ``user`` field when given, else it is found from the conversation so far
(the earlier user/assistant messages of a conversation this server answered), so a plain chat client keeps
multi-turn context. The response is a ``chat.completion`` with the dialogue details (intent, slots,
session id, interventions ...) under the extra key ``miaohui``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from miaohui.dialogue.config import PIPELINE_NAMES, load_pipeline_config
from miaohui.dialogue.engine_adapters import EngineClassifier, engine_call
from miaohui.dialogue.knowledge import KnowledgeBase, load_knowledge
from miaohui.dialogue.pipeline import DialogueResponse, IntentClassifier, Pipeline, TextGenerator
from miaohui.dialogue.session_stores import open_session_store
from miaohui.errors import ConfigError, InputError, ModelNotFoundError, UnavailableError
from miaohui.server.http_io import error_response, read_json, timeout_ms, until_disconnect
from miaohui.server.metrics import UNKNOWN_MODEL
from miaohui.server.status import http_status, reason
from miaohui.serving.served import deadline_from_ms

if TYPE_CHECKING:
    from miaohui.server.metrics import Metrics
    from miaohui.serving.repository import ModelManager
    from miaohui.serving.shadow import ShadowManager

__all__ = [
    "PIPELINE_MODEL_PREFIX",
    "DialogueRequest",
    "DialogueService",
    "completion_chunks",
    "dialogue_chat_completion",
    "dialogue_router",
    "pipeline_of_model",
    "shadow_router",
]

log = logging.getLogger("miaohui.server")
PIPELINE_MODEL_PREFIX = "pipeline/"
_MODEL_RE = re.compile(r"^pipeline[/:]([a-z][a-z0-9_]{1,63})$")
_SESSION_OK = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
STAGES = ("normalize", "intent", "reply", "compliance", "total")
MAX_CONVERSATIONS = 20_000
"""Conversation fingerprints kept to find the session of a chat without a ``user`` field (LRU)."""


def pipeline_of_model(model: str) -> str | None:
    """``pipeline/bank_advisor`` (or ``pipeline:bank_advisor``) → ``bank_advisor``; None for other names."""
    m = _MODEL_RE.match(model or "")
    return m.group(1) if m else None


class DialogueRequest(BaseModel):
    """Body of ``POST /v1/dialogue/{pipeline}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: StrictStr = Field(min_length=1)
    """The user's words (one turn)."""
    session_id: StrictStr | None = None
    """The session to continue (from an earlier response); omitted: a new session."""
    lang: Literal["zh", "en"] | None = None
    """Reply language; omitted: detected from the text, else the session's, else the pipeline's."""
    timings: StrictBool = False
    """Include per-stage milliseconds in the response."""
    timeout_ms: float | None = Field(default=None, gt=0)
    """Deadline of the intent engine call (also ``X-Request-Timeout-Ms``)."""

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> DialogueRequest:
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "body"
            raise InputError(
                f"invalid dialogue request at {where}: {err['msg']} (got {err.get('input')!r})"[:300],
                'send {"text": "查社保", "session_id": "<from the last response>", "lang": "zh"|"en", '
                '"timings": true}; text is required',
            ) from None


class DialogueService:
    """The dialogue pipelines of one server, sharing an intent classifier, a generator and a knowledge base."""

    def __init__(
        self,
        classifier: IntentClassifier,
        metrics: Metrics | None = None,
        *,
        generator: TextGenerator | None = None,
        pipelines: Sequence[str] = PIPELINE_NAMES,
        knowledge: KnowledgeBase | None = None,
        clock: Callable[[], datetime] | None = None,
        session_store: str | None = None,
    ) -> None:
        """``session_store``: where the pipelines keep their sessions (``--session-store``; None: this process's
        memory), see :func:`~miaohui.dialogue.session_stores.open_session_store`."""
        kb = knowledge if knowledge is not None else load_knowledge()
        self.metrics = metrics
        self.pipelines: dict[str, Pipeline] = {}
        for name in pipelines:
            config = load_pipeline_config(name)
            sessions = open_session_store(session_store, name, config.session)
            self.pipelines[name] = Pipeline(config, classifier, generator, knowledge=kb, clock=clock, sessions=sessions)
        self._conversations: OrderedDict[str, str] = OrderedDict()
        self.generates = generator is not None
        """The pipelines generate (a dialogue LLM): their turns spend a key's tokens per minute."""
        self.worker = 0
        """This process's worker index with ``--workers N`` (1..N; responses name it); 0 in a single process."""

    @classmethod
    def for_manager(
        cls,
        manager: ModelManager,
        metrics: Metrics | None = None,
        *,
        intent_model: str = "intent",
        generator: TextGenerator | None = None,
        session_store: str | None = None,
    ) -> DialogueService:
        """The server's service: intent from the served model ``intent_model`` (its primary version)."""
        return cls(EngineClassifier(manager, intent_model), metrics, generator=generator, session_store=session_store)

    async def close(self) -> None:
        """Release the session stores' connections."""
        for pipe in self.pipelines.values():
            await pipe.sessions.close()

    def get(self, name: str) -> Pipeline:
        pipe = self.pipelines.get(name)
        if pipe is None:
            raise ModelNotFoundError(f"unknown pipeline {name!r}", f"use one of {', '.join(self.pipelines)}")
        return pipe

    def check_labels(self) -> dict[str, ConfigError]:
        """Once the models are loaded: the pipelines whose routes name labels the intent model lacks, each logged
        as an error. The server still starts (the model serves ``/v1/intent``); their turns answer 503 with it."""
        failed: dict[str, ConfigError] = {}
        for name, pipe in self.pipelines.items():
            try:
                pipe.check_model_labels()
            except ConfigError as exc:
                log.error("%s — %s", exc.message, exc.fix)
                failed[name] = exc
        return failed

    def describe(self) -> list[dict[str, str]]:
        return [
            {"name": n, "model": PIPELINE_MODEL_PREFIX + n, "description": p.config.description}
            for n, p in self.pipelines.items()
        ]

    async def turn(
        self,
        name: str,
        text: str,
        session_id: str | None = None,
        lang: Literal["zh", "en"] | None = None,
        deadline: float | None = None,
    ) -> tuple[DialogueResponse, dict[str, Any]]:
        """One turn of pipeline ``name``; the response and the engine that classified it. Records metrics."""
        pipe = self.get(name)
        try:
            pipe.check_model_labels()  # the served version may have changed since load (model control)
        except ConfigError as exc:
            raise UnavailableError(exc.message, exc.fix) from None
        with engine_call(deadline) as call:
            resp = await pipe.run_turn(text, session_id, lang=lang)
        self._record(name, resp)
        return resp, {"model": call.model, "version": call.version}

    def _record(self, name: str, resp: DialogueResponse) -> None:
        if self.metrics is None:
            return
        t = resp.timings
        for stage, ms in zip(
            STAGES, (t.normalize_ms, t.intent_ms, t.reply_ms, t.compliance_ms, t.total_ms), strict=True
        ):
            self.metrics.stage_seconds.labels(name, stage).observe(ms / 1000.0)
        for record in resp.interventions:
            self.metrics.interventions.labels(name, record.rule, record.action).inc()

    # ------------------------------------------------------------------ OpenAI chat

    def model_names(self) -> list[str]:
        """The pipelines as OpenAI model names (for ``/v1/models``)."""
        return [PIPELINE_MODEL_PREFIX + n for n in self.pipelines]

    def chat_delegate(self, model: str) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None:
        """For the OpenAI router's ``chat_delegate``: a handler of the validated chat request (a dict) for
        pipeline models, None for any other model. An unknown ``pipeline/X`` gets a handler that raises
        ModelNotFoundError (404) listing the pipelines."""
        if pipeline_of_model(model) is None:
            return None

        async def handle(request: dict[str, Any]) -> dict[str, Any]:
            return await self.chat_completion(model, request.get("messages") or [], request.get("user"))

        return handle

    def _fingerprint(self, name: str, messages: Sequence[Mapping[str, Any]]) -> str:
        turns = [(m.get("role"), _content(m)) for m in messages if m.get("role") in ("user", "assistant")]
        blob = json.dumps([name, turns], ensure_ascii=False).encode()
        return hashlib.sha256(blob).hexdigest()

    def _conversation_session(self, name: str, earlier: Sequence[Mapping[str, Any]]) -> str | None:
        if not any(m.get("role") in ("user", "assistant") for m in earlier):
            return None
        sid = self._conversations.get(self._fingerprint(name, earlier))
        return sid

    def _remember(self, name: str, conversation: Sequence[Mapping[str, Any]], session_id: str) -> None:
        self._conversations[self._fingerprint(name, conversation)] = session_id
        while len(self._conversations) > MAX_CONVERSATIONS:
            self._conversations.popitem(last=False)

    async def chat_completion(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        user: str | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """An OpenAI ``chat.completion`` for pipeline model ``model`` (see the module docstring)."""
        name = pipeline_of_model(model) or model
        self.get(name)
        if not isinstance(messages, Sequence) or not messages or not isinstance(messages[-1], Mapping):
            raise InputError("messages is empty", "send the conversation, ending with the user's message")
        last = messages[-1]
        if last.get("role") != "user":
            raise InputError(
                f"the last message has role {last.get('role')!r}; a pipeline answers the user's turn",
                "end messages with {'role': 'user', 'content': ...}",
            )
        text = _content(last)
        if user:
            hashed = "u-" + hashlib.sha256(user.encode()).hexdigest()[:32]
            session_id: str | None = user if _SESSION_OK.match(user) else hashed
        else:
            session_id = self._conversation_session(name, messages[:-1])
        resp, engine = await self.turn(name, text, session_id, deadline=deadline)
        if not user:
            reply = {"role": "assistant", "content": resp.text}
            self._remember(name, [*messages, reply], resp.session_id)
        details = resp.model_dump(mode="json", exclude={"text"})
        details["engine"] = engine
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": PIPELINE_MODEL_PREFIX + name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": resp.text},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "miaohui": details,
        }


def _content(message: Mapping[str, Any]) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    raise InputError(f"message content is {type(content).__name__}", "send the content as a string")


async def dialogue_chat_completion(
    service: DialogueService,
    pipeline_name: str,
    messages: Sequence[Mapping[str, Any]],
    session_id_from_user_field: str | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """For the OpenAI router: answer ``/v1/chat/completions`` for a pipeline model (``pipeline/NAME``)."""
    return await service.chat_completion(pipeline_name, messages, session_id_from_user_field, deadline)


def completion_chunks(completion: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A pipeline's chat completion as ``chat.completion.chunk`` events (``stream: true``): the whole reply in
    one delta (compliance needs the whole reply before any of it may leave), then the finish chunk."""
    base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    text = completion["choices"][0]["message"]["content"]
    return [
        base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]},
        base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]


# ---------------------------------------------------------------------------------------------- routers


def dialogue_router(service: DialogueService) -> APIRouter:
    """``POST /v1/dialogue/{pipeline}`` and ``GET /v1/dialogue``."""
    router = APIRouter()

    @router.get("/v1/dialogue")
    async def pipelines() -> dict[str, Any]:
        return {"pipelines": service.describe()}

    @router.post("/v1/dialogue/{pipeline}")
    async def dialogue(pipeline: str, request: Request) -> Response:
        started = time.perf_counter()
        known = pipeline in service.pipelines
        label = PIPELINE_MODEL_PREFIX + pipeline if known else UNKNOWN_MODEL
        metrics = service.metrics
        why, code, version = "", 200, ""
        if metrics is not None:
            metrics.in_flight.labels("v1/dialogue").inc()
        try:
            service.get(pipeline)
            body = await read_json(request)
            req = DialogueRequest.parse(body)
            deadline = deadline_from_ms(req.timeout_ms or timeout_ms(request))
            session_id = req.session_id or request.headers.get("x-session-id")  # what the ingress hashes by
            work = service.turn(pipeline, req.text, session_id, req.lang, deadline)
            resp, engine = await until_disconnect(request.receive, work)
            version = str(engine["version"] or "")
            content = resp.model_dump(mode="json", exclude=None if req.timings else {"timings"})
            content["engine"] = engine
            if service.worker:
                content["worker"] = service.worker
            out: Response = JSONResponse(content)
        except Exception as exc:
            code, why, out = http_status(exc), reason(exc), error_response(exc)
            if not known and isinstance(exc, ModelNotFoundError):
                out = JSONResponse(
                    {"error": json.loads(bytes(out.body))["error"], "pipelines": list(service.pipelines)},
                    status_code=404,
                )
        finally:
            if metrics is not None:
                metrics.in_flight.labels("v1/dialogue").dec()
        if metrics is not None:
            metrics.done(label, version, "http", code, time.perf_counter() - started, why)
        return out

    return router


def shadow_router(shadow: ShadowManager) -> APIRouter:
    """``GET /v1/shadow`` (every shadowed model) and ``GET /v1/shadow/{model}``."""
    router = APIRouter()

    @router.get("/v1/shadow")
    async def all_shadows() -> dict[str, Any]:
        return {"shadows": [s.model_dump(mode="json") for s in shadow.reports()]}

    @router.get("/v1/shadow/{model}")
    async def one_shadow(model: str) -> Response:
        try:
            return JSONResponse(shadow.report(model).model_dump(mode="json"))
        except Exception as exc:
            return error_response(exc)

    return router
