"""The ``llamacpp`` backend's engine: llama.cpp's own server (the ``xllamacpp`` wheel) in this process, behind the
front-end contract (:class:`~miaohui.generation.engine.client.LLMClient`).

Why an engine-loop-level adapter, not a slot engine under miaohui's scheduler: ``xllamacpp`` exposes llama.cpp's
server (``Server.handle_completions`` and friends, thread-safe, continuous batching over ``n_parallel`` slots), not
``llama_decode``; its kernels and its batching come as one. The server's HTTP port is bound to a free port on
127.0.0.1 (it always listens) and never used: requests are in-process calls.

What stays miaohui's: the chat template and the tokenizer (the prompt goes in as token ids), admission (the prompt
checks and ``max_waiting``: 400 / 429 before anything runs), the queue in front of the slots (FIFO; at most
``max_running_seqs`` requests are in llama.cpp at once), the stop rules (end-of-sequence and stop token ids, stop
strings with the same hold-back as the scheduler's), the streams (:class:`RequestStream`, ``sink`` for the engine
process) and the metrics (TTFT, inter-token latency, end-to-end, tokens, running / waiting). The text is llama.cpp's
detokenization (it holds an incomplete UTF-8 character back, as miaohui's detokenizer does); ``length`` and the final
token count are llama.cpp's (it gets the limit as ``max_tokens``).

Each running request is one blocking ``handle_completions(body, callback)`` call in a worker thread (the call
releases the GIL while llama.cpp works). llama.cpp streams one chunk per token with its text and, through
``n_probs: 1`` with ``post_sampling_probs`` (no softmax over the vocabulary), its id — except a token whose text is
an incomplete character: llama.cpp sends its text with the next one and its id nowhere. The callback applies the
stop rules and hands the events to the event loop; returning True from it cancels the request in llama.cpp (a
client that went away, a stop string). llama.cpp's prompt cache is on with ``cache_prompt`` (the server's
default): a request reuses the KV of the longest common prefix its slot holds, llama.cpp picks the slot whose cached
prompt is most similar (a conversation's next turn lands on the slot of its previous one), and slots' states it
evicts are kept in RAM up to :data:`PROMPT_CACHE_RAM_MIB`; the reused tokens are reported through
``observer.on_prefix_cache`` (``miaohui_prefix_cache_hit_tokens_total``).
Sampling: greedy at temperature 0, else temperature + top-p with llama.cpp's other
samplers neutral (top-k 0, min-p 0); ``seed`` is taken modulo 2**32. With ``ignore_eos`` llama.cpp bans the
end tokens (where the other engines generate and pass them).

Structured output and log-probabilities are llama.cpp's own: ``SamplingParams.json_schema`` goes in as its
``json_schema`` with its objects closed as on the other engines (``structured.closed_objects``; llama.cpp's own
default leaves them open), and llama.cpp turns it into a GBNF grammar and samples under it; ``logprobs`` as
``n_probs`` without ``post_sampling_probs`` (the log-softmax of the raw logits, as miaohui's other engines report). A
token llama.cpp sends together with the next one (an incomplete character) reports the later token's log-probabilities
only.

Not reported here: the per-step figures (``on_step``: batch sizes, step time, queue wait per prefill): llama.cpp's
steps are inside the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miaohui.engines.target import usable_cores
from miaohui.errors import ConfigError
from miaohui.generation.build.llamacpp_artifact import GGUF_NAME, LlamaCppMeta, read_llamacpp_meta
from miaohui.generation.engine.client import EngineStoppedError, RequestStream, Sink, TokenEvent, stream_events
from miaohui.generation.engine.logprobs import TokenLogprobs
from miaohui.generation.engine.observer import GenerationObserver, safe_call
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import FinishReason, SchedulerConfig, check_prompt, check_queue, find_stop
from miaohui.generation.engine.structured import closed_objects

logger = logging.getLogger(__name__)

PROMPT_CACHE_RAM_MIB = 256
"""llama.cpp's host-memory prompt cache (``cache_ram_mib``, 8 GiB by default): slot states it evicts, kept for a
later request with the same prefix. Bounded here because the machine's memory is shared with the other engines."""
INSTALL_FIX = "pip install 'miaohui[llamacpp]' (the xllamacpp wheel, llama.cpp's server), or build another backend"


