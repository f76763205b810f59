"""The pipeline's engine protocols over real engines.

Intent (:class:`~miaohui.dialogue.pipeline.IntentClassifier`):

* :class:`EngineClassifier` — a model served by the :class:`~miaohui.serving.repository.ModelManager`
  (``ServedVersion.classify``: dynamic batcher, deadline, shadow tap). The server uses this one.
* :class:`ArtifactClassifier` — an engine artifact loaded directly (offline: ``miaohui compare``, the
  pipeline gate). :class:`TorchClassifier` — the source checkpoint in PyTorch fp32 (the gate's reference).

Text (:class:`~miaohui.dialogue.pipeline.TextGenerator`), both optional — the pipelines answer their llm
routes with templates when there is no generator:

* :class:`ChatFunctionGenerator` — an OpenAI-style chat callable: ``await create(model=..., messages=...,
  max_tokens=..., temperature=...)`` returning a chat completion (dict or the ``openai`` client's object),
  e.g. ``openai.AsyncOpenAI(base_url=...).chat.completions.create``.
* :class:`EngineGenerator` — miaohui's own :class:`~miaohui.generation.engine.engine_loop.AsyncLLMEngine` with a
  chat encoder (messages → prompt token ids). The server uses
  :class:`~miaohui.server.openai_api.LLMTextGenerator` (the same over the model manager's chat model).

Per-request state crosses the protocol (which takes only texts) in a context variable:
:func:`engine_call` sets the deadline that :class:`EngineClassifier` applies and records the model version
that answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from miaohui.dialogue.pipeline import ChatMessage
from miaohui.errors import ArtifactError, MiaohuiError, ModelNotFoundError
from miaohui.models.decision import IntentDecision, decide

if TYPE_CHECKING:
    from miaohui.engines.base import Engine
    from miaohui.generation.engine.engine_loop import AsyncLLMEngine
    from miaohui.nlp.tokenizer import TextTokenizer
    from miaohui.serving.repository import ModelManager
    from miaohui.serving.served import ServedVersion

__all__ = [
    "ArtifactClassifier",
    "ChatFunction",
    "ChatFunctionGenerator",
    "EngineCall",
    "EngineClassifier",
    "EngineGenerator",
    "TorchClassifier",
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


PIPELINE_OOS = "out_of_scope"
"""What a pipeline is told when the model answers out of scope (whatever the model calls it): the label its routes
send to the fallback."""


def _decided(
    logits: np.ndarray, labels: Sequence[str], decision: IntentDecision | None
) -> list[tuple[str, float, str]]:
    """(label, confidence, candidate) a pipeline routes on: the model's calibrated answer, ``out_of_scope`` below its
    threshold, and the best label."""
    return [
        (PIPELINE_OOS if d.out_of_scope else d.intent, d.confidence, d.candidate)
        for d in decide(logits, labels, decision)
    ]


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
        return [(PIPELINE_OOS if r.out_of_scope else r.intent, r.confidence, r.candidate) for r in results]


class ArtifactClassifier:
    """An :class:`IntentClassifier` over an engine artifact loaded in this process (no server, no batcher).

    Use as a context manager (``with ArtifactClassifier.open(path) as clf:``); :meth:`logits` gives the raw
    outputs for consistency checks.
    """

    def __init__(self, engine: Engine, tokenizer: TextTokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.labels: list[str] = list(engine.manifest.labels)
        if engine.manifest.task != "intent" or not self.labels:
            raise ArtifactError(
                f"{engine.manifest.name} v{engine.manifest.version} is a {engine.manifest.task} engine without labels",
                "give an intent classifier artifact (built from `miaohui train-intent`)",
            )
        self.output = engine.output_names[0]
        found = engine.manifest.extra.get("decision")
        self.decision = IntentDecision.model_validate(found) if found else None
        self.name = f"{engine.manifest.name} v{engine.manifest.version} ({engine.manifest.backend} "
        self.name += f"{engine.manifest.precision})"

    @classmethod
    @contextlib.contextmanager
    def open(cls, path: Path) -> Iterator[ArtifactClassifier]:
        from miaohui.engines.loader import load_engine
        from miaohui.nlp.tokenizer import TextTokenizer

        with load_engine(path) as engine:
            m = engine.manifest
            tok = TextTokenizer.from_file(path / (m.tokenizer_file or "tokenizer.json"), m.max_length or 512)
            yield cls(engine, tok)

    def logits(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """Logits of every text (normalized like the server does, over-long texts truncated)."""
        from miaohui.validate.accuracy import engine_batch, run_logits

        def fn(feeds: dict[str, np.ndarray]) -> np.ndarray:
            return self.engine.infer(feeds)[self.output]

        return run_logits(fn, self.tokenizer, texts, engine_batch(self.engine, batch_size))

    async def classify(self, texts: list[str]) -> list[tuple[str, float, str]]:
        return _decided(await asyncio.to_thread(self.logits, texts), self.labels, self.decision)


class TorchClassifier:
    """An :class:`IntentClassifier` over a source checkpoint in PyTorch fp32 (the default gate reference)."""

    def __init__(self, model_dir: Path) -> None:
        from miaohui.models.checkpoint import load_checkpoint
        from miaohui.nlp.tokenizer import TextTokenizer

        loaded = load_checkpoint(Path(model_dir))
        self.module = loaded.module
        self.labels = list(loaded.meta.labels)
        self.decision = loaded.meta.decision
        self.tokenizer = TextTokenizer(loaded.tokenizer, loaded.meta.max_length)
        self.name = f"torch fp32 ({model_dir})"

    def logits(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        import torch

        from miaohui.validate.accuracy import run_logits

        def fn(feeds: dict[str, np.ndarray]) -> np.ndarray:
            with torch.inference_mode():
                ids, mask = (torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask"))
                out: np.ndarray = self.module(ids, mask).numpy()
                return out

        return run_logits(fn, self.tokenizer, texts, batch_size)

    async def classify(self, texts: list[str]) -> list[tuple[str, float, str]]:
        return _decided(await asyncio.to_thread(self.logits, texts), self.labels, self.decision)


# ------------------------------------------------------------------------------------------ text


class ChatFunction(Protocol):
    """An OpenAI-style chat call: keyword arguments of ``chat.completions.create``, a chat completion back."""

    def __call__(
        self, *, model: str, messages: list[ChatMessage], max_tokens: int, temperature: float
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
    """A :class:`TextGenerator` over an OpenAI-style chat callable (:class:`ChatFunction`)."""

    def __init__(self, create: ChatFunction, model: str) -> None:
        self.create = create
        self.model = model

    async def generate(self, messages: list[ChatMessage], max_tokens: int, temperature: float = 0.0) -> str:
        completion = await self.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=temperature
        )
        return completion_text(completion)


ChatEncoder = Callable[[Sequence[ChatMessage]], list[int]]
"""Chat messages → prompt token ids (template applied, generation prompt added)."""


class EngineGenerator:
    """A :class:`TextGenerator` over miaohui's async generation engine (continuous batching)."""

    def __init__(self, engine: AsyncLLMEngine, encode: ChatEncoder, seed: int | None = 0) -> None:
        """``encode``: e.g. :func:`miaohui.zoo.smollm.encode_chat`; ``seed`` makes sampled replies repeatable."""
        self.engine = engine
        self.encode = encode
        self.seed = seed

    async def generate(self, messages: list[ChatMessage], max_tokens: int, temperature: float = 0.0) -> str:
        from miaohui.generation.engine.params import SamplingParams

        params = SamplingParams.create(max_tokens=max_tokens, temperature=temperature, seed=self.seed)
        prompt = await asyncio.to_thread(self.encode, messages)
        parts: list[str] = []
        async for event in self.engine.generate(prompt, params):
            parts.append(event.text)
        return "".join(parts).strip()
