"""Where the time goes inside the server: ``/metrics`` scraped when the measured window opens and after
the last answer; the difference of each histogram's ``_sum``/``_count`` gives means over the window."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx

Labels = tuple[tuple[str, str], ...]


@dataclass
class Snapshot:
    """Samples of one scrape: sample name (with ``_total``/``_sum``/``_count``/``_bucket``) → labels → value."""

    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)
    at: float = 0.0
    """``time.time()`` when the scrape was answered (0 when unknown)."""

    def select(self, name: str, **match: str) -> dict[Labels, float]:
        rows = self.samples.get(name, {})
        return {k: v for k, v in rows.items() if all(dict(k).get(a) == b for a, b in match.items())}

    def total(self, name: str, **match: str) -> float:
        return sum(self.select(name, **match).values())


def parse_metrics(text: str) -> Snapshot:
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, dict[Labels, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name][tuple(sorted(s.labels.items()))] = float(s.value)
    return Snapshot(dict(samples))


def fetch_metrics(url: str, timeout_s: float = 5.0) -> Snapshot | None:
    """Scrape ``{url}/metrics``; ``None`` (not an error) when the server does not answer it."""
    try:
        resp = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    snap = parse_metrics(resp.text)
    snap.at = time.time()
    return snap


def gc_pauses(before: Snapshot | None, after: Snapshot) -> dict[str, dict[str, float]]:
    """The server's garbage-collector pauses between two scrapes (``miaohui_gc_pause_seconds``), per generation:
    collections, total ms, and the upper bound of the slowest one's bucket in ms (``inf`` past the last bucket)."""
    start = before or Snapshot()
    out: dict[str, dict[str, float]] = {}
    for labels in after.select("miaohui_gc_pause_seconds_count"):
        generation = dict(labels)["generation"]
        count = _delta(start, after, "miaohui_gc_pause_seconds_count", generation=generation)
        total = _delta(start, after, "miaohui_gc_pause_seconds_sum", generation=generation)
        # cumulative bucket counts over the window: the first bound that holds every collection is the slowest's
        in_window = _window_buckets(start, after, "miaohui_gc_pause_seconds", generation=generation)
        slowest = next((le for le in sorted(in_window) if in_window[le] >= count), math.inf) if count else 0.0
        out[generation] = {"collections": count, "total_ms": total * 1e3, "slowest_le_ms": slowest * 1e3}
    return dict(sorted(out.items()))


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' ``histogram_quantile`` on cumulative bucket counts ``{le: count}`` (linear in a bucket)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return prev_bound
            if count == prev_count:
                return le
            return prev_bound + (le - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = le, count
    return bounds[-1]


def _delta(before: Snapshot, after: Snapshot, name: str, **match: str) -> float:
    return after.total(name, **match) - before.total(name, **match)


def _window_buckets(before: Snapshot, after: Snapshot, name: str, **match: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts ``{le: count}`` between two scrapes (label sets matching ``match``
    summed)."""
    buckets: dict[float, float] = defaultdict(float)
    for snap, sign in ((after, 1.0), (before, -1.0)):
        for labels, value in snap.select(f"{name}_bucket", **match).items():
            buckets[float(dict(labels)["le"])] += sign * value
    return buckets


def window_histogram(
    before: Snapshot, after: Snapshot, name: str, scale: float, **match: str
) -> dict[str, float] | None:
    """A histogram's observations between two scrapes: count, mean, p50 and p99 (times ``scale``); None if none."""
    count = _delta(before, after, f"{name}_count", **match)
    if count <= 0:
        return None
    total = _delta(before, after, f"{name}_sum", **match)
    buckets = _window_buckets(before, after, name, **match)
    return {
        "count": count,
        "mean": total / count * scale,
        "p50": histogram_quantile(0.5, buckets) * scale,
        "p99": histogram_quantile(0.99, buckets) * scale,
    }


def share_above(before: Snapshot, after: Snapshot, name: str, bound: float, **match: str) -> float:
    """The fraction of a histogram's observations between two scrapes that exceeded ``bound`` (one of its bucket
    bounds, in the histogram's unit): exact, unlike a quantile interpolated inside a bucket."""
    count = _delta(before, after, f"{name}_count", **match)
    if count <= 0:
        return math.nan
    buckets = _window_buckets(before, after, name, **match)
    if bound not in buckets:
        raise ValueError(f"{name} has no bucket bound {bound}; its bounds are {sorted(buckets)}")
    return 1.0 - buckets[bound] / count


def _by_label(before: Snapshot, after: Snapshot, name: str, label: str, **match: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, value in after.select(name, **match).items():
        out[dict(labels).get(label, "")] += value - before.samples.get(name, {}).get(labels, 0.0)
    return {k: v for k, v in sorted(out.items()) if v}


def breakdown(before: Snapshot, after: Snapshot, model: str, wall_s: float) -> dict[str, Any]:
    """Server-side figures between two scrapes for ``model``: latency split (ms), batching, rejections, CPU.

    Means and percentiles do not depend on exactly when the scrapes landed; counts do (a scrape answered
    late by a loaded server starts the server's window late), so rates use the time between the scrapes."""
    if before.at and after.at > before.at:
        wall_s = after.at - before.at
    request = window_histogram(before, after, "miaohui_request_duration_seconds", 1e3, model=model)
    queue = window_histogram(before, after, "miaohui_queue_duration_seconds", 1e3, model=model)
    compute = window_histogram(before, after, "miaohui_compute_duration_seconds", 1e3, model=model)
    batch = window_histogram(before, after, "miaohui_batch_size", 1.0, model=model)
    tokens = window_histogram(before, after, "miaohui_batch_tokens", 1.0, model=model)
    out: dict[str, Any] = {
        "scrape_interval_s": wall_s,
        "requests_by_code": _by_label(before, after, "miaohui_requests_total", "code", model=model),
        "rejected_by_reason": _by_label(before, after, "miaohui_rejected_total", "reason", model=model),
        "request_ms": request,
        "queue_ms": queue,
        "compute_ms_per_batch": compute,
        "batch_size": batch,
        "batch_padded_tokens": tokens,
    }
    if batch and compute:
        out["compute_ms_per_row"] = compute["mean"] * compute["count"] / (batch["mean"] * batch["count"])
    if request and queue and compute:
        # what is neither waiting for a batch nor running it: parsing, tokenizing, routing, serializing
        out["other_ms"] = request["mean"] - queue["mean"] - compute["mean"]
    # around the batcher: tokenize and slots per request; the engine's h2d / gpu / d2h per batch (GPU engines)
    stages = {
        stage: hist
        for stage in ("tokenize", "slots", "h2d", "gpu", "d2h")
        if (hist := window_histogram(before, after, "miaohui_stage_duration_seconds", 1e3, model=model, stage=stage))
    }
    if stages:
        out["stage_ms"] = stages
    cpu = _delta(before, after, "miaohui_process_cpu_seconds_total")
    if wall_s > 0 and cpu > 0:
        out["server_cpu_cores"] = cpu / wall_s
    gpu = after.select("miaohui_gpu_utilization_ratio")
    if gpu:
        out["gpu_utilization"] = {dict(k).get("gpu", ""): v for k, v in gpu.items()}
    if pauses := gc_pauses(before, after):  # every server process's collections in the window, per generation
        out["gc_pauses"] = pauses
    return out