def import_xllamacpp() -> Any:
    """The ``xllamacpp`` module; ConfigError naming the install command when it is missing."""
    try:
        import xllamacpp
    except ImportError as exc:
        raise ConfigError(f"the llamacpp backend needs the xllamacpp package ({exc})", INSTALL_FIX) from exc
    return xllamacpp


def open_server(folder: Path, slots: int, slot_len: int, threads: int | None) -> Any:
    """llama.cpp's server on the version's GGUF: ``slots`` parallel sequences of ``slot_len`` tokens each (the
    KV cache holds ``slots × slot_len`` tokens), continuous batching, ``threads`` compute threads."""
    xllamacpp = import_xllamacpp()
    params = xllamacpp.CommonParams()
    params.model.path = str(folder / GGUF_NAME)
    params.n_parallel = slots
    params.n_ctx = slots * slot_len
    params.kv_unified = False  # each slot owns slot_len tokens: the context length is the same for every request
    params.cont_batching = True
    n = threads or usable_cores()  # this process's share with --workers N, as the ONNX Runtime engines
    params.cpuparams.n_threads = n
    params.cpuparams_batch.n_threads = n
    params.n_gpu_layers = 0
    params.hostnames = ["127.0.0.1"]
    params.port = 0  # a free port: the server always listens; miaohui calls it in-process
    params.endpoint_metrics = False
    params.verbosity = 2  # llama.cpp's warnings and errors (3, its default, logs every request's slot and timings)
    params.warmup = True
    params.cache_ram_mib = PROMPT_CACHE_RAM_MIB
    try:
        return xllamacpp.Server(params)
    except Exception as exc:  # the binding raises RuntimeError / ValueError for a file llama.cpp cannot load
        raise ConfigError(
            f"llama.cpp could not load {folder / GGUF_NAME}: {exc}", "rebuild the version with `miaohui build-llm`"
        ) from exc


def request_body(prompt: Sequence[int], params: SamplingParams, max_tokens: int, cache_prompt: bool) -> dict[str, Any]:
    """The llama.cpp completion request for a prompt of token ids (see the module docstring)."""
    body: dict[str, Any] = {
        "prompt": [int(t) for t in prompt],
        "max_tokens": max_tokens,
        "stream": True,
        "cache_prompt": cache_prompt,
        "n_probs": 1,
        "post_sampling_probs": True,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": 0,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "seed": -1 if params.seed is None else params.seed % (1 << 32),
    }
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.json_schema is not None:
        body["json_schema"] = closed_objects(json.loads(params.json_schema))
    if params.logprobs is not None:
        body["n_probs"] = max(1, params.logprobs)
        body["post_sampling_probs"] = False
    return body


@dataclass(frozen=True)
class Chunk:
    """One llama.cpp stream chunk (or a whole non-streamed answer)."""

    text: str = ""
    ids: tuple[int, ...] = ()
    """The ids llama.cpp reports with the text (a token whose text is an incomplete character has none)."""
    finish: str | None = None
    completion_tokens: int | None = None
    """llama.cpp's own count, on the final chunk."""
    cached_tokens: int | None = None
    """Prompt tokens llama.cpp took from its prompt cache, on the final chunk."""
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    """Per id of ``ids``, when the request asked for log-probabilities."""


