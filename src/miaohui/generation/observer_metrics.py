"""The generation loop's metrics hooks, written to the server's Prometheus :class:`Metrics`.

Per model: TTFT, inter-token latency and end-to-end latency histograms, prompt and generated token
counters, running and waiting sequence gauges; per step: sequences in the batch, budgeted tokens and the
step's wall time (the batch-size, batch-token and compute histograms the dynamic batcher also feeds).
Label children are bound once here, so a hook costs one ``observe``/``inc``/``set``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miaohui.generation.observer import GenerationObserver

if TYPE_CHECKING:
    from miaohui.server.metrics import Metrics


class MetricsObserver(GenerationObserver):
    """:class:`GenerationObserver` → ``miaohui_*`` series labelled with the model (and version)."""

    def __init__(self, metrics: Metrics, model: str, version: int | str) -> None:
        v = str(version)
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)
        self._e2e = metrics.e2e.labels(model)
        self._prompt = metrics.prompt_tokens.labels(model)
        self._generated = metrics.generated_tokens.labels(model)
        self._running = metrics.running.labels(model)
        self._waiting = metrics.waiting.labels(model)
        self._batch = metrics.batch_size.labels(model, v)
        self._tokens = metrics.batch_tokens.labels(model, v)
        self._compute = metrics.compute_seconds.labels(model, v)

    def on_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def on_token(self, itl_s: float) -> None:
        self._itl.observe(itl_s)

    def on_finish(self, e2e_s: float, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        self._e2e.observe(e2e_s)
        self._prompt.inc(prompt_tokens)
        self._generated.inc(completion_tokens)

    def on_queue(self, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)

    def on_step(self, prefill_seqs: int, decode_seqs: int, batched_tokens: int, step_s: float, kv_length: int) -> None:
        self._batch.observe(prefill_seqs + decode_seqs)
        self._tokens.observe(batched_tokens)
        self._compute.observe(step_s)
