"""Start one server at a time as a child process group, wait until it answers, stop it (project venv)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path


class ServerFailed(RuntimeError):
    """The server exited or did not become ready; its log's tail is in the message."""


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def ready(url: str, timeout: float = 2.0) -> bool:
    """True once ``url`` answers 200 (a GET)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextlib.contextmanager
def running(
    cmd: Sequence[str], ready_url: str, log: Path, *, env: dict[str, str] | None = None, timeout: float = 600
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` (its own process group, output to ``log``) until the block ends; ready when ``ready_url``
    answers 200. Raises :class:`ServerFailed` with the log's tail if it exits first or times out."""
    log.parent.mkdir(parents=True, exist_ok=True)
    port = urllib.parse.urlsplit(ready_url).port
    if port is not None:
        wait_port_free(port)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout
        while not ready(ready_url):
            if proc.poll() is not None:
                raise ServerFailed(f"{cmd[0]} … exited with {proc.returncode}; log {log}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"{ready_url} not ready after {timeout:.0f} s; log {log}:\n{_tail(log)}")
            time.sleep(0.5)
        yield proc
    finally:
        stop(proc)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a member we may not signal
        return True
    return True


def stop(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL what is left of it after ``grace`` seconds; returns when every process of
    the group is gone (a server's children, e.g. PyTriton's tritonserver, can hold the port after their parent)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
        time.sleep(0.1)
    if proc.poll() is None or _group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    while _group_alive(proc.pid):  # SIGKILLed members are reaped by init; wait until they are
        time.sleep(0.05)


def wait_port_free(port: int, timeout: float = 30.0) -> None:
    """Return once ``127.0.0.1:port`` can be bound (the previous server's sockets are closed); ServerFailed after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise ServerFailed(f"port {port} is still in use after {timeout:.0f} s") from None
        time.sleep(0.2)
