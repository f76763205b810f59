"""The front-end contract: what the OpenAI API, the dialogue pipelines and the engine process call to generate.

:class:`LLMClient` is one Protocol with three implementations, chosen once when a version loads
(:func:`miaohui.serving.chat.make_client`, in the spirit of vLLM's ``EngineCoreClient`` / ``make_client``):

* :class:`~miaohui.generation.engine.engine_loop.AsyncLLMEngine` — the model in this process, miaohui's step loop;
* :class:`~miaohui.generation.engine.llamacpp_engine.LlamaCppLLMEngine` — llama.cpp's server in this process;
* :class:`~miaohui.serving.remote_llm.RemoteLLMEngine` — an HTTP worker of ``--shared-engine``: the model runs in the
  engine process, which serves it through one of the two above.

A request is ``stream = client.add(prompt_ids, params)`` (InputError / QueueFullError at once for a local engine;
a remote one answers them through ``await stream.admitted()``), then ``async for event in stream`` (one
:class:`TokenEvent` per step; the last has ``finish_reason``), and ``stream.abort()`` (or ``aclose``) when the
caller leaves. Prompts are checked once, by the engine that owns the model
(:func:`~miaohui.generation.engine.scheduler.check_prompt`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from miaohui.errors import EngineStoppedError

if TYPE_CHECKING:
    from miaohui.generation.engine.logprobs import TokenLogprobs
    from miaohui.generation.engine.params import SamplingParams
    from miaohui.generation.engine.scheduler import FinishReason

__all__ = ["EngineStoppedError", "LLMClient", "RequestStream", "Sink", "TokenEvent", "stream_events"]


@dataclass(frozen=True)
class TokenEvent:
    """One streamed step of one request. The last event has ``finish_reason`` set."""

    request_id: int
    token_id: int | None
    """The new token (None on an abort/error finish)."""
    text: str
    """Text delta to append (may be empty: an incomplete character, or text held back by a stop string)."""
    index: int
    """Number of generated tokens so far."""
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: TokenLogprobs | None
    """The token's log-probabilities when the request asked (``SamplingParams.logprobs``)."""

    def __init__(
        self,
        request_id: int,
        token_id: int | None,
        text: str,
        index: int,
        finish_reason: FinishReason | None,
        prompt_tokens: int,
        completion_tokens: int,
        logprobs: TokenLogprobs | None = None,
    ) -> None:
        # written out: one event per streamed token, and a frozen dataclass's generated __init__ (object.__setattr__
        # per field) takes twice as long. Still frozen: no assignment after __init__.
        d = self.__dict__
        d["request_id"] = request_id
        d["token_id"] = token_id
        d["text"] = text
        d["index"] = index
        d["finish_reason"] = finish_reason
        d["prompt_tokens"] = prompt_tokens
        d["completion_tokens"] = completion_tokens
        d["logprobs"] = logprobs


class RequestStream:
    """Async iterator of one request's :class:`TokenEvent` s; ``aclose()`` (or leaving ``async with``)
    aborts the request if it is still running. Cancelling the task that awaits it aborts it too."""

    def __init__(self, engine: _Aborter, request_id: int, prompt_tokens: int, sink: Sink | None = None) -> None:
        self._engine = engine
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self._sink = sink
        self._admission: asyncio.Future[BaseException | None] | None = None
        """Set by a remote engine: resolves to None once admitted, else to the rejection."""
        self.finished = False
        self.version: int | None = None
        """The model version that serves the request, where the engine process chose it (None: the caller's)."""
        self._held: BaseException | None = None
        """An error :meth:`ready` took off the queue: raised by the next read, after the events before it."""

    def _push(self, item: TokenEvent | BaseException) -> None:
        if self._sink is not None:  # forwarded as it comes (the engine process's streams to its workers)
            self._sink(item)
        else:
            self._queue.put_nowait(item)

    async def admitted(self) -> None:
        """Wait until the engine accepted the request (at once for a local engine; a remote one answers its
        InputError / QueueFullError here, before the caller commits to a response)."""
        if self._admission is not None:
            error = await self._admission
            if error is not None:
                self.finished = True
                raise error

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        item: TokenEvent | BaseException
        if self._held is not None:
            item, self._held = self._held, None
        else:
            if self.finished and self._queue.empty():
                raise StopAsyncIteration
            try:
                item = await self._queue.get()
            except asyncio.CancelledError:
                self.abort()
                raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        return item

    def ready(self) -> list[TokenEvent]:
        """The events already queued behind the one just read (the reader fell behind the engine), up to the
        final one, without waiting; an error among them is held back and raised by the next read."""
        out: list[TokenEvent] = []
        queue = self._queue
        while self._held is None and not self.finished and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, BaseException):
                self._held = item
                break
            out.append(item)
            if item.finish_reason is not None:
                self.finished = True
        return out

    def abort(self) -> None:
        """Stop generating now (idempotent); the slot is free for the next step."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


Sink = Callable[["TokenEvent | BaseException"], None]
"""Receives a request's events (and a final exception) instead of its stream's queue (the engine process forwards
them to its workers)."""


class _Aborter(Protocol):
    def abort(self, request_id: int) -> bool: ...


class LLMClient(Protocol):
    """One served causal-LM version, as its callers see it (see the module docstring)."""

    @property
    def vocab(self) -> int:
        """Token ids a prompt may hold: ``[0, vocab)``."""
        ...

    @property
    def max_model_len(self) -> int:
        """Prompt plus answer, in tokens."""
        ...

    @property
    def is_running(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def start_phases(self) -> dict[str, float]:
        """The executor's own split of its start in seconds (a GPU slot engine's ``load`` / ``compile`` /
        ``capture``); empty where it keeps none or runs in another process."""
        ...

    async def start(self, *, warmup: bool = True) -> None:
        """Ready to take requests (with ``warmup``: one short request has run through the model)."""
        ...

    async def stop(self) -> None:
        """Take no new requests; unfinished streams end with :class:`EngineStoppedError`."""
        ...

    async def shutdown(self) -> None:
        """:meth:`stop`, then free the model (its memory, threads and files). The client is not used again."""
        ...

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, sink: Sink | None = None
    ) -> RequestStream:
        """Queue a request now and return its stream."""
        ...

    def abort(self, request_id: int) -> bool:
        """Stop a request now; its stream ends with an ``abort`` event. False when it is unknown or finished."""
        ...

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> AsyncIterator[TokenEvent]:
        """One request's events; closing the generator aborts the request."""
        ...


async def stream_events(
    engine: LLMClient, prompt_ids: Sequence[int], params: SamplingParams | None = None
) -> AsyncIterator[TokenEvent]:
    """Add a request to ``engine`` (local or remote) and yield its events; closing the generator aborts it."""
    stream = engine.add(prompt_ids, params)
    try:
        async for event in stream:
            yield event
    finally:
        stream.abort()
