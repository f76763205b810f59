"""Prometheus metrics, all prefixed ``miaohui_``, recorded where decisions are made (explicit buckets).

One :class:`Metrics` per server (its own registry, so several servers can live in one test process).
Process CPU/memory and GPU (NVML) gauges are read at scrape time.

With ``--workers N`` (N > 1) prometheus_client's multiprocess mode is on: ``PROMETHEUS_MULTIPROC_DIR`` is set by
the supervisor (:mod:`miaohui.server.workers`) before the workers start, every worker writes its values to files
there (named ``*_w<i>.db`` by worker index, :func:`use_worker_files`), and ``/metrics`` on any worker renders the
whole server: counters and histograms summed over the workers; gauges per their ``multiprocess_mode``
(queue depth, in-flight requests, running/waiting sequences: ``livesum``, the total over live workers; shadow
drift: ``livemax``); ``miaohui_process_*`` summed over the supervisor and its workers; plus
``miaohui_worker_requests_total{worker,protocol}``, each worker's share of the requests. Model readiness is the
answering worker's (all workers load the same repository). The Triton statistics endpoints read the same totals.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import json
import os
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from miaohui.gcpolicy import PAUSE_BUCKETS, flush_pauses, record_pauses
from miaohui.priority import CALLER
from miaohui.serving.batcher import BatcherObserver, RejectReason

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
REFUSED_AFTER_GATE = frozenset({429, 503, 504})
"""Statuses that refuse a request the key gate admitted (a full queue, stopping or unavailable, a passed deadline):
counted in ``miaohui_rejected_requests_total`` under the request's tenant, as the gate's own refusals are."""


def observe_many(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for every value, in one pass: each touched bucket and the sum incremented once
    (prometheus_client's ``observe`` takes two locks and scans the buckets per value; the generation loop observes
    one inter-token latency per streamed token). A histogram child without the expected internals (another
    prometheus_client) falls back to ``observe`` per value."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            histogram.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        i = bisect.bisect_left(bounds, v)  # the first bucket with v <= its bound (the last one is +Inf)
        counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, n in counts.items():
        buckets[i].inc(n)


def multiprocess_dir() -> str | None:
    """The multiprocess metrics directory when metrics are shared by several workers, else None."""
    return os.environ.get(MULTIPROC_ENV) or None


def use_worker_files(index: int) -> None:
    """Name this process's metric files by worker index (``counter_w3.db``), not pid: a restarted worker
    continues its counters, the series stay bounded and the supervisor knows which files a dead worker left.
    Call before any metric is created (prometheus_client reads it when a metric value is made)."""
    from prometheus_client import values

    if multiprocess_dir() and hasattr(values, "ValueClass"):
        values.ValueClass = values.MultiProcessValue(process_identifier=lambda: f"w{index}")


LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
"""Time to first token: finer between 10 and 100 ms, where a GPU server's p99 lives (the issue's goal is 50 ms)."""
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384)
UNKNOWN_MODEL = "_unknown"
"""The ``model`` label of requests for models that exist neither on disk nor loaded: client-supplied names
must not create unbounded series. (Real model names start with a letter or digit, so this never clashes.)"""


class _ProcessCollector(Collector):
    """CPU seconds and resident memory of this process (psutil); with several workers, of the supervisor and
    all its worker processes together."""

    def __init__(self, all_workers: bool = False) -> None:
        self._proc = psutil.Process(os.getpid())
        self._all = all_workers

    def _processes(self) -> list[psutil.Process]:
        if not self._all:
            return [self._proc]
        with contextlib.suppress(psutil.Error):
            parent = self._proc.parent()
            if parent is not None:
                return [parent, *parent.children()]
        return [self._proc]

    def collect(self) -> Iterator[Metric]:
        cpu = rss = 0.0
        for proc in self._processes():
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                cpu += times.user + times.system
                rss += proc.memory_info().rss
        yield CounterMetricFamily(
            "miaohui_process_cpu_seconds",
            "User+system CPU seconds of the server process (all worker processes with --workers N)",
            value=cpu,
        )
        yield GaugeMetricFamily(
            "miaohui_process_resident_memory_bytes",
            "Resident memory of the server process (all worker processes with --workers N)",
            value=rss,
        )


class _WorkerShareCollector(Collector):
    """``miaohui_worker_requests_total{worker,protocol}``: requests answered per worker, read at scrape time
    from the workers' counter files (multiprocess mode sums counters over workers; this keeps the split)."""

    _FILE = re.compile(r"counter_w(\d+)\.db$")

    def __init__(self, directory: str) -> None:
        self._dir = directory

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.mmap_dict import MmapedDict

        family = CounterMetricFamily(
            "miaohui_worker_requests", "Requests answered, per worker process", labels=["worker", "protocol"]
        )
        for path in sorted(glob.glob(os.path.join(self._dir, "counter_w*.db"))):
            match = self._FILE.search(path)
            if match is None:
                continue
            totals: dict[str, float] = {}
            with contextlib.suppress(OSError, ValueError):
                for key, value, _, _ in MmapedDict.read_all_values_from_file(path):
                    _, sample, labels, _ = json.loads(key)
                    if sample == "miaohui_requests_total":
                        protocol = labels.get("protocol", "")
                        totals[protocol] = totals.get(protocol, 0.0) + value
            for protocol, value in sorted(totals.items()):
                family.add_metric([match.group(1), protocol], value)
        yield family


