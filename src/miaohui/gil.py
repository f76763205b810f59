"""How long a Python thread may hold the GIL while another waits for it (``sys.setswitchinterval``).

A generation server process has an event loop thread (HTTP, SSE) and an engine thread that waits for the GPU with
the GIL released. When the GPU step ends the engine thread needs the GIL back; if the event loop holds it, Python's
default makes the engine wait up to 5 ms before the loop is asked to let go — a stall between decode steps. A short
interval (:data:`GENERATION_SWITCH_US`) gives the engine thread the GIL back sooner: on the H200 the 1.5B-shaped
generation server under 64 streams measured more tokens/s and a lower TTFT p99 with it. The encoder (intent) server
measured no gain, so only a process that runs a generation loop shortens it by default (applied when the loop
starts).

``miaohui serve --gil-switch-us N`` puts N into the ``ServeSpec`` every server process receives; each calls
:func:`configure` with it first, and the configured interval then wins in that process, generation or not.

:func:`short_switch_interval` lowers the interval for as long as a background thread does long Python work next to
serving threads (a ``fast_start`` engine's compile): with Python's 5 ms, the serving threads wait on the compile for
the GIL, and the intent server's throughput and tail latency collapse while it runs.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

GENERATION_SWITCH_US = 50.0
BACKGROUND_WORK_SWITCH_US = 100.0

_lock = threading.Lock()
_holders = 0
_saved_s = 0.0
_configured_us: float | None = None


def configure(us: float | None) -> None:
    """This process's interval from its ``ServeSpec`` (``--gil-switch-us``); None: the defaults of
    :func:`switch_interval_us`. Applied by :func:`apply_switch_interval`."""
    global _configured_us
    _configured_us = None if us is None else float(us)


def switch_interval_us(default_us: float | None = None) -> float | None:
    r"""The interval to use: the :func:`configure`\ d one when set (clamped to 10 µs … 100 ms), else ``default_us``
    (None: leave Python's)."""
    us = _configured_us if _configured_us is not None else default_us
    return None if us is None else min(max(us, 10.0), 100_000.0)


def apply_switch_interval(default_us: float | None = None) -> float:
    """Set this process's switch interval (see :func:`switch_interval_us`); returns the one in force, in µs."""
    us = switch_interval_us(default_us)
    if us is not None:
        sys.setswitchinterval(us / 1e6)
    return sys.getswitchinterval() * 1e6


@contextlib.contextmanager
def short_switch_interval(us: float = BACKGROUND_WORK_SWITCH_US) -> Iterator[None]:
    """Hold the process's switch interval at most ``us`` while the block runs, then put back the one found.
    Concurrent or nested blocks share the saved value (restored when the last one ends); a shorter interval already
    in force is kept."""
    global _holders, _saved_s
    with _lock:
        if _holders == 0:
            _saved_s = sys.getswitchinterval()
        _holders += 1
        sys.setswitchinterval(min(sys.getswitchinterval(), us / 1e6))
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                sys.setswitchinterval(_saved_s)
