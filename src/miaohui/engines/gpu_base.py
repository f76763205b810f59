"""The hooks only GPU engines have, on top of :class:`~miaohui.engines.base.Engine`: a server checks
``isinstance(engine, GpuEngine)`` before it uses them, and every other backend needs to know nothing of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from miaohui.engines.base import Engine, Manifest


class GpuEngine(Engine):
    """An engine that specialises on shape buckets (CUDA graphs), times its stages with CUDA events, can launch a
    batch without blocking the event loop, and may compile in the background after it serves (``fast_start``)."""

    polls: bool = False
    """Whether :meth:`infer_polled` really launches without blocking (CUDA graphs); elsewhere it computes in place,
    blocking the event loop, so callers use it only where this is true."""

    def __init__(self, manifest: Manifest, path: Path) -> None:
        super().__init__(manifest, path)
        self.last_stages: dict[str, float] = {}
        """Seconds per stage of the last ``infer`` where it was timed (``h2d``, ``gpu``, ``d2h`` from CUDA events);
        empty otherwise."""
        self.start_phases: dict[str, float] = {}
        """Where this engine's start went, in seconds: ``load`` (files read, weights on the device), ``compile``
        (first calls: Dynamo's trace and Inductor / Triton cache hits, or Triton kernels loaded), ``capture`` (CUDA
        graphs captured, also those captured by the warm-up)."""

    def warmed_up(self) -> None:
        """Called once its server's warm-up has run (stage sampling restarts: the first served batch is timed)."""
        return None

    def compile_seconds(self) -> float | None:
        """Seconds a compile after warm-up took (``fast_start``); None while it runs; 0.0 where there is none."""
        return 0.0

    def warmup_buckets(self) -> list[tuple[int, int]]:
        """(batch, sequence) shapes this engine specialises on (CUDA-graph buckets), to be run before it serves:
        a bucket first met while serving would be captured then (a latency spike)."""
        return []

    async def infer_polled(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`infer` from an event loop: launch the batch, then yield to the loop until the device is done (the
        loop thread keeps serving other callbacks meanwhile; no worker thread, no GIL hand-back). Validates the
        same way."""
        self.check_feeds(feeds)
        return await self._infer_polled_impl(feeds)

    async def _infer_polled_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._infer_impl(feeds)
