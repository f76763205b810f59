"""A causal LM served by the engine process of ``--workers N --shared-engine``, as an HTTP worker sees it.

:class:`RemoteLLMEngine` has the part of :class:`~miaohui.generation.engine.engine_loop.AsyncLLMEngine`'s interface the
OpenAI routes and the dialogue pipelines use (``add`` → a :class:`RequestStream`, ``generate``, ``abort``,
``start``/``stop``, ``is_running``). The request goes to the engine process over the worker's
:class:`~miaohui.serving.engine_process.EngineClient`; the engine process runs the one continuous-batching loop of
the model for every worker and sends each step's tokens back in one frame per connection. So N workers stream
(HTTP, SSE, JSON) in parallel processes while one process owns the model, its KV cache and the GPU — vLLM's API
server / engine-core split. Prompt checks that need no engine state are made here (a 400 before anything is sent);
the engine's own rejections (a full queue: 429) come back through :meth:`RequestStream.admitted`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from miaohui.generation.engine.engine_loop import (
    EngineStoppedError,
    RequestStream,
    TokenEvent,
    check_token_ids,
    stream_events,
)
from miaohui.generation.engine.params import SamplingParams
from miaohui.serving.engine_messages import StreamError, StreamItem
from miaohui.serving.engine_process import EngineClient, remote_error


class RemoteLLMEngine:
    """One causal LM of the engine process, used from an HTTP worker."""

    def __init__(self, client: EngineClient, model: str, vocab: int) -> None:
        self.client, self.model, self.vocab = client, model, vocab
        self._streams: dict[int, RequestStream] = {}
        self._running = False

    @property
    def is_running(self) -> bool:
        return self._running

    async def start(self, *, warmup: bool = True) -> None:
        """Ready once the engine process reports the model loaded (it warmed it up)."""
        status = await self.client.llm_status()
        if self.model not in status["models"]:
            why = status["failures"].get(self.model, "not loaded there")
            raise EngineStoppedError(f"the engine process does not serve {self.model!r}: {why}", "see its log")
        self._running = True

    async def stop(self) -> None:
        """Unfinished streams end with an EngineStoppedError; their requests are aborted in the engine process."""
        self._running = False
        for sid, stream in list(self._streams.items()):
            self.client.abort(sid)
            stream._push(EngineStoppedError("the generation engine stopped", "retry on a running server"))
        self._streams.clear()

    def add(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> RequestStream:
        """Send a request to the engine process and return its stream at once (await ``stream.admitted()`` for
        the engine's verdict). Raises InputError for token ids outside the vocabulary, like a local engine."""
        if not self._running:
            raise EngineStoppedError("the generation engine is not running", "await engine.start() first")
        check_token_ids(prompt_ids, self.vocab)
        sid = self.client.new_generation_id()  # unique across the worker's models: one connection carries all
        stream = RequestStream(self, sid, len(prompt_ids))
        self._streams[sid] = stream
        stream._admission = asyncio.ensure_future(self._admit(sid, [int(t) for t in prompt_ids], params))
        return stream

    async def _admit(self, sid: int, prompt_ids: list[int], params: SamplingParams | None) -> BaseException | None:
        """None once the engine process admitted the request, else its error (also pushed to the stream, so a
        caller that iterates without awaiting ``admitted()`` gets it there)."""
        try:
            await self.client.generate(sid, self.model, prompt_ids, params or SamplingParams(), self._sink(sid))
        except asyncio.CancelledError:  # the caller went away while waiting: the engine may have admitted it
            self._streams.pop(sid, None)
            self.client.abort(sid)
            raise
        except Exception as exc:
            stream = self._streams.pop(sid, None)
            if stream is not None:
                stream._push(exc)
            return exc
        return None

    def _sink(self, sid: int) -> Any:
        def push(item: StreamItem) -> None:
            stream = self._streams.get(sid)
            if stream is None:
                return
            if isinstance(item, StreamError):
                self._finish(sid)
                stream._push(remote_error(item.error))
                return
            _, token_id, text, index, finish, prompt_tokens, completion_tokens = item
            if finish is not None:
                self._finish(sid)
            stream._push(TokenEvent(sid, token_id, text, index, finish, prompt_tokens, completion_tokens))

        return push

    def _finish(self, sid: int) -> None:
        self._streams.pop(sid, None)
        self.client.release(sid)

    def abort(self, request_id: int) -> bool:
        """Stop a request (its stream ends with an ``abort`` event); False when it is unknown or finished."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        self.client.abort(request_id)
        stream._push(TokenEvent(request_id, None, "", 0, "abort", stream.prompt_tokens, 0))
        return True

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> AsyncIterator[TokenEvent]:
        """Stream one request's tokens; closing the generator aborts the request."""
        return stream_events(self, prompt_ids, params)