class ModelStateCollector(Collector):
    """``miaohui_model_ready{model,version}``: 1 for each loaded, warmed-up version; ``miaohui_model_start_seconds
    {model,version,phase}``: where its start went — ``load``, ``warmup`` (load + warm-up = the cold start) and
    ``compile`` (a ``fast_start`` version's background compile, once done). Read at scrape time."""

    def __init__(self, states: Callable[[], Iterable[tuple[str, int, bool, dict[str, float]]]]) -> None:
        self._states = states

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily(
            "miaohui_model_ready", "1 if the model version is loaded and warm", labels=["model", "version"]
        )
        start = GaugeMetricFamily(
            "miaohui_model_start_seconds",
            "Seconds a model version's start took, by phase: load, warmup (until ready), compile (fast_start, after); "
            "GPU engines split theirs: engine_load, engine_compile (first calls), engine_capture (CUDA graphs)",
            labels=["model", "version", "phase"],
        )
        for name, version, ok, timings in self._states():
            ready.add_metric([name, str(version)], 1.0 if ok else 0.0)
            for phase, seconds in timings.items():
                start.add_metric([name, str(version), phase], seconds)
        yield ready
        yield start


class _GpuCollector(Collector):
    """NVML gauges per GPU; emits nothing where there is no NVIDIA GPU or no NVML."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._count = pynvml.nvmlDeviceGetCount()
        except Exception:
            self._nvml = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self._nvml is None:
            return
        nv = self._nvml
        util = GaugeMetricFamily("miaohui_gpu_utilization_ratio", "GPU busy fraction (NVML)", labels=["gpu"])
        mem = GaugeMetricFamily("miaohui_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=["gpu"])
        temp = GaugeMetricFamily("miaohui_gpu_temperature_celsius", "GPU temperature (NVML)", labels=["gpu"])
        power = GaugeMetricFamily("miaohui_gpu_power_watts", "GPU power draw (NVML)", labels=["gpu"])
        for i in range(self._count):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            with contextlib.suppress(Exception):
                util.add_metric([str(i)], nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
                mem.add_metric([str(i)], nv.nvmlDeviceGetMemoryInfo(h).used)
                temp.add_metric([str(i)], nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
                power.add_metric([str(i)], nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        yield from (util, mem, temp, power)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.multiprocess = multiprocess_dir()
        """The shared metrics directory of ``--workers N`` (None: one process, values in memory)."""
        self._children: dict[tuple[Any, ...], Any] = {}
        self.requests = Counter(
            "miaohui_requests",
            "Requests answered, by model, version, protocol and status code",
            ["model", "version", "protocol", "code"],
            registry=r,
        )
        self.failures = Counter(
            "miaohui_request_failures",
            "Requests that failed, by reason",
            ["model", "version", "reason"],
            registry=r,
        )
        self.refusals = Counter(
            "miaohui_rejected_requests",
            "Requests refused by the API key gate (401, 403, 429) or after it (429, 503, 504), by tenant (never "
            "the key; '(none)' without a valid key), status code and reason",
            ["tenant", "code", "reason"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "miaohui_request_duration_seconds",
            "Request latency in the server",
            ["model", "protocol"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "miaohui_queue_duration_seconds",
            "Time a row waited in the batch queue",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "miaohui_compute_duration_seconds",
            "Engine time per batch",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.serving_stage_seconds = Histogram(
            "miaohui_stage_duration_seconds",
            "Where a request's time goes around the batcher: tokenize and slots per request; the engine's "
            "h2d, gpu and d2h per batch (CUDA events, GPU engines); per generation step: decode, prefill and "
            "the loop's own host time (loop)",
            ["model", "version", "stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "miaohui_batch_size",
            "Rows per executed batch",
            ["model", "version"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "miaohui_batch_tokens",
            "Padded tokens per executed batch",
            ["model", "version"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "miaohui_queue_depth",
            "Rows waiting in the batch queue",
            ["model", "version"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.rejected = Counter(
            "miaohui_rejected",
            "Rows the batcher rejected, by reason",
            ["model", "version", "reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "miaohui_inflight_requests", "Requests being handled", ["model"], registry=r, multiprocess_mode="livesum"
        )
        # generation
        self.ttft = Histogram(
            "miaohui_time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "miaohui_inter_token_latency_seconds",
            "Time between output tokens",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "miaohui_generation_duration_seconds",
            "Whole generation request",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("miaohui_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generated_tokens = Counter("miaohui_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.running = Gauge(
            "miaohui_running_sequences", "Sequences being decoded", ["model"], registry=r, multiprocess_mode="livesum"
        )
        self.waiting = Gauge(
            "miaohui_waiting_sequences",
            "Sequences waiting to start",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.prefill_seqs = Histogram(
            "miaohui_prefill_sequences",
            "Prompts prefilled together in one generation step (steps with a prefill)",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.mixed_steps = Counter(
            "miaohui_mixed_steps_total",
            "Generation steps whose prompts ran as extra rows of the decode step (mixed steps); of the steps with a "
            "prefill (miaohui_prefill_sequences_count) the rest took a separate prefill",
            ["model"],
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "miaohui_prefix_cache_hit_tokens",
            "Prompt tokens whose KV came from the prefix cache (not computed); over "
            "miaohui_prefix_cache_queried_tokens_total: the hit rate",
            ["model"],
            registry=r,
        )
        self.prefix_kept_tokens = Counter(
            "miaohui_prefix_cache_kept_tokens",
            "Of miaohui_prefix_cache_hit_tokens_total, the tokens their KV slot still held from the conversation's "
            "last turn, so nothing was copied (the GPU slot engine)",
            ["model"],
            registry=r,
        )
        self.prefix_queried_tokens = Counter(
            "miaohui_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache (every prompt token, while the model has a prefix cache)",
            ["model"],
            registry=r,
        )
        # dialogue pipelines
        self.stage_seconds = Histogram(
            "miaohui_pipeline_stage_seconds",
            "Time per pipeline stage",
            ["pipeline", "stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.interventions = Counter(
            "miaohui_compliance_interventions",
            "Compliance rules that changed a reply",
            ["pipeline", "rule", "action"],
            registry=r,
        )
        self.shadow = Gauge(
            "miaohui_shadow_drift",
            "Shadow-version comparison figures",
            ["model", "figure"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.shadow_keywords = Gauge(
            "miaohui_shadow_keyword_frequency",
            "Share of a shadowed chat model's answers that contain the keyword, per version (primary / candidate)",
            ["model", "keyword", "version"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.gc_pause = Histogram(
            "miaohui_gc_pause_seconds",
            "Python garbage-collector pauses in the server's processes, by generation (miaohui.gcpolicy)",
            ["generation"],
            buckets=PAUSE_BUCKETS,
            registry=r,
        )
        record_pauses(self.gc_pause)
        self.exposition = r
        """What ``/metrics`` renders: ``registry`` itself, or with several workers a registry that reads every
        worker's files plus the collectors computed at scrape time."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            self.exposition = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposition, path=self.multiprocess)
            self.exposition.register(_WorkerShareCollector(self.multiprocess))
        self.exposition.register(_ProcessCollector(all_workers=bool(self.multiprocess)))
        self.exposition.register(_GpuCollector())

    def observer(self, model: str, version: int) -> BatcherObserver:
        return _BatchMetrics(self, model, str(version))

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: the hot path records several metrics per request."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def done(self, model: str, version: str, protocol: str, code: int, seconds: float, reason: str = "") -> None:
        """A request answered. A refusal after the key gate (:data:`REFUSED_AFTER_GATE`: a full queue, stopping,
        unavailable, a passed deadline) is also counted by the tenant of the request's key (:data:`CALLER`)."""
        self._count(model, version, protocol, code, seconds, reason)
        if code in REFUSED_AFTER_GATE:
            caller = CALLER.get()
            if caller is not None:
                self.child(self.refusals, caller.name, str(code), reason or str(code)).inc()

    def _count(self, model: str, version: str, protocol: str, code: int, seconds: float, reason: str) -> None:
        self.child(self.requests, model, version, protocol, str(code)).inc()
        self.child(self.request_seconds, model, protocol).observe(seconds)
        if code >= 400:
            self.child(self.failures, model, version, reason or str(code)).inc()

    def refused(self, tenant: str, model: str, protocol: str, code: int, reason: str) -> None:
        """A request the API key gate refused: counted by tenant and status, and as a failed request."""
        self.child(self.refusals, tenant, str(code), reason).inc()
        self._count(model, "", protocol, code, 0.0, reason)

    def register(self, collector: Collector) -> None:
        """A scrape-time collector (e.g. model readiness): rendered on ``/metrics``."""
        self.exposition.register(collector)

    def render(self) -> bytes:
        flush_pauses()
        return generate_latest(self.exposition)

    def _samples(self, metric: Counter | Histogram) -> Iterator[Any]:
        """The samples of ``metric``: this process's, or the totals of every worker."""
        if self.multiprocess is None:
            for family in metric.collect():
                yield from family.samples
            return
        prefix = metric._name  # the family name without _total
        for family in self.exposition.collect():
            if family.name == prefix:
                yield from family.samples

    def model_stats(self, model: str, version: int, names: Collection[str]) -> dict[str, Any]:
        """Triton-style statistics of one served version, cumulative since start, from these counters.

        ``names``: the request-level names of the model (``M`` and ``M-raw``). ``inference_count`` counts rows,
        ``execution_count`` batches; ``queue`` is per row, ``compute_infer`` per batch. Success and failure come
        as counts only (request latency is not kept per version).
        """
        v = str(version)

        def total(metric: Counter | Histogram, sample: str, **match: str) -> float:
            return sum(
                s.value
                for s in self._samples(metric)
                if s.name == sample
                and s.labels.get("model") in names
                and s.labels.get("version") == v
                and all(s.labels.get(k) == want for k, want in match.items())
            )

        def timing(metric: Histogram, prefix: str) -> dict[str, int]:
            return {"count": int(total(metric, prefix + "_count")), "ns": int(total(metric, prefix + "_sum") * 1e9)}

        return {
            "name": model,
            "version": v,
            "inference_count": int(total(self.batch_size, "miaohui_batch_size_sum")),
            "execution_count": int(total(self.batch_size, "miaohui_batch_size_count")),
            "inference_stats": {
                "success": {"count": int(total(self.requests, "miaohui_requests_total", code="200"))},
                "fail": {"count": int(total(self.failures, "miaohui_request_failures_total"))},
                "queue": timing(self.queue_seconds, "miaohui_queue_duration_seconds"),
                "compute_infer": timing(self.compute_seconds, "miaohui_compute_duration_seconds"),
            },
        }


