"""Metrics hooks of the generation loop. Every method is a no-op here; the server subclasses it with
Prometheus histograms (TTFT, inter-token latency, end-to-end latency), token counters and gauges.

Hooks run on the event loop thread where the loop decides; an exception raised by a hook is logged and
never reaches the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepReport:
    """What one step of the generation loop did and where its time went."""

    prefill_seqs: int
    decode_seqs: int
    batched_tokens: int
    """The step's budgeted tokens (prompt tokens of the prefills + one per decoding sequence)."""
    step_s: float
    """Wall time of the model call (decode + prefill + sampling)."""
    kv_length: int
    """The batch's longest KV length after the step."""
    decode_s: float
    prefill_s: float
    loop_s: float | None
    """The loop's own time since the previous step was collected, model calls left out (scheduling, the previous
    step's update and detokenization, waiting for the scheduler lock or the GIL); None after the loop sat idle."""
    queue_s: tuple[float, ...] = ()
    """How long each prompt this step prefilled had waited for it (arrival → scheduled): TTFT's queue part."""
    mixed: bool = False
    """The prefill ran as extra rows of the decode step (a mixed step)."""
    prompt_tokens: int = 0
    """Prompt tokens the step's prefill looked up in the prefix cache (0: none, or no prefix cache)."""
    cached_tokens: int = 0
    """Of those, the tokens whose KV the prefix cache gave (not computed)."""
    kept_tokens: int = 0
    """Of those, the tokens their slot still held from the turn before (nothing copied; the GPU slot engine)."""


class GenerationObserver:
    """No-op metrics hooks of :class:`~miaohui.generation.engine.engine_loop.AsyncLLMEngine`."""

    def on_first_token(self, ttft_s: float) -> None:
        """A request's first token was streamed ``ttft_s`` after it was added (queue wait + prefill)."""

    def on_token(self, itl_s: float) -> None:
        """A later token was streamed ``itl_s`` after the request's previous one (inter-token latency)."""

    def on_tokens(self, itls_s: list[float]) -> None:
        """The inter-token latencies of one step's later tokens, all at once (the loop calls this, once per step;
        the default hands each to :meth:`on_token`)."""
        for itl_s in itls_s:
            self.on_token(itl_s)

    def on_finish(self, e2e_s: float, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        """A request ended (``stop``, ``length``, ``abort`` or ``error``) ``e2e_s`` after it was added."""

    def on_prefix_cache(self, prompt_tokens: int, cached_tokens: int, kept_tokens: int = 0) -> None:
        """A request's ``prompt_tokens`` were looked up in a prefix cache and ``cached_tokens`` of them came from it
        (engines that report their cache per request: llama.cpp's prompt cache; the ONNX Runtime runner reports each
        prefill step's prompts together); ``kept_tokens`` of those their slot still held (the GPU slot engine)."""

    def on_queue(self, running: int, waiting: int) -> None:
        """Running and waiting sequence counts changed (after each step, add and abort)."""

    def on_step(self, step: StepReport) -> None:
        """One step computed (see :class:`StepReport`)."""


def safe_call(hook: Callable[..., Any], *args: Any) -> None:
    try:
        hook(*args)
    except Exception:
        logger.exception("generation observer hook %s failed", getattr(hook, "__name__", hook))
