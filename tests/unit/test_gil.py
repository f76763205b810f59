"""The server processes' GIL switch interval: from the environment (set by ``miaohui serve --gil-switch-us``),
else 200 µs; bad or extreme values fall back or are clamped instead of failing the start."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from miaohui.server.gil import DEFAULT_SWITCH_US, SWITCH_ENV, apply_switch_interval


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize(
    ("env", "want_us"),
    [(None, DEFAULT_SWITCH_US), ("500", 500.0), ("5000", 5000.0), ("abc", DEFAULT_SWITCH_US), ("1", 10.0)],
)
def test_switch_interval_from_env(monkeypatch: pytest.MonkeyPatch, env: str | None, want_us: float) -> None:
    if env is None:
        monkeypatch.delenv(SWITCH_ENV, raising=False)
    else:
        monkeypatch.setenv(SWITCH_ENV, env)
    assert apply_switch_interval() == want_us
    assert sys.getswitchinterval() == pytest.approx(want_us / 1e6)
