"""OpenAI-compatible generation: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

The chat models are the repository's, served by the :class:`~miaohui.serving.repository.ModelManager` like every
model (each version's front end an :class:`~miaohui.generation.engine.client.LLMClient`). :func:`openai_router` is
the FastAPI router; it answers errors in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) with the
statuses of :mod:`miaohui.server.status`: 400 bad parameters, 404 unknown model, 413 body too large, 429 queue full,
499 client gone, 500 a fault in the engine, 503 stopping.

A request is admitted (``engine.add``) before any byte is sent, so a rejection is a plain HTTP error even
for ``stream: true``. Streams are SSE: ``data: {chunk}\\n\\n`` (``chat.completion.chunk`` /
``text_completion``): the role first (chat), then content deltas, then a chunk with ``finish_reason``, a
usage chunk when ``stream_options.include_usage``, and ``data: [DONE]``. When the client goes away,
starlette cancels the response; :class:`_EventStream` aborts the request in ``finally`` whatever the
path (cancellation, a failed send), so its slot is free for the next scheduler step. A non-streamed
request polls for a disconnect while it waits and aborts too.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from miaohui.errors import MiaohuiError, ModelNotFoundError
from miaohui.generation.engine.client import EngineStoppedError, RequestStream, TokenEvent
from miaohui.priority import CALLER, Caller
from miaohui.server import http_io
from miaohui.server.llm_generator import LLMTextGenerator
from miaohui.server.metrics import UNKNOWN_MODEL, Metrics
from miaohui.server.openai_schema import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    chat_messages,
    completion_prompt,
    parse_request,
    requested_logprobs,
    sampling_params,
)
from miaohui.server.openai_tools import (
    ChatPlan,
    completion_logprobs,
    logprob_entries,
    plan,
    prompt_messages,
    tool_calls,
)
from miaohui.server.status import message, openai_body, reason
from miaohui.serving.chat import ServedChatVersion
from miaohui.serving.repository import ModelManager

__all__ = ["ChatDelegate", "LLMTextGenerator", "create_openai_app", "openai_router"]

log = logging.getLogger("miaohui.generation")
PROTOCOL = "openai"


# ---- responses -------------------------------------------------------------------------------------------


def error_response(exc: BaseException) -> JSONResponse:
    return http_io.error_response(exc, openai=True)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else _dumps(obj)
    return f"data: {data}\n\n".encode()


_PROBE = "\x00miaohui-text\x00"
"""Stands for the text while a chunk template is made; split on once (ids and model names never hold NULs)."""


class _EventStream(StreamingResponse):
    """SSE response that runs ``on_close`` however it ends (done, client gone, send failed)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


