"""The pipeline's engine protocols over real engines.

Intent (:class:`~miaohui.dialogue.pipeline.IntentClassifier`):

* :class:`EngineClassifier` — a model served by the :class:`~miaohui.serving.repository.ModelManager`
  (``ServedVersion.classify``: dynamic batcher, deadline, shadow tap). The server uses this one.
* offline (``miaohui compare``, the pipeline gate): the comparator's encoder runners
  (:class:`~miaohui.validate.comparator.ArtifactClassifier`, :class:`~miaohui.validate.comparator.TorchClassifier`).

Text (:class:`~miaohui.dialogue.pipeline.TextGenerator`), optional — the pipelines answer their llm routes with
templates when there is no generator:

* :class:`ChatFunctionGenerator` — an OpenAI-style chat callable: ``await create(model=..., messages=...,
  max_tokens=..., temperature=...)`` returning a chat completion (dict or the ``openai`` client's object),
  e.g. ``openai.AsyncOpenAI(base_url=...).chat.completions.create``.
* the server's own: :class:`~miaohui.server.openai_api.LLMTextGenerator` (a causal LM of its generation
  service).

Per-request state crosses the protocol (which takes only texts) in a context variable:
:func:`engine_call` sets the deadline that :class:`EngineClassifier` applies and records the model version
that answered.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from miaohui.dialogue.pipeline import ChatMessage
from miaohui.errors import ArtifactError, MiaohuiError, ModelNotFoundError

if TYPE_CHECKING:
    from miaohui.serving.repository import ModelManager
    from miaohui.serving.served import ServedVersion

__all__ = [
    "ChatFunction",
    "ChatFunctionGenerator",
    "EngineCall",
    "EngineClassifier",
    "engine_call",
]


# ------------------------------------------------------------------------------------------ per request


@dataclass
class EngineCall:
    """What one request's engine calls share: its deadline in, the version that answered out."""

    deadline: float | None = None
    """``time.monotonic()`` by which the classifier must answer (None: no deadline)."""
    model: str | None = None
    version: int | None = None


_CALL: ContextVar[EngineCall | None] = ContextVar("miaohui_engine_call", default=None)


@contextlib.contextmanager
def engine_call(deadline: float | None = None) -> Iterator[EngineCall]:
    """Scope one request: classifiers called inside see ``deadline`` and fill in the model version."""
    call = EngineCall(deadline=deadline)
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


# ------------------------------------------------------------------------------------------ intent


class EngineClassifier:
    """An :class:`IntentClassifier` over the served model ``model_name`` (its primary version by default)."""

    def __init__(
        self,
        manager: ModelManager,
        model_name: str = "intent",
        version: int | None = None,
        timeout_ms: float | None = None,
    ) -> None:
        """``timeout_ms`` is the deadline of calls made outside :func:`engine_call` (None: none)."""
        self.manager = manager
        self.model_name = model_name
        self.version = version
        self.timeout_ms = timeout_ms

    def served(self) -> ServedVersion:
        """The version answering now: ``version`` if set, else the primary (never a shadow candidate)."""
        from miaohui.serving.shadow import primary_version

        served = self.manager.get(self.model_name, self.version)
        if self.version is not None:
            return served
        state = next((s for s in self.manager.states() if s.name == self.model_name), None)
        primary = primary_version(state.versions) if state is not None else None
        return state.versions[primary] if state is not None and primary is not None else served

    @property
    def labels(self) -> list[str] | None:
        """The labels of the version answering now; None while the model is not loaded (nothing to check yet)."""
        try:
            served = self.served()
        except MiaohuiError:
            return None
        return list(served.manifest.labels) if served.manifest.task == "intent" else None

    async def classify(self, texts: list[str]) -> list[tuple[str, float, str]]:
        served = self.served()
        if served.manifest.task != "intent" or not served.manifest.labels:
            raise ModelNotFoundError(
                f"model {self.model_name!r} is a {served.manifest.task} model, not an intent classifier",
                "point the dialogue pipelines at an intent model (DialogueService(intent_model=...))",
            )
        call = _CALL.get()
        if call is not None:
            call.model, call.version = served.name, served.version
            deadline = call.deadline
        else:
            deadline = None if self.timeout_ms is None else time.monotonic() + self.timeout_ms / 1000.0
        results = await served.classify(texts, deadline, with_slots=False)
        # below the model's threshold a pipeline is told ``out_of_scope`` (its fallback), whatever the model calls it
        return [("out_of_scope" if r.out_of_scope else r.intent, r.confidence, r.candidate) for r in results]


# ------------------------------------------------------------------------------------------ text


class ChatFunction(Protocol):
    """An OpenAI-style chat call: keyword arguments of ``chat.completions.create``, a chat completion back."""

    def __call__(
        self, *, model: str, messages: list[ChatMessage], max_tokens: int, temperature: float, **extra: Any
    ) -> Awaitable[Any]: ...


def completion_text(completion: Any) -> str:
    """The first choice's message content of a chat completion (a dict or the ``openai`` client's object)."""
    try:
        choice = completion["choices"][0] if isinstance(completion, Mapping) else completion.choices[0]
        message = choice["message"] if isinstance(choice, Mapping) else choice.message
        content = message["content"] if isinstance(message, Mapping) else message.content
    except (KeyError, IndexError, AttributeError, TypeError) as exc:
        raise ArtifactError(
            f"the chat function returned no choices[0].message.content ({type(exc).__name__}: {exc})",
            "make it return an OpenAI chat completion",
        ) from exc
    return content if isinstance(content, str) else ""


class ChatFunctionGenerator:
    """A :class:`TextGenerator` and :class:`~miaohui.dialogue.tool_call.ToolCaller` over an OpenAI-style chat
    callable (:class:`ChatFunction`); the call is asked for with ``tool_choice`` naming the function."""

    def __init__(self, create: ChatFunction, model: str) -> None:
        self.create = create
        self.model = model

    async def generate(self, messages: list[ChatMessage], max_tokens: int, temperature: float = 0.0) -> str:
        completion = await self.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=temperature
        )
        return completion_text(completion)

    async def call_tool(self, messages: list[ChatMessage], tool: dict[str, Any], max_tokens: int) -> Any:
        name = tool["function"]["name"]
        completion = await self.create(
            model=self.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": name}},
        )
        return completion_tool_call(completion)


def completion_tool_call(completion: Any) -> dict[str, Any]:
    """``{"name": ..., "arguments": {...}}`` of a chat completion's first tool call (dict or ``openai`` object);
    ValueError when it has none or its arguments are not JSON."""
    try:
        choice = completion["choices"][0] if isinstance(completion, Mapping) else completion.choices[0]
        message = choice["message"] if isinstance(choice, Mapping) else choice.message
        calls = message["tool_calls"] if isinstance(message, Mapping) else message.tool_calls
        fn = calls[0]["function"] if isinstance(calls[0], Mapping) else calls[0].function
        name, arguments = (fn["name"], fn["arguments"]) if isinstance(fn, Mapping) else (fn.name, fn.arguments)
    except (KeyError, IndexError, AttributeError, TypeError) as exc:
        raise ValueError(f"the chat function returned no tool call ({type(exc).__name__}: {exc})") from None
    try:
        return {"name": name, "arguments": json.loads(arguments)}
    except (TypeError, ValueError):
        raise ValueError(f"the tool call's arguments are not JSON: {str(arguments)[:120]!r}") from None
