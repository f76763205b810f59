"""How long a Python thread may hold the GIL while another waits for it (``sys.setswitchinterval``).

A server process has an event loop thread (HTTP, SSE, IPC) and engine threads that wait for the GPU with the GIL
released. When the GPU finishes, the engine thread needs the GIL back; if the event loop holds it, Python's default
makes the engine wait up to 5 ms before the loop is asked to let go — a stall between GPU steps of up to 5 ms. On
the H200 (session 6) the 1.5B decoder server with staggered streams went from 6,878 to 7,760 tokens/s and TTFT p99
from 43 to 26 ms at 200 µs (``benchmarks/results/generation_gpu_qwen1.5b_server_stagger10*.json``).

Every server process (single, workers, engine process) applies the value in ``MIAOHUI_GIL_SWITCH_US`` (set by
``miaohui serve --gil-switch-us``; spawned children inherit it), else :data:`DEFAULT_SWITCH_US`.
"""

from __future__ import annotations

import os
import sys

SWITCH_ENV = "MIAOHUI_GIL_SWITCH_US"
DEFAULT_SWITCH_US = 200.0


def apply_switch_interval() -> float:
    """Set this process's GIL switch interval from the environment (or the default); returns it in µs."""
    raw = os.environ.get(SWITCH_ENV)
    try:
        us = float(raw) if raw else DEFAULT_SWITCH_US
    except ValueError:
        us = DEFAULT_SWITCH_US
    us = min(max(us, 10.0), 100_000.0)
    sys.setswitchinterval(us / 1e6)
    return us
