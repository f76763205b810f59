"""The GIL switch interval of server processes: the one their ``ServeSpec`` configures (``miaohui serve
--gil-switch-us``) wins; else a generation loop uses 50 µs and other processes keep Python's; extreme values are
clamped instead of failing the start."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from miaohui.gil import GENERATION_SWITCH_US, apply_switch_interval, configure, short_switch_interval


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    configure(None)
    sys.setswitchinterval(before)


@pytest.mark.parametrize(
    ("configured", "default", "want_us"),
    [
        (None, None, 5000.0),  # nothing set: Python's own
        (None, GENERATION_SWITCH_US, 50.0),  # a generation loop's default
        (500.0, None, 500.0),
        (5000.0, GENERATION_SWITCH_US, 5000.0),  # the flag wins over the generation default
        (1.0, None, 10.0),  # clamped
        (1e9, None, 100_000.0),
    ],
)
def test_switch_interval(configured: float | None, default: float | None, want_us: float) -> None:
    configure(configured)
    assert apply_switch_interval(default) == pytest.approx(want_us)
    assert sys.getswitchinterval() == pytest.approx(want_us / 1e6)


def test_short_switch_interval_lowers_it_while_held_and_restores_it_after_the_last_holder() -> None:
    """A background compile (``fast_start``) holds it short; two overlapping holders (two models' upgrades, from two
    threads) restore the process's 5 ms only when the second ends."""
    first_in, second_done = threading.Event(), threading.Event()
    seen: list[float] = []

    def other() -> None:
        first_in.wait()
        with short_switch_interval(200):
            seen.append(sys.getswitchinterval())
        second_done.set()

    t = threading.Thread(target=other)
    t.start()
    with short_switch_interval(100):
        assert sys.getswitchinterval() == pytest.approx(100e-6, rel=0.05)
        first_in.set()
        second_done.wait(5)
        assert sys.getswitchinterval() == pytest.approx(
            100e-6, rel=0.05
        )  # the other holder ended; this one still holds
    t.join()
    assert seen == [
        pytest.approx(100e-6, rel=0.05)
    ]  # capped at the saved 5 ms, not raised to 200 µs over the first's 100
    assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)


def test_short_switch_interval_keeps_a_shorter_one_and_restores_on_error() -> None:
    sys.setswitchinterval(50e-6)
    with pytest.raises(RuntimeError), short_switch_interval(100):
        assert sys.getswitchinterval() == pytest.approx(50e-6, rel=0.05)
        raise RuntimeError("compile failed")
    assert sys.getswitchinterval() == pytest.approx(50e-6, rel=0.05)
