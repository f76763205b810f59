"""Python's garbage collector in a serving process: its pauses counted, the warmed-up heap frozen.

A full (generation-2) collection walks every container object the process holds, and while it runs no other Python
thread moves: not the event loop streaming tokens, not the engine thread launching the next step. A server that
has imported torch and loaded engines holds hundreds of thousands of them (a warm ``miaohui serve`` with a tiny
engine: ~435–440k, one full collection 210–340 ms on the 2-core CI machine; its log line says how many it froze).
The objects made while loading and warming up live as long as the process, so once it is ready a server
process collects once and moves them to the permanent generation (:func:`freeze_heap`, ``gc.freeze()``, as vLLM
and SGLang do after start-up): later collections walk only what serving made since. Frozen objects are never
collected, so a version unloaded later would leak whatever of it sits in reference cycles: after a model is
loaded, reloaded or unloaded the repository calls :func:`refreeze` (unfreeze, one full collection — a pause of the
same size, once per change — and freeze again). ``miaohui serve --no-gc-freeze`` turns all of it off
(:func:`set_freeze`, from the process's ``ServeSpec``).

Every collection's pause is counted in ``miaohui_gc_pause_seconds{generation}``. The ``gc.callbacks`` hook only
appends to a list (:data:`_pending`): it runs wherever a collection starts, possibly inside code that holds a
metrics lock, so it must not take one; :func:`flush_pauses` moves the pauses into the histograms from ordinary
code (the scrape, a periodic task).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import weakref
from typing import Any

from miaohui.config import Frozen

log = logging.getLogger(__name__)

PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)

_pending: list[tuple[int, float]] = []
"""(generation, seconds) of collections not yet in the histograms; appended by :func:`_on_gc` only."""
_sinks: weakref.WeakSet[Any] = weakref.WeakSet()
_MAX_PENDING = 100_000
_frozen: list[bool] = []  # [True] once freeze_heap froze this process
_started: list[float] = []  # the running collection's start (collections never nest: CPython sets `collecting`)


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        seconds = time.perf_counter() - _started.pop()
        if len(_pending) < _MAX_PENDING:  # nobody flushing: stop counting rather than grow
            _pending.append((info.get("generation", 0), seconds))


def record_pauses(histogram: Any) -> None:
    """Count this process's collections in ``histogram`` (a prometheus_client Histogram labelled ``generation``;
    held weakly, so a server's metrics can go away); installs the ``gc.callbacks`` hook once."""
    _sinks.add(histogram)
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def flush_pauses() -> int:
    """Move the collections counted since the last flush into every registered histogram; how many."""
    batch = _pending[:]  # a collection may append while this runs: remove only what was copied
    del _pending[: len(batch)]
    for histogram in list(_sinks):
        for generation, seconds in batch:
            histogram.labels(generation=str(generation)).observe(seconds)
    return len(batch)


async def flush_pauses_every(seconds: float = 1.0) -> None:
    """:func:`flush_pauses` every ``seconds`` until cancelled (each server process runs one, so that with several
    workers every process's pauses reach the shared metrics files, not only the one that answers the scrape)."""
    while True:
        await asyncio.sleep(seconds)
        flush_pauses()


class FreezeReport(Frozen):
    frozen_objects: int
    """Objects in the permanent generation after the freeze."""
    collect_seconds: float
    """The full collection before it."""


_freeze = [True]


def set_freeze(enabled: bool) -> None:
    """Whether :func:`freeze_heap` freezes in this process (``ServeSpec.gc_freeze``)."""
    _freeze[0] = bool(enabled)


def freeze_enabled() -> bool:
    return _freeze[0]


def freeze_heap(who: str = "server") -> FreezeReport | None:
    """Collect once and freeze what survives (``gc.freeze()``); None when :func:`set_freeze` turned it off.
    Call when a process is warm (models loaded, graphs captured) and before it takes traffic."""
    if not freeze_enabled():
        log.info("%s: gc.freeze() off (--no-gc-freeze)", who)
        return None
    started = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - started
    gc.freeze()
    _frozen[:] = [True]
    report = FreezeReport(frozen_objects=gc.get_freeze_count(), collect_seconds=seconds)
    log.info(
        "%s: froze %d objects after start-up (gc.freeze(); the full collection before it took %.0f ms)",
        who,
        report.frozen_objects,
        seconds * 1e3,
    )
    return report


def refreeze(who: str) -> FreezeReport | None:
    """After the process's models changed (load, reload, unload): if :func:`freeze_heap` froze it, unfreeze, let one
    full collection free what the change left (an unloaded version's cycles), and freeze again; else nothing."""
    if not _frozen:
        return None
    gc.unfreeze()
    return freeze_heap(who)