def parse_chunk(chunk: Any) -> Chunk:
    """A llama.cpp chunk (an OpenAI ``text_completion`` dict, or ``{"error": ...}``) as a :class:`Chunk`."""
    if not isinstance(chunk, dict):
        return Chunk(error=f"unexpected chunk {chunk!r:.200}")
    if "error" in chunk:
        err = chunk["error"]
        return Chunk(error=str(err.get("message", err) if isinstance(err, dict) else err))
    text, ids, finish, lps = "", [], None, []
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or ""
        finish = choice.get("finish_reason") or finish
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            ids.append(int(entry["id"]))
            if "logprob" in entry:
                top = tuple((int(t["id"]), float(t["logprob"])) for t in entry.get("top_logprobs") or ())
                lps.append(TokenLogprobs(float(entry["logprob"]), top))
    usage = chunk.get("usage") or {}
    used = usage.get("completion_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return Chunk(
        text,
        tuple(ids),
        finish,
        int(used) if used is not None else None,
        cached_tokens=None if cached is None else int(cached),
        logprobs=tuple(lps),
    )


@dataclass(eq=False)
class _Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    stream: RequestStream
    arrival: float = field(default_factory=time.monotonic)
    limit: int = 0
    """Most tokens: ``max_tokens`` capped at the room the context leaves (llama.cpp's ``max_tokens``)."""
    made: int = 0
    text: str = ""
    emitted: int = 0
    reason: FinishReason | None = None
    """Set in the worker thread when a chunk finished the request, on the event loop by an abort or a failure."""
    cancel: bool = False
    """Set to stop llama.cpp at its next token (abort, stop string, engine stopping)."""
    last: float | None = None
    cache_counted: bool = False
    """The prompt cache's reuse of this request was reported (once)."""