@dataclass
class _Call:
    """One admitted request: its stream and how to shape its chunks."""

    chat: bool
    llm: ServedChatVersion
    stream: RequestStream
    prompt_tokens: int
    include_usage: bool
    plan: ChatPlan = field(default_factory=ChatPlan)
    logprobs: bool = False
    """The request asked for log-probabilities: chunks carry them (and leave the one-template fast path)."""
    served: int | None = None
    """The version that answers, where the engine process chose it (``--shared-engine``); else ``llm``'s."""
    shadow: Callable[[list[int], str], None] | None = None
    """Shadow mode: given the answer's token ids and text once it went out (:attr:`ServedChatVersion.shadow_tap`)."""
    caller: Caller | None = field(default_factory=CALLER.get)
    """The API key's tenant, charged the tokens used when the call ends (:meth:`settle`); None: no key."""
    generated: int = 0
    """Completion tokens seen so far."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _template: tuple[bytes, bytes] | None = field(default=None, repr=False)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def head(self, obj: str) -> dict[str, Any]:
        llm = self.llm
        return {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + self.id,
            "object": obj,
            "created": self.created,
            "model": llm.name,
            "system_fingerprint": f"miaohui-{llm.name}-v{self.served or llm.version}-{llm.info.precision}",
        }

    def settle(self) -> None:
        """Charge the tenant's tokens per minute with what the call used (prompt + completion), once."""
        caller, self.caller = self.caller, None
        if caller is not None:
            caller.charge(self.prompt_tokens + self.generated)

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def token_text(self, token_id: int) -> str:
        return str(self.llm.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False))

    def logprobs_of(self, events: list[TokenEvent], offset: int = 0) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice made of ``events`` (None when the request did not ask)."""
        if not self.logprobs:
            return None
        items = [(e.token_id, e.logprobs) for e in events]
        if self.chat:
            return {"content": logprob_entries(items, self.token_text), "refusal": None}
        return completion_logprobs(items, self.token_text, offset)

    def chunk(
        self,
        text: str | None,
        finish: str | None,
        *,
        role: bool = False,
        events: list[TokenEvent] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        lp = self.logprobs_of(events, offset) if events else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
        out = {**self.head(self.chunk_object), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def text_event(self, text: str) -> bytes:
        """``_sse(self.chunk(text, None))``, byte for byte, from a template made once per call: per token
        only the text is JSON-encoded (the streaming hot path)."""
        if self._template is None:
            probe = _dumps(_PROBE)
            head, tail = _dumps(self.chunk(_PROBE, None)).split(probe)
            self._template = (f"data: {head}".encode(), f"{tail}\n\n".encode())
        head_b, tail_b = self._template
        return head_b + _dumps(text).encode() + tail_b

    def shadowed(self, events: list[TokenEvent]) -> None:
        """Hand a complete answer to the shadow tap (which returns at once); never fails the request."""
        if self.shadow is None or not events or events[-1].finish_reason not in ("stop", "length"):
            return
        try:
            self.shadow([e.token_id for e in events if e.token_id is not None], "".join(e.text for e in events))
        except Exception:
            log.exception("shadow tap of %s v%d failed", self.llm.name, self.llm.version)

    def full(self, events: list[TokenEvent]) -> dict[str, Any]:
        last = events[-1]
        text, finish = "".join(e.text for e in events), _check_finish(last)
        lp = self.logprobs_of(events)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            calls = tool_calls(text, self.plan) if finish == "stop" else None
            if calls:
                message.update(content=None, tool_calls=calls)
                finish = "tool_calls"
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return {**self.head(self.object), "choices": [choice], "usage": self.usage(last.completion_tokens)}

    def whole_chunks(self, events: list[TokenEvent]) -> list[bytes]:
        """A request with tools, streamed once it is done: its text or its calls in one delta, then the finish."""
        body = self.full(events)
        choice = body["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        delta: dict[str, Any]
        if message.get("tool_calls"):
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]}
        else:
            delta = {"content": message["content"]}
        head = self.head(self.chunk_object)
        extra = {"usage": None} if self.include_usage else {}
        out = [
            _sse(
                {
                    **head,
                    "choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}],
                    **extra,
                }
            ),
            _sse({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}], **extra}),
        ]
        if self.include_usage:
            out.append(_sse({**head, "choices": [], "usage": body["usage"]}))
        return out


def _check_finish(event: TokenEvent) -> str:
    if event.finish_reason in ("stop", "length"):
        return event.finish_reason
    raise EngineStoppedError(f"generation ended with {event.finish_reason!r}", "retry the request")


async def _stream_chunks(call: _Call, done: Callable[[int, str], None]) -> AsyncIterator[bytes]:
    if call.chat:
        yield _sse(call.chunk(None, None, role=True))
    offset = 0  # characters streamed so far (completions' text_offset)
    answer: list[TokenEvent] | None = [] if call.shadow is not None else None  # kept for the shadow tap only
    try:
        if call.plan.tools:  # whether the answer is a call is known at its end
            events = [ev async for ev in call.stream]
            call.generated = events[-1].completion_tokens
            _check_finish(events[-1])
            for chunk in call.whole_chunks(events):
                yield chunk
            done(200, "")
            yield _sse("[DONE]")
            call.shadowed(events)
            return
        async for first in call.stream:
            # tokens that queued up behind it while this stream waited for the event loop go out in the same
            # chunk: under load one write per step instead of one per token (vLLM's stream interval, adaptive)
            more = call.stream.ready()
            event = more[-1] if more else first
            call.generated = event.completion_tokens
            if answer is not None:
                answer += [first, *more]
            failed = event.finish_reason in ("abort", "error")  # ends the stream with an error, after the text
            if more:
                text = first.text + "".join(e.text for e in (more[:-1] if failed else more))
            else:
                text = "" if failed else first.text
            if call.logprobs:
                chunk_events = [first, *(more[:-1] if failed else more)]
                yield _sse(call.chunk(text, None, events=chunk_events, offset=offset))
                offset += len(text)
            elif text:
                yield call.text_event(text)
            if failed:
                _check_finish(event)
            if event.finish_reason is not None:
                yield _sse(call.chunk(None, _check_finish(event)))
                if call.include_usage:
                    usage = call.usage(event.completion_tokens)
                    yield _sse({**call.head(call.chunk_object), "choices": [], "usage": usage})
                break
        done(200, "")
    except MiaohuiError as exc:  # the engine stopped or failed mid-stream: tell the client in-band
        status, body = openai_body(exc)
        done(status, reason(exc))
        yield _sse(body)
    yield _sse("[DONE]")
    if answer is not None:
        call.shadowed(answer)  # after the last byte: the candidate's run never delays this answer


async def _collect(request: Request, stream: RequestStream) -> list[TokenEvent]:
    """All of a request's events; aborts it if the client disconnects first (499)."""

    async def drain() -> list[TokenEvent]:
        return [ev async for ev in stream]

    try:
        return await http_io.until_disconnect(request.receive, drain())
    finally:
        stream.abort()


