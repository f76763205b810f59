"""A real ``redis-server`` on a free localhost port for tests (installed by ``scripts/install_redis.sh``; tests that
need it skip when the binary is absent)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["RedisServer", "redis_server"]


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    """redis-server without persistence on a free port, stopped at the end."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (bash scripts/install_redis.sh)")
    port = _free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*cmd, "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"redis-server did not answer on port {port}")
        yield RedisServer(proc, port)
    finally:
        proc.kill()
        proc.wait()
