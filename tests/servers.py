"""A real uvicorn server on a free localhost port, in a daemon thread — shared by the e2e/integration tests — and
the free ports the spawned servers take (:func:`free_port`)."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from typing import Any

import uvicorn

PORTS_ENV = "MIAOHUI_TEST_PORTS"
"""``LOW-HIGH``: the ports the tests may take (where several people share a machine); unset: any the OS picks."""


def bound_socket() -> socket.socket:
    """A socket bound to a free 127.0.0.1 port (within :data:`PORTS_ENV` when set)."""
    span = os.environ.get(PORTS_ENV)
    if not span:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        return sock
    low, high = (int(p) for p in span.split("-"))
    ports = list(range(low, high + 1))
    random.shuffle(ports)
    for port in ports:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        return sock
    raise RuntimeError(f"no free port in {PORTS_ENV}={span}")


def free_port() -> int:
    """A port free now (a spawned server binds it next)."""
    with bound_socket() as sock:
        return int(sock.getsockname()[1])


class UvicornThread:
    """Serve ``app`` (its lifespan runs: models load and warm up) on 127.0.0.1:<free port>.

    The socket is bound here, so there is no race for the port. Usable as a context manager.
    """

    def __init__(self, app: Any, metrics: Any = None, startup_timeout_s: float = 180.0) -> None:
        self.app = app
        self.metrics = metrics
        self.sock = bound_socket()
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> UvicornThread:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def sample(self, name: str, **labels: str) -> float:
        """A metric sample from the server's registry (0 when absent)."""
        metrics = self.metrics or self.app.state.miaohui.metrics
        return metrics.registry.get_sample_value(name, labels) or 0.0

    def __enter__(self) -> UvicornThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
