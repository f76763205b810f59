"""CUDA-graph capture without ``torch.cuda.graph``'s per-capture flush.

``torch.cuda.graph`` synchronizes the device, empties the caching allocator (``empty_cache``) and the pinned host
cache before every capture. An engine that captures dozens of buckets in a row then gives every bucket's memory
back to the driver and allocates it again in the next bucket's warm-up run: a fixed cost per graph whatever its
size (about 90 ms per prefill graph of a 1.5B decoder on an H100, ``lab/notes/2026-12-06-gpu-start-diagnosis.md``).
vLLM patches the same flush out of its capture loop. :func:`capturing` begins and ends the capture on a side stream
ordered after the current one, and nothing else. The decoder's slot engine uses it (measured on an H100: 88 graphs in
4.2 s); the encoder engine keeps ``torch.cuda.graph``, whose synchronize its first-use captures on a busy stream rely
on (``tests/gpu/test_inductor_gpu.py``), until that path is measured with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}


@contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph,
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
) -> Iterator[torch.cuda.Stream]:
    """``with capturing(graph, pool): ...`` records the block's kernels into ``graph`` as ``torch.cuda.graph`` does
    (same pool and error-mode arguments), on ``stream`` or a side stream kept per device; yields the stream."""
    device = torch.device("cuda", torch.cuda.current_device())
    if stream is None:
        stream = _streams.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode=capture_error_mode)
        try:
            yield stream
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)


def compiles_so_far() -> int:
    """Graphs Dynamo has compiled in this process (a warm-up run that compiled runs once more before its capture)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
