"""miaohui.gcpolicy: collections counted through the hook and flushed into histograms; the start-up freeze."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram

from miaohui import gcpolicy


@pytest.fixture(autouse=True)
def _not_frozen(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts with the process never frozen, and leaves it so (the repository's refreeze after a model
    load would otherwise freeze the test process for the tests that follow)."""
    monkeypatch.setattr(gcpolicy, "_frozen", [])
    yield
    gc.unfreeze()


@pytest.fixture
def histogram() -> Iterator[Histogram]:
    gcpolicy.flush_pauses()  # drop what earlier tests' collections left
    yield Histogram(
        "gc_pause_seconds", "test", ["generation"], buckets=gcpolicy.PAUSE_BUCKETS, registry=CollectorRegistry()
    )


def _count(h: Histogram, generation: str) -> float:
    return next(
        s.value
        for s in h.collect()[0].samples
        if s.name == "gc_pause_seconds_count" and s.labels["generation"] == generation
    )


def test_a_collection_is_counted_after_the_flush_not_inside_the_hook(histogram: Histogram) -> None:
    gcpolicy.record_pauses(histogram)
    assert gcpolicy._on_gc in gc.callbacks
    gc.collect()
    assert not any(s.name.endswith("_count") for s in histogram.collect()[0].samples)  # the hook only queued it
    assert gcpolicy.flush_pauses() >= 1
    assert _count(histogram, "2") >= 1
    sums = [s.value for s in histogram.collect()[0].samples if s.name == "gc_pause_seconds_sum"]
    assert sum(sums) > 0
    gcpolicy.record_pauses(histogram)  # registering again installs no second hook
    assert gc.callbacks.count(gcpolicy._on_gc) == 1


def test_young_collections_are_labelled_with_their_generation(histogram: Histogram) -> None:
    gcpolicy.record_pauses(histogram)
    gc.collect(0)
    gc.collect(1)
    gcpolicy.flush_pauses()
    assert _count(histogram, "0") >= 1 and _count(histogram, "1") >= 1


def test_histograms_are_held_weakly(histogram: Histogram) -> None:
    gcpolicy.record_pauses(histogram)
    other = Histogram("other", "test", ["generation"], registry=CollectorRegistry())
    gcpolicy.record_pauses(other)
    assert other in gcpolicy._sinks
    del other
    gc.collect()
    assert len([h for h in gcpolicy._sinks if h._name == "other"]) == 0


def test_the_pending_list_is_bounded_when_nobody_flushes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcpolicy, "_MAX_PENDING", 2)
    gcpolicy.flush_pauses()
    for _ in range(5):
        gc.collect(0)
    assert len(gcpolicy._pending) == 2
    gcpolicy.flush_pauses()


def test_freeze_moves_the_live_heap_to_the_permanent_generation() -> None:
    before = gc.get_freeze_count()
    gcpolicy.set_freeze(False)
    try:
        assert gcpolicy.freeze_heap("test") is None and gc.get_freeze_count() == before
    finally:
        gcpolicy.set_freeze(True)
    try:
        report = gcpolicy.freeze_heap("test")
        assert report is not None and report.frozen_objects > 1000
        # (frozen objects freed meanwhile, e.g. by another thread, leave the permanent generation: not exact)
        assert 0.9 * report.frozen_objects <= gc.get_freeze_count() <= report.frozen_objects
        assert report.collect_seconds > 0
        assert len(gc.get_objects(generation=2)) < report.frozen_objects  # a full collection no longer walks them
    finally:
        gc.unfreeze()  # this test process keeps collecting normally


def test_the_benchmarks_window_summary_from_two_scrapes() -> None:
    """``miaohui.bench.scrape.gc_pauses``: collections and ms per generation between two scrapes of a real
    ``Metrics`` exposition, and the bucket the slowest one fell in."""
    from miaohui.bench.scrape import gc_pauses, parse_metrics
    from miaohui.server.metrics import Metrics

    metrics = Metrics()
    gc.disable()  # no real collection inside the window: the figures below are exactly the ones observed
    try:
        gcpolicy.flush_pauses()
        before = parse_metrics(metrics.render().decode())
        metrics.gc_pause.labels(generation="2").observe(0.3)  # one slow full collection, as an unfrozen server has
        metrics.gc_pause.labels(generation="2").observe(0.0004)
        metrics.gc_pause.labels(generation="0").observe(0.00005)
        after = parse_metrics(metrics.render().decode())
    finally:
        gc.enable()
    window = gc_pauses(before, after)
    assert window["2"]["collections"] == 2 and window["2"]["total_ms"] == pytest.approx(300.4)
    assert window["2"]["slowest_le_ms"] == 500.0  # 0.3 s is in the (0.25, 0.5] bucket
    assert window["0"] == {"collections": 1, "total_ms": pytest.approx(0.05), "slowest_le_ms": 0.1}


def test_refreeze_frees_cycles_that_died_while_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a frozen heap costs: a cycle frozen at start-up and dropped later (an unloaded version's) is never
    collected; :func:`refreeze`, which the repository calls after every load/unload, frees it."""
    import weakref

    class Node:
        other: object = None

    assert gcpolicy.freeze_enabled()
    assert gcpolicy.refreeze("test") is None  # never frozen: nothing to do
    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    try:
        gcpolicy.freeze_heap("test")
        del a, b
        gc.collect()
        assert alive() is not None  # frozen: a full collection does not walk it
        report = gcpolicy.refreeze("test")
        assert report is not None and alive() is None
    finally:
        gc.unfreeze()
