"""How much of a GPU engine's start went into torch.compile: a clock on Dynamo's compile callbacks.

Dynamo runs its start callbacks when the outermost compile of a frame begins and its end callbacks when it ends
(trace, AOTAutograd and Inductor, cache loads included), so the time between them is the compile's share of a
warm-up; the rest of a warm-up that captures CUDA graphs is the capture's. Counters say whether Inductor's caches
(the version's ``compile-cache.bin``) were hit.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any


class CompileClock:
    """``with CompileClock() as clock: ...`` → ``clock.seconds`` spent compiling, ``clock.compiles`` compiles."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.compiles = 0
        self._began: float | None = None
        self._handler: Any = None

    def _start(self, _args: Any) -> None:
        self._began = time.perf_counter()

    def _end(self, _args: Any) -> None:
        if self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.compiles += 1
            self._began = None

    def __enter__(self) -> CompileClock:
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # a torch without the callbacks: the clock reads 0
            return self
        self._handler = callback_handler
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._handler is not None:
            self._handler.remove_start_callback(self._start)
            self._handler.remove_end_callback(self._end)


def cache_counters() -> str:
    """Inductor's FX-graph cache hits / misses and AOTAutograd's, as one log fragment ("" where torch has none)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return ""
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    parts = [
        f"fx-graph cache {inductor.get('fxgraph_cache_hit', 0)} hit / {inductor.get('fxgraph_cache_miss', 0)} miss",
        f"autograd cache {aot.get('autograd_cache_hit', 0)} hit / {aot.get('autograd_cache_miss', 0)} miss",
    ]
    return ", ".join(parts)