# ---- the router ------------------------------------------------------------------------------------------


ChatHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
ChatDelegate = Callable[[str], ChatHandler | None]
"""``model name → handler or None``: chat models answered elsewhere (the dialogue pipelines). The handler
gets the validated request as a dict and returns a whole ``chat.completion``; with ``stream: true`` it is
sent as one content chunk and a finish chunk."""


def openai_router(
    manager: ModelManager,
    metrics: Metrics,
    *,
    other_models: Callable[[], Iterable[str]] | None = None,
    chat_delegate: ChatDelegate | None = None,
) -> APIRouter:
    """The OpenAI-compatible routes over the chat models of ``manager``.

    ``other_models``: more names for ``/v1/models`` (the repository's intent models, the pipelines).
    ``chat_delegate``: see :data:`ChatDelegate`; asked first for every chat request's model.
    """
    router = APIRouter()

    def model_card(name: str, created: int) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "miaohui"}

    def cards() -> list[dict[str, Any]]:
        out = [model_card(s.latest.name, s.latest.info.created) for s in manager.chat_states() if s.latest]
        seen = {c["id"] for c in out}
        start = int(time.time())
        out += [model_card(n, start) for n in sorted(set(other_models() if other_models else ())) if n not in seen]
        return out

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": cards()}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        for card in cards():
            if card["id"] == model:
                return JSONResponse(card)
        return error_response(
            OpenAIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
        )

    def lookup(name: str) -> ServedChatVersion:
        try:
            return manager.chat(name)
        except ModelNotFoundError:
            if other_models is not None and name in set(other_models()):
                raise OpenAIError(
                    400,
                    f"model {name!r} is not a text-generation model; it has its own endpoint",
                    param="model",
                    code="model_not_supported",
                ) from None
            raise

    async def generate(request: Request, chat: bool) -> Response:
        done = _Recorder(metrics)
        try:
            req = parse_request(ChatRequest if chat else CompletionRequest, await http_io.read_body(request))
            handler = chat_delegate(req.model) if chat and chat_delegate is not None else None
            if handler is not None:
                done.label = req.model
                return _delegated(await handler(req.model_dump(exclude_unset=True)), bool(req.stream), done)
            llm = lookup(req.model)
            done.label, done.version = llm.name, str(llm.version)
            chat_plan = plan(req) if isinstance(req, ChatRequest) else ChatPlan()
            check_backend(llm, req, chat_plan)
            ids = _encode(llm, req, chat_plan)
            params = sampling_params(req, len(ids), llm.max_model_len, chat_plan.json_schema)
            stream = llm.client.add(ids, params)
            await stream.admitted()  # a remote engine's rejection (429 full queue) before any byte is sent
            done.version = str(stream.version or llm.version)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            call = _Call(chat, llm, stream, len(ids), include_usage, chat_plan, params.logprobs is not None)
            call.served = stream.version
            tap = llm.shadow_tap
            if tap is not None and stream.version in (None, llm.version):  # not if the engine process swapped
                call.shadow = functools.partial(tap, ids, params)
            if req.stream:
                return _streamed(call, done)
            try:
                events = await _collect(request, stream)
                call.generated = events[-1].completion_tokens
            finally:
                call.settle()
            body = call.full(events)
            done(200, "")
            call.shadowed(events)
            return JSONResponse(body)
        except Exception as exc:
            if not isinstance(exc, MiaohuiError):
                log.exception("generation request failed")
            status, body = openai_body(exc)
            done(status, _reason(exc))
            return JSONResponse(body, status_code=status)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    return router