class LlamaCppLLMEngine:
    """One llamacpp version served by llama.cpp's server in this process (see the module docstring).

    ``config``: ``max_running_seqs`` = llama.cpp's slots, ``max_model_len`` = each slot's context (capped at the
    trained context), ``max_waiting`` = the queue in front of them (more: QueueFullError, HTTP 429).
    """

    def __init__(
        self,
        folder: Path,
        config: SchedulerConfig | None = None,
        observer: GenerationObserver | None = None,
        *,
        threads: int | None = None,
        cache_prompt: bool = False,
    ) -> None:
        self.folder = Path(folder)
        self.meta: LlamaCppMeta = read_llamacpp_meta(self.folder)
        config = config or SchedulerConfig()
        if config.max_model_len > self.meta.max_positions:
            config = config.model_copy(update={"max_model_len": self.meta.max_positions})
        self.config = config
        self.observer = observer or GenerationObserver()
        self.threads = threads
        self.cache_prompt = cache_prompt
        self.eos = frozenset(self.meta.eos_token_ids)
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._stopping = False

    @property
    def vocab(self) -> int:
        return self.meta.vocab

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def start_phases(self) -> dict[str, float]:
        return {}

    @property
    def is_running(self) -> bool:
        return self._server is not None and not self._stopping

    async def start(self, *, warmup: bool = True) -> None:
        """Load the GGUF into llama.cpp (its own warm-up runs then) and, with ``warmup``, answer one short request."""
        if self.is_running:
            return
        self._stopping = False
        cfg = self.config
        self._server = await asyncio.to_thread(
            open_server, self.folder, cfg.max_running_seqs, cfg.max_model_len, self.threads
        )
        self._loop = asyncio.get_running_loop()
        if warmup:
            prompt = [self.meta.eos_token_ids[0] if self.meta.eos_token_ids else 0] * 4
            body = request_body(prompt, SamplingParams(max_tokens=2, temperature=0.0), 2, False)
            await asyncio.to_thread(self._server.handle_completions, body, lambda _chunk: False)

    async def stop(self) -> None:
        """Cancel every request (their streams end with EngineStoppedError) and shut llama.cpp's server down."""
        self._stopping = True
        error = EngineStoppedError("the generation engine stopped", "retry on a running server")
        for req in [*self._waiting, *self._running.values()]:
            req.cancel = True
            if req.reason is None:
                req.reason = "error"
                req.stream._push(error)
                self._finished(req, "error")
        self._waiting.clear()
        for thread in list(self._threads.values()):  # each returns at its request's next chunk (cancelled)
            await asyncio.to_thread(thread.join)
        self._server = None  # xllamacpp stops llama.cpp's main loop in the destructor

    async def shutdown(self) -> None:
        """:meth:`stop`: llama.cpp's server is freed with it."""
        await self.stop()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    async def __aenter__(self) -> LlamaCppLLMEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def add(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        sink: Sink | None = None,
    ) -> RequestStream:
        """Queue a request now and return its stream. Raises InputError / QueueFullError at once, as the scheduler."""
        if not self.is_running:
            raise EngineStoppedError("the generation engine is not running", "await engine.start() first")
        params = params or SamplingParams()
        cfg = self.config
        prompt = check_prompt(prompt_ids, cfg, self.meta.vocab, step_budget=False)  # llama.cpp prefills in its chunks
        if len(self._running) >= cfg.max_running_seqs:
            check_queue(len(self._waiting), cfg, "max_running_seqs")
        rid = next(self._ids)
        req = _Request(rid, prompt, params, RequestStream(self, rid, len(prompt), sink))
        req.limit = min(params.max_tokens, cfg.max_model_len - len(prompt))
        self._waiting.append(req)
        self._admit()
        return req.stream

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> AsyncIterator[TokenEvent]:
        """Stream one request's tokens; closing the generator (``aclose``) aborts the request."""
        return stream_events(self, prompt_ids, params)

    def abort(self, request_id: int) -> bool:
        """Abort a request now; its stream ends with an ``abort`` event. False when unknown or finished."""
        req = self._running.get(request_id) or next((r for r in self._waiting if r.rid == request_id), None)
        if req is None or req.reason is not None:
            return False
        req.cancel = True
        req.reason = "abort"
        req.stream._push(TokenEvent(req.rid, None, "", req.made, "abort", len(req.prompt), req.made))
        self._finished(req, "abort")
        return True

    # ---- internals -------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        """On the event loop: start waiting requests (oldest first) while a slot is free."""
        while self._waiting and len(self._running) < self.config.max_running_seqs and not self._stopping:
            req = self._waiting.popleft()
            self._running[req.rid] = req
            thread = threading.Thread(target=self._run, args=(req,), name=f"miaohui-llamacpp-{req.rid}", daemon=True)
            self._threads[req.rid] = thread
            thread.start()
        self._counts()

    def _counts(self) -> None:
        safe_call(self.observer.on_queue, len(self._running), len(self._waiting))

    def _finished(self, req: _Request, reason: FinishReason) -> None:
        """On the event loop: the request left (its slot is free once llama.cpp returns, see :meth:`_done`)."""
        if self._waiting and req in self._waiting:
            self._waiting.remove(req)
        safe_call(self.observer.on_finish, time.monotonic() - req.arrival, len(req.prompt), req.made, reason)
        self._counts()

    def _run(self, req: _Request) -> None:
        """A worker thread: one llama.cpp request, its chunks turned into events on the way."""
        loop = self._loop
        assert loop is not None
        error: str | None = None

        def on_chunk(chunk: Any) -> bool:
            nonlocal error
            if req.cancel:
                return True
            parsed = parse_chunk(chunk)
            if parsed.error is not None:
                error = parsed.error
                return True
            if parsed.cached_tokens is not None and self.cache_prompt and not req.cache_counted:
                req.cache_counted = True  # llama.cpp may repeat the usage on a last, usage-only chunk
                _soon(loop, safe_call, self.observer.on_prefix_cache, len(req.prompt), parsed.cached_tokens)
            event = self._advance(req, parsed)
            if event is not None:
                _soon(loop, self._deliver, req, [event])
            return req.cancel

        try:
            body = request_body(req.prompt, req.params, req.limit, self.cache_prompt)
            if not self._stopping:
                result = self._server.handle_completions(body, on_chunk)
                if isinstance(result, dict) and "error" in result:
                    error = parse_chunk(result).error
        except Exception as exc:  # the binding raised: this request fails, the engine goes on
            logger.exception("llama.cpp request %d failed", req.rid)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            _soon(loop, self._done, req, error)

    def _advance(self, req: _Request, chunk: Chunk) -> TokenEvent | None:
        """A worker thread: one chunk's tokens and text, with miaohui's stop rules (as the scheduler's ``_advance`` /
        ``_emit``: an end-of-sequence or stop token ends with ``stop`` and adds no text, a stop string cuts the text
        before it, the tail that could still become one is held back). ``length`` and the final token count are
        llama.cpp's (it was given the limit as ``max_tokens``)."""
        p = req.params
        if not chunk.text and not chunk.ids and chunk.finish is None:
            return None
        req.made += len(chunk.ids) or (1 if chunk.text else 0)
        reason: FinishReason | None = None
        text = chunk.text
        if any((t in self.eos and not p.ignore_eos) or t in p.stop_token_ids for t in chunk.ids):
            reason, text = "stop", ""
        elif chunk.finish is not None:
            reason = "length" if chunk.finish == "length" else "stop"
        if chunk.completion_tokens is not None:
            req.made = chunk.completion_tokens
        if text:
            full = req.text = req.text + text
            if p.stop:
                hit = find_stop(full, len(text), p.stop, p.max_stop_len)
                if hit is not None:
                    req.text, reason = full[:hit], "stop"
        if reason is not None:
            req.cancel = True  # llama.cpp stops at its next token (or has stopped already)
            end = len(req.text)
        else:
            end = len(req.text) - max(0, p.max_stop_len - 1) if p.stop else len(req.text)
        delta = ""
        if end > req.emitted:
            delta, req.emitted = req.text[req.emitted : end], end
        last = chunk.ids[-1] if chunk.ids else None
        lp = None
        if p.logprobs is not None and chunk.logprobs:
            lp = chunk.logprobs[-1]
            lp = TokenLogprobs(lp.logprob, lp.top[: p.logprobs])
        return TokenEvent(req.rid, last, delta, req.made, reason, len(req.prompt), req.made, lp)

    def _deliver(self, req: _Request, events: list[TokenEvent]) -> None:
        """On the event loop: a request's new events to its stream, and their metrics."""
        if req.reason is not None:  # aborted or failed meanwhile: its stream has ended
            return
        now = time.monotonic()
        if req.last is None:
            safe_call(self.observer.on_first_token, now - req.arrival)
        else:
            safe_call(self.observer.on_tokens, [now - req.last])
        req.last = now
        for event in events:
            req.stream._push(event)
            if event.finish_reason is not None:
                req.reason = event.finish_reason
                self._finished(req, event.finish_reason)
                break

    def _done(self, req: _Request, error: str | None) -> None:
        """On the event loop: llama.cpp returned from the request; its slot is free for the next one."""
        self._running.pop(req.rid, None)
        self._threads.pop(req.rid, None)
        if req.reason is None:
            if error is not None:
                exc: BaseException = EngineStoppedError(f"llama.cpp failed the request: {error}", "see the server log")
                req.reason = "error"
                req.stream._push(exc)
                self._finished(req, "error")
            else:  # llama.cpp returned without a final chunk
                req.reason = "stop" if req.made < req.limit else "length"
                text = req.text[req.emitted :]
                req.stream._push(TokenEvent(req.rid, None, text, req.made, req.reason, len(req.prompt), req.made))
                self._finished(req, req.reason)
        self._admit()


def _soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is left to stream to
        loop.call_soon_threadsafe(fn, *args)
