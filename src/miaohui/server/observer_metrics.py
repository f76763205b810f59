"""The generation loop's metrics hooks, written to the server's Prometheus :class:`Metrics`.

Per model: TTFT, inter-token latency and end-to-end latency histograms, prompt and generated token
counters, running and waiting sequence gauges; per step: sequences in the batch, budgeted tokens and the
step's wall time (the batch-size, batch-token and compute histograms the dynamic batcher also feeds), and where
the step's time went: ``miaohui_stage_duration_seconds{stage="decode"|"prefill"|"loop"}`` (``loop``: the loop's
own host time between model calls); prompts per prefill in ``miaohui_prefill_sequences``, of those steps the mixed ones
in ``miaohui_mixed_steps_total``; prompt tokens looked up in the prefix cache and those it gave in
``miaohui_prefix_cache_queried_tokens_total`` / ``miaohui_prefix_cache_hit_tokens_total``; how long each prompt
waited for its prefill step in ``miaohui_queue_duration_seconds`` (the batcher's queue histogram: TTFT's queue part).
Label children are bound once here, so a hook costs one ``observe``/``inc``/``set``.
"""

from __future__ import annotations

from collections.abc import Callable

from miaohui.generation.engine.observer import GenerationObserver, StepReport
from miaohui.server.metrics import Metrics, observe_many


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
        self._queue = metrics.queue_seconds.labels(model, v)
        self._prefills = metrics.prefill_seqs.labels(model)
        self._mixed = metrics.mixed_steps.labels(model)
        self._prefix_hit = metrics.prefix_hit_tokens.labels(model)
        self._prefix_kept = metrics.prefix_kept_tokens.labels(model)
        self._prefix_queried = metrics.prefix_queried_tokens.labels(model)
        stage = metrics.serving_stage_seconds
        self._decode, self._prefill, self._loop = (stage.labels(model, v, s) for s in ("decode", "prefill", "loop"))

    def on_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def on_token(self, itl_s: float) -> None:
        self._itl.observe(itl_s)

    def on_tokens(self, itls_s: list[float]) -> None:
        observe_many(self._itl, itls_s)

    def on_finish(self, e2e_s: float, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        self._e2e.observe(e2e_s)
        self._prompt.inc(prompt_tokens)
        self._generated.inc(completion_tokens)

    def on_prefix_cache(self, prompt_tokens: int, cached_tokens: int, kept_tokens: int = 0) -> None:
        self._prefix_queried.inc(prompt_tokens)
        self._prefix_hit.inc(cached_tokens)
        self._prefix_kept.inc(kept_tokens)

    def on_queue(self, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)

    def on_step(self, step: StepReport) -> None:
        self._batch.observe(step.prefill_seqs + step.decode_seqs)
        self._tokens.observe(step.batched_tokens)
        self._compute.observe(step.step_s)
        if step.decode_seqs:
            self._decode.observe(step.decode_s)
        if step.prefill_seqs:
            self._prefill.observe(step.prefill_s)
            self._prefills.observe(step.prefill_seqs)
            if step.mixed:
                self._mixed.inc()
        if step.loop_s is not None:
            self._loop.observe(step.loop_s)
        if step.queue_s:
            observe_many(self._queue, list(step.queue_s))


def chat_observers(metrics: Metrics) -> Callable[[str, int], MetricsObserver]:
    """The model manager's ``chat_observer_factory``: each chat version's loop reports to ``metrics``."""
    return lambda name, version: MetricsObserver(metrics, name, version)
