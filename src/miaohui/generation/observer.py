"""Metrics hooks of the generation loop. Every method is a no-op here; the server subclasses it with
Prometheus histograms (TTFT, inter-token latency, end-to-end latency), token counters and gauges.

Hooks run on the event loop thread where the loop decides; an exception raised by a hook is logged and
never reaches the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class GenerationObserver:
    """No-op metrics hooks of :class:`~miaohui.generation.engine_loop.AsyncLLMEngine`."""

    def on_first_token(self, ttft_s: float) -> None:
        """A request's first token was streamed ``ttft_s`` after it was added (queue wait + prefill)."""

    def on_token(self, itl_s: float) -> None:
        """A later token was streamed ``itl_s`` after the request's previous one (inter-token latency)."""

    def on_finish(self, e2e_s: float, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        """A request ended (``stop``, ``length``, ``abort`` or ``error``) ``e2e_s`` after it was added."""

    def on_queue(self, running: int, waiting: int) -> None:
        """Running and waiting sequence counts changed (after each step, add and abort)."""

    def on_step(self, prefill_seqs: int, decode_seqs: int, batched_tokens: int, step_s: float, kv_length: int) -> None:
        """One step computed: how many sequences prefilled / decoded, the step's budgeted tokens, its
        wall time, and the batch's KV length after it."""


def safe_call(hook: Callable[..., Any], *args: Any) -> None:
    try:
        hook(*args)
    except Exception:
        logger.exception("generation observer hook %s failed", getattr(hook, "__name__", hook))
