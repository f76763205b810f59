"""The GPU kernels of a profiled run as a timeline, and where its time goes when kernels overlap.

With programmatic dependent launch (PDL) a kernel starts while the one before it still runs and waits on the GPU for
its writes, so each kernel's profiled duration includes that wait: the durations of a PDL chain sum to more than the
chain took (a reduce kernel of ~2 µs can read as 50 µs a call). :func:`summarize` attributes each stretch of
device time to one kernel instead: a kernel's *exclusive* time is the part of its interval after every kernel that
started before it has ended — for a chain, the time the GPU spent on it alone — and the busy time is the union of
the intervals. Exclusive times sum to the busy time; busy time plus the gaps is the span.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple


class Kernel(NamedTuple):
    """One kernel execution: its name and device start / end in µs."""

    name: str
    start: float
    end: float


def cuda_kernels(prof: Any) -> list[Kernel]:
    """The CUDA events of a ``torch.profiler.profile`` (kernels, memsets, memcpys), by start."""
    from torch.autograd import DeviceType

    events = (e for e in prof.events() if e.device_type == DeviceType.CUDA)
    return sorted(
        (Kernel(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events), key=lambda k: k.start
    )


def exclusive(kernels: Iterable[Kernel]) -> list[float]:
    """Each kernel's exclusive µs (see the module), in start order: ``end − max(start, latest end before it)``,
    never below zero (a kernel wholly inside an earlier one's interval gets none)."""
    out: list[float] = []
    reach = float("-inf")
    for k in sorted(kernels, key=lambda k: k.start):
        out.append(max(0.0, k.end - max(k.start, reach)))
        reach = max(reach, k.end)
    return out


def summarize(kernels: Sequence[Kernel], calls: int, top: int = 15) -> dict[str, Any]:
    """Per call: kernels, span (first start to last end), busy time (the intervals' union), the summed durations
    (what a profiler's table adds up), and the ``top`` kernel names by exclusive time, each with its count, summed
    duration and exclusive time."""
    ordered = sorted(kernels, key=lambda k: k.start)
    if not ordered:
        return {"kernels_per_call": 0.0, "span_us_per_call": 0.0, "busy_us_per_call": 0.0,
                "duration_us_per_call": 0.0, "top": []}  # fmt: skip
    excl = exclusive(ordered)
    by_name: dict[str, list[float]] = {}
    for k, x in zip(ordered, excl, strict=True):
        count_dur_excl = by_name.setdefault(k.name, [0.0, 0.0, 0.0])
        count_dur_excl[0] += 1
        count_dur_excl[1] += k.end - k.start
        count_dur_excl[2] += x
    names = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "kernels_per_call": len(ordered) / calls,
        "span_us_per_call": (max(k.end for k in ordered) - ordered[0].start) / calls,
        "busy_us_per_call": sum(excl) / calls,
        "duration_us_per_call": sum(k.end - k.start for k in ordered) / calls,
        "top": [
            {"kernel": name[:100], "per_call": c / calls, "us_per_call": d / calls, "exclusive_us_per_call": x / calls}
            for name, (c, d, x) in names
        ],
    }
