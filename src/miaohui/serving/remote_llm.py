"""A chat version served by the engine process of ``--workers N --shared-engine``, as an HTTP worker sees it.

:class:`RemoteLLMEngine` is the engine-process implementation of the front-end contract
(:class:`~miaohui.generation.engine.client.LLMClient`). The request goes to the engine process over the worker's
:class:`~miaohui.serving.engine_process.EngineClient`; the engine process runs the one continuous-batching loop of
the model for every worker and sends each step's tokens back in one frame per connection. So N workers stream
(HTTP, SSE, JSON) in parallel processes while one process owns the model, its KV cache and the GPU — vLLM's API
server / engine-core split. The engine process checks the prompt (its 400) and admits it (its 429); both come back
through :meth:`RequestStream.admitted`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from miaohui.errors import UnavailableError
from miaohui.generation.engine.client import EngineStoppedError, RequestStream, Sink, TokenEvent, stream_events
from miaohui.generation.engine.params import SamplingParams
from miaohui.serving.engine_messages import ItemSink, StreamError, StreamItem
from miaohui.serving.engine_process import EngineClient, remote_error

log = logging.getLogger("miaohui.generation")


class RemoteLLMEngine:
    """One chat version of the engine process, used from an HTTP worker."""

    def __init__(
        self, client: EngineClient, model: str, version: int, vocab: int, max_model_len: int, *, pinned: bool = False
    ) -> None:
        self.client, self.model, self.version = client, model, version
        self.pinned = pinned
        """Requests go to this version (a shadow candidate); else to the model's serving version, which the engine
        process chooses (so a swap another worker made is followed at once)."""
        self._vocab, self._max_model_len = vocab, max_model_len
        self._streams: dict[int, RequestStream] = {}
        self._running = False

    @classmethod
    async def connect(cls, client: EngineClient, model: str, version: int, *, pinned: bool = False) -> RemoteLLMEngine:
        """The engine process's ``model`` version ``version``; UnavailableError (503) unless it serves it (unpinned: or
        another version of the model, which unpinned requests go to anyway). ``pinned``: see :attr:`pinned`."""
        served = (await client.llm_status()).get(model, {})
        facts = served.get(version)
        if facts is None and served and not pinned:
            # another worker swapped the model to a newer version while this one was loading the older: unpinned
            # requests go to the serving version whichever this worker loaded, so this one follows it
            facts = served[max(served)]
            log.info("%s: the engine process serves version %d, not %d: following it", model, max(served), version)
        if facts is None:
            raise UnavailableError(
                f"the engine process does not serve {model} version {version} (it serves {sorted(served) or 'none'})",
                "see the engine process's load error in the server log",
            )
        return cls(client, model, version, facts.vocab, facts.max_model_len, pinned=pinned)

    @property
    def vocab(self) -> int:
        return self._vocab

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def num_running(self) -> int:
        """This worker's requests on the version (the engine process counts every worker's)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def start_phases(self) -> dict[str, float]:
        return {}  # the engine process logs its own

    async def start(self, *, warmup: bool = True) -> None:
        """Ready: the engine process loaded and warmed up the version (:meth:`connect` checked)."""
        self._running = True

    async def stop(self) -> None:
        """Unfinished streams end with an EngineStoppedError; their requests are aborted in the engine process."""
        self._running = False
        for sid, stream in list(self._streams.items()):
            self.client.abort(sid)
            stream._push(EngineStoppedError("the generation engine stopped", "retry on a running server"))
        self._streams.clear()

    async def shutdown(self) -> None:
        """:meth:`stop` (the engine process owns the model)."""
        await self.stop()

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, sink: Sink | None = None
    ) -> RequestStream:
        """Send a request to the engine process and return its stream at once (await ``stream.admitted()`` for
        the engine's verdict: its InputError / QueueFullError)."""
        if not self._running:
            raise EngineStoppedError("the generation engine is not running", "await engine.start() first")
        sid = self.client.new_generation_id()  # unique across the worker's models: one connection carries all
        stream = RequestStream(self, sid, len(prompt_ids), sink)
        self._streams[sid] = stream
        stream._admission = asyncio.ensure_future(self._admit(stream, sid, list(prompt_ids), params))
        return stream

    async def _admit(
        self, admitted: RequestStream, sid: int, prompt_ids: list[int], params: SamplingParams | None
    ) -> BaseException | None:
        """None once the engine process admitted the request, else its error (also pushed to the stream, so a
        caller that iterates without awaiting ``admitted()`` gets it there). The version that serves it is set on
        ``admitted`` even when its last token arrived first (a short answer ends before the admission's reply is
        read: the stream is no longer in ``_streams`` then, and the version would be left unset)."""
        try:
            pinned = self.version if self.pinned else None
            version = await self.client.generate(
                sid, self.model, prompt_ids, params or SamplingParams(), self._sink(sid), pinned
            )
        except asyncio.CancelledError:  # the caller went away while waiting: the engine may have admitted it
            self._streams.pop(sid, None)
            self.client.abort(sid)
            raise
        except Exception as exc:
            stream = self._streams.pop(sid, None)
            if stream is not None:
                stream._push(exc)
            return exc
        admitted.version = version
        return None

    def _sink(self, sid: int) -> ItemSink:
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
