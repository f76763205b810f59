"""The GIL switch interval of server processes: ``$MIAOHUI_GIL_SWITCH_US`` (set by ``miaohui serve --gil-switch-us``)
wins; else a generation loop uses 50 µs and other processes keep Python's; bad or extreme values fall back or are
clamped instead of failing the start."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from miaohui.gil import GENERATION_SWITCH_US, SWITCH_ENV, apply_switch_interval


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize(
    ("env", "default", "want_us"),
    [
        (None, None, 5000.0),  # nothing set: Python's own
        (None, GENERATION_SWITCH_US, 50.0),  # a generation loop's default
        ("500", None, 500.0),
        ("5000", GENERATION_SWITCH_US, 5000.0),  # the flag wins over the generation default
        ("abc", GENERATION_SWITCH_US, 50.0),
        ("1", None, 10.0),  # clamped
    ],
)
def test_switch_interval(
    monkeypatch: pytest.MonkeyPatch, env: str | None, default: float | None, want_us: float
) -> None:
    if env is None:
        monkeypatch.delenv(SWITCH_ENV, raising=False)
    else:
        monkeypatch.setenv(SWITCH_ENV, env)
    assert apply_switch_interval(default) == pytest.approx(want_us)
    assert sys.getswitchinterval() == pytest.approx(want_us / 1e6)