class _Recorder:
    """Request metrics of one call: in-flight while it runs, then one ``done`` (a second call is ignored)."""

    def __init__(self, metrics: Metrics | None) -> None:
        self.metrics, self.label, self.version = metrics, UNKNOWN_MODEL, ""
        self.started = time.perf_counter()
        self.recorded = False
        if metrics is not None:
            metrics.in_flight.labels(PROTOCOL).inc()

    def __call__(self, code: int, why: str) -> None:
        if self.recorded or self.metrics is None:
            return
        self.recorded = True
        self.metrics.in_flight.labels(PROTOCOL).dec()
        self.metrics.done(self.label, self.version, PROTOCOL, code, time.perf_counter() - self.started, why)


def _streamed(call: _Call, done: _Recorder) -> Response:
    outcome: list[tuple[int, str]] = []  # what the stream reported; nothing ⇒ the client went away

    async def close() -> None:
        call.stream.abort()
        call.settle()
        done(*(outcome[-1] if outcome else (499, "client_closed")))

    return _EventStream(_stream_chunks(call, lambda code, why: outcome.append((code, why))), close)


def _delegated(completion: dict[str, Any], stream: bool, done: _Recorder) -> Response:
    done(200, "")
    if not stream:
        return JSONResponse(completion)
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = completion["choices"][0]
    text = choice["message"]["content"]

    async def chunks() -> AsyncIterator[bytes]:
        delta = {"role": "assistant", "content": text}
        yield _sse(head | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]})
        end: dict[str, Any] = {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason") or "stop",
        }
        yield _sse(head | {"choices": [end]})
        yield _sse("[DONE]")

    async def nothing() -> None:
        return None

    return _EventStream(chunks(), nothing)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OpenAIError):
        return exc.code or "bad_input"
    return reason(exc)


def check_backend(llm: ServedChatVersion, req: ChatRequest | CompletionRequest, chat_plan: ChatPlan) -> None:
    """400 naming the field when the model's backend cannot honour constrained decoding or log-probabilities."""
    asked = [
        ("logprobs", requested_logprobs(req) is not None),
        ("tool_choice" if chat_plan.forced else "response_format", chat_plan.json_schema is not None),
    ]
    for param, wanted in asked:
        if not wanted:
            continue
        if llm.info.backend == "inductor":
            raise OpenAIError(
                400,
                f"'{param}' is not supported by {llm.name!r} on the inductor (GPU slot) backend",
                param=param,
                code="unsupported_parameter",
            ) from None
        if param == "logprobs" and _remote(llm):
            raise OpenAIError(
                400,
                f"'logprobs' is not supported by {llm.name!r} behind --shared-engine: serve it without "
                "--shared-engine for log-probabilities",
                param=param,
                code="unsupported_parameter",
            )


def _remote(llm: ServedChatVersion) -> bool:
    from miaohui.serving.remote_llm import RemoteLLMEngine

    return isinstance(llm.client, RemoteLLMEngine)


def _encode(llm: ServedChatVersion, req: ChatRequest | CompletionRequest, chat_plan: ChatPlan) -> list[int]:
    if isinstance(req, ChatRequest):
        try:
            if chat_plan.tools:
                native = llm.tokenizer.supports_tools
                msgs = prompt_messages(req.messages, chat_plan.tools, native)
                return llm.tokenizer.encode_chat(msgs, tools=chat_plan.tools if native else None)
            return llm.tokenizer.encode_chat(chat_messages(req.messages))
        except MiaohuiError as exc:
            if isinstance(exc, OpenAIError):
                raise
            raise OpenAIError(400, message(exc), param="messages") from None
    prompt = completion_prompt(req.prompt)
    if prompt.token_ids is not None:  # checked by the engine (check_prompt), like every prompt
        return prompt.token_ids
    ids = llm.tokenizer.encode(prompt.text or "")
    if not ids:
        raise OpenAIError(400, "the prompt has no tokens: send a non-empty prompt", param="prompt")
    return ids


def create_openai_app(manager: ModelManager, metrics: Metrics) -> FastAPI:
    """A standalone app: the OpenAI routes and ``/metrics``, with ``manager``'s models loaded and stopped by the
    lifespan (tests, benchmarks; ``miaohui serve`` mounts :func:`openai_router` into its own app)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.load_all()
        try:
            yield
        finally:
            await manager.stop()

    app = FastAPI(title="miaohui-openai", lifespan=lifespan)
    app.include_router(openai_router(manager, metrics))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