class _BatchMetrics(BatcherObserver):
    """One model version's batcher metrics; the labelled children are looked up once."""

    def __init__(self, m: Metrics, model: str, version: str) -> None:
        self.m, self.labels = m, (model, version)
        self.depth = m.queue_depth.labels(model, version)
        self.sizes = m.batch_size.labels(model, version)
        self.tokens = m.batch_tokens.labels(model, version)
        self.waits = m.queue_seconds.labels(model, version)
        self.compute = m.compute_seconds.labels(model, version)

    def on_enqueue(self, queue_depth: int) -> None:
        self.depth.set(queue_depth)

    def on_dequeue(self, queue_depth: int) -> None:
        self.depth.set(queue_depth)

    def on_reject(self, reason: RejectReason) -> None:
        self.m.child(self.m.rejected, *self.labels, reason).inc()

    def on_batch(self, size: int, tokens: int, padded_tokens: int, queue_wait_s: list[float]) -> None:
        self.sizes.observe(size)
        self.tokens.observe(padded_tokens)
        for wait in queue_wait_s:
            self.waits.observe(wait)

    def on_compute(self, seconds: float, size: int, ok: bool) -> None:
        self.compute.observe(seconds)

    def on_stage(self, stage: str, seconds: float) -> None:
        self.m.child(self.m.serving_stage_seconds, *self.labels, stage).observe(seconds)
