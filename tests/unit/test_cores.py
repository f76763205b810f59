"""How many cores a process sizes its engine thread pools for: ``serve --workers N`` shares them out through each
worker's ``ServeSpec`` (``--cores`` overrides the share)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from miaohui.engines.target import set_core_share, usable_cores
from miaohui.errors import ConfigError
from miaohui.gil import configure
from miaohui.server.state import ServeSpec


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    yield
    set_core_share(None)
    configure(None)


def test_usable_cores_is_the_affinity_unless_a_share_is_set() -> None:
    assert usable_cores() == len(os.sched_getaffinity(0))
    set_core_share(3)
    assert usable_cores() == 3
    with pytest.raises(ValueError, match="at least 1"):
        set_core_share(0)
    set_core_share(None)
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_a_spec_shares_the_cores_among_workers_unless_cores_is_given(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    ServeSpec(tmp_path, workers=4).apply_process_settings(share=4)
    assert usable_cores() == max(1, affinity // 4)
    ServeSpec(tmp_path).apply_process_settings()
    assert usable_cores() == affinity
    ServeSpec(tmp_path, workers=4, cores=3).apply_process_settings(share=4)
    assert usable_cores() == 3
    with pytest.raises(ConfigError, match="--cores 0"):
        ServeSpec(tmp_path, cores=0)
