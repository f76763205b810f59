"""How many cores a process sizes its engine thread pools for (``serve --workers N`` shares them out)."""

from __future__ import annotations

import os

import pytest

from miaohui.engines.target import CORES_ENV, usable_cores


def test_usable_cores_is_the_affinity_unless_a_share_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CORES_ENV, raising=False)
    assert usable_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setenv(CORES_ENV, "3")
    assert usable_cores() == 3
    for bad in ("0", "-2", "two", ""):
        monkeypatch.setenv(CORES_ENV, bad)
        assert usable_cores() == len(os.sched_getaffinity(0))
