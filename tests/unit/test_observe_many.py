"""``observe_many`` (one pass over a step's inter-token latencies) leaves a Prometheus histogram exactly as
``observe`` per value does: every bucket, the sum and the count, values on the bucket bounds included."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from miaohui.server.metrics import observe_many

BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.05, 0.1)


def _exposition(fill: str) -> bytes:
    registry = CollectorRegistry()
    hist = Histogram("itl_seconds", "itl", ["model"], buckets=BOUNDS, registry=registry)
    rng = random.Random(5)
    values = [*BOUNDS, 0.0, 3.0, *(rng.uniform(0, 0.2) for _ in range(500))]
    child = hist.labels("llm")
    if fill == "each":
        for v in values:
            child.observe(v)
    else:
        for start in range(0, len(values), 64):  # a step's worth at a time
            observe_many(child, values[start : start + 64])
    return b"\n".join(line for line in generate_latest(registry).splitlines() if b"_created" not in line)


def test_observe_many_equals_observe_per_value() -> None:
    text, want = _exposition("many"), _exposition("each")

    def split(t: bytes) -> tuple[list[bytes], float]:
        lines = t.splitlines()
        (total,) = [float(line.split()[-1]) for line in lines if line.startswith(b"itl_seconds_sum")]
        return [line for line in lines if not line.startswith(b"itl_seconds_sum")], total

    (lines, total), (want_lines, want_total) = split(text), split(want)
    assert lines == want_lines  # every bucket and the count exactly
    assert abs(total - want_total) < 1e-9  # the sum up to float summation order
    assert b'itl_seconds_bucket{le="0.001",model="llm"} ' in text and b'itl_seconds_count{model="llm"} 508.0' in text


def test_observe_many_falls_back_without_the_internals() -> None:
    seen: list[float] = []

    class Plain:
        def observe(self, v: float) -> None:
            seen.append(v)

    observe_many(Plain(), [0.5, 0.25])
    assert seen == [0.5, 0.25]
