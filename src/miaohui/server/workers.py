"""``miaohui serve --workers N``: N server processes behind one HTTP port and one gRPC port.

One Python process (one event loop, one GIL) caps the host path at roughly a thousand requests per second
whatever the engine does; N processes scale it over the cores. The layout is the one uvicorn's and gunicorn's
users expect:

* The **parent** only supervises: it never imports torch, an engine or a model (so it never initialises CUDA).
  It binds the HTTP socket itself (``SO_REUSEADDR``, listening) and passes it to every worker; the kernel
  hands each new connection to whichever worker accepts it first. For gRPC, whose Python server cannot adopt
  a socket, every worker binds the gRPC port with ``SO_REUSEPORT`` (the kernel spreads connections over the
  workers); the parent first binds the same port with ``SO_REUSEPORT`` without listening, which reserves it:
  a port already in use fails here, before any worker starts, with the usual error.
* **Workers** are started with the multiprocessing *spawn* method (a fresh interpreter: safe for CUDA), each
  loads and warms up the repository itself and only then accepts connections and answers ``ready``.
  ``GET /v2/health/ready`` says which worker answered (``"worker": i``).
* **Signals**: SIGINT/SIGTERM to the parent are forwarded to every worker, which drain like a single server
  (in-flight requests finish, gRPC gets its grace period); the parent waits for them, kills a worker that is
  still there after :data:`STOP_TIMEOUT_S`, and exits. Workers run in their own process group (a terminal's
  Ctrl-C reaches the parent only, which forwards it once) and get SIGTERM if the parent dies.
* **A worker that dies** after it was ready is logged and restarted (its models load again; the others keep
  serving meanwhile); more than :data:`MAX_RESTARTS` restarts within :data:`RESTART_WINDOW_S` stop the server.
  A worker that dies *before* it was ready (bad repository, broken engine, port trouble) stops the server
  with that worker's exit status: restarting it would only fail again.
* **Metrics**: the parent points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh temporary directory before the workers
  start; each worker's metrics live in files there (named by worker index, so a restarted worker continues its
  counters) and ``/metrics`` on any worker shows the totals of all workers (see :mod:`miaohui.server.metrics`).
  The directory is removed at exit.
* **Dialogue sessions** are shared by the workers: without ``--session-store`` the parent makes a run directory
  and points every worker at a SQLite file there (WAL mode; removed at exit), so a conversation's turns may
  reach any worker. SQLite rather than the engine process: it needs no ``--shared-engine``, outlives a worker
  that is restarted, and each turn writes one row (compare-and-set on its version) in well under a millisecond.
* **Model control** (``POST /v2/repository/models/{m}/load|unload``) is refused with 409 when N > 1: each worker
  holds its own copy of the models, so a load answered by one worker would leave the others serving the old
  version. Change the repository and restart (or run ``--workers 1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from typing import Any

from miaohui.errors import ConfigError
from miaohui.server.state import ServeSpec

log = logging.getLogger("miaohui.workers")

STOP_TIMEOUT_S = 30.0
"""How long the parent waits for workers to stop after forwarding SIGINT/SIGTERM before killing them."""
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
LOG_FORMAT = "%(asctime)s %(levelname)s {who} %(name)s: %(message)s"


# ---------------------------------------------------------------------------------------------- sockets


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_http_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The shared HTTP listening socket (what uvicorn binds itself in a single process)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen for HTTP on {host}:{port}: {exc.strerror or exc}",
            "stop the process using the port or choose another with --port",
        ) from None
    sock.set_inheritable(True)
    return sock


def reserve_reuseport(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` with SO_REUSEPORT and do not listen: the workers' gRPC servers (SO_REUSEPORT too)
    can share the port, a process without SO_REUSEPORT cannot take it, and a port in use fails here."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen for gRPC on {host}:{port}: {exc.strerror or exc}",
            "stop the process using the port or choose another with --grpc-port",
        ) from None
    return sock


# ---------------------------------------------------------------------------------------------- worker


def _die_with_parent() -> None:
    """SIGTERM this process when the parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _child_setup(index: int) -> None:
    """What every spawned server process (worker ``index``, or the engine process as 0) does first: its own process
    group, SIGTERM when the parent dies, and metric files named by its index."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # Ctrl-C in a terminal reaches the parent only; it forwards the signal once
    _die_with_parent()
    from miaohui.server.metrics import use_worker_files

    use_worker_files(index)  # before any metric exists


def _worker_main(spec: ServeSpec, sock: socket.socket, events: Any) -> None:
    """Entry point of worker ``spec.worker`` (a spawned interpreter)."""
    index, count = spec.worker, spec.workers
    _child_setup(index)
    # engine thread pools default to this worker's share of the cores, not all of them N times over
    spec.apply_process_settings(share=count)
    from miaohui.server.app import run_server

    def ready() -> None:
        events.put(("ready", index, os.getpid()))

    run_server(spec, sockets=[sock], on_ready=ready, log_as=f"w{index}")


def _engine_main(spec: ServeSpec, path: str, events: Any) -> None:
    """Entry point of the engine process of ``--shared-engine`` (a spawned interpreter; "worker" 0)."""
    _child_setup(0)
    spec.apply_process_settings()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT.format(who="engine"))
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_engine_serve(spec, path, events))


async def _engine_serve(spec: ServeSpec, path: str, events: Any) -> None:
    """Load and warm up the repository's models (encoders and chat models), then answer the workers until cancelled
    (SIGTERM)."""
    from miaohui.gcpolicy import flush_pauses_every, freeze_heap
    from miaohui.server.metrics import Metrics
    from miaohui.server.observer_metrics import chat_observers
    from miaohui.serving.engine_process import EngineServer
    from miaohui.serving.repository import ModelManager

    metrics = Metrics()  # batch, queue, compute and generation metrics: shared files, shown by every worker
    manager = ModelManager(
        spec.repository,
        observer_factory=metrics.observer,
        chat_observer_factory=chat_observers(metrics),
    )
    await manager.load_all(spec.models or None)
    server = EngineServer(manager)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by an engine process that died
    await server.start(path)
    freeze_heap("engine process")
    gc_flusher = asyncio.ensure_future(flush_pauses_every())
    events.put(("ready", 0, os.getpid()))
    served = [s.name for s in manager.all_states()]
    log.info("engine process serves %s on %s", served, path)
    try:
        await asyncio.Event().wait()
    finally:
        gc_flusher.cancel()
        await server.stop()
        await manager.stop()


# ---------------------------------------------------------------------------------------------- parent


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    ready: bool = False


class Supervisor:
    """Starts, watches, restarts and stops the workers (see the module docstring for the policy)."""

    def __init__(self, spec: ServeSpec) -> None:
        self.spec, self.count = spec, spec.workers
        self.ctx = multiprocessing.get_context("spawn")
        self.events: Any = self.ctx.Queue()
        self.workers: dict[int, _Worker] = {}
        self.restarts: list[float] = []
        self.stop_signal: int | None = None
        self.sock: socket.socket | None = None
        self.engine_dir = tempfile.mkdtemp(prefix="miaohui-engine-") if spec.shared_engine else ""
        self.engine_socket = os.path.join(self.engine_dir, "engine.sock") if spec.shared_engine else ""

    def _spawn(self, index: int) -> None:
        """Start worker ``index`` (1..N), or with index 0 the engine process of ``--shared-engine``."""
        assert self.sock is not None
        if index == 0:
            proc = self.ctx.Process(
                target=_engine_main, args=(self.spec, self.engine_socket, self.events), name="miaohui-engine"
            )
        else:
            spec = replace(self.spec, worker=index, engine_socket=self.engine_socket or None)
            proc = self.ctx.Process(
                target=_worker_main, args=(spec, self.sock, self.events), name=f"miaohui-worker-{index}"
            )
        proc.start()
        self.workers[index] = _Worker(index, proc)
        log.info("%s started (pid %d)", _who(index), proc.pid)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop_signal is None:
            log.info("received %s: stopping %d workers", signal.Signals(signum).name, len(self.workers))
        self.stop_signal = signum

    def run(self) -> int:
        """Serve until a signal or a fatal worker failure; the exit status."""
        from prometheus_client import multiprocess

        spec = self.spec
        self.sock = bind_http_socket(spec.host, spec.port)
        grpc_guard = reserve_reuseport(spec.host, spec.grpc_port) if spec.grpc_port else None
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        status = 0
        try:
            if spec.shared_engine:
                status = self._start_engine_process()
                if status:
                    return status
            for i in range(1, self.count + 1):
                self._spawn(i)
            log.info(
                "serving %s with %d workers on http://%s:%d (gRPC %s)",
                spec.repository,
                self.count,
                spec.host,
                spec.port,
                spec.grpc_port or "off",
            )
            announced = False
            while self.stop_signal is None:
                self._drain_events()
                if not announced and all(w.ready for w in self.workers.values()):
                    log.info("all %d workers are ready", self.count)  # (and the engine process: it was first)
                    announced = True
                failed = self._check_workers(multiprocess)
                if failed is not None:
                    status = failed
                    break
        finally:
            self._stop_all(self.stop_signal or signal.SIGTERM, multiprocess)
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.sock.close()
            if grpc_guard is not None:
                grpc_guard.close()
            if self.engine_dir:
                shutil.rmtree(self.engine_dir, ignore_errors=True)
        return status

    def _start_engine_process(self) -> int:
        """Start the engine process and wait until its models are warm; then the workers may connect (they find
        its socket in their :class:`ServeSpec`). A non-zero status when it failed or a signal came first."""
        self._spawn(0)
        engine = self.workers[0]
        while not engine.ready:
            if self.stop_signal is not None:
                return 0
            if not engine.process.is_alive():
                log.error("the engine process exited with status %s before it was ready; stopping the server",
                          engine.process.exitcode)  # fmt: skip
                del self.workers[0]
                code = engine.process.exitcode
                return code if isinstance(code, int) and code > 0 else 1
            self._drain_events()
        return 0

    def _drain_events(self) -> None:
        try:
            kind, index, pid = self.events.get(timeout=0.2)
        except (queue.Empty, InterruptedError):
            return
        worker = self.workers.get(index)
        if kind == "ready" and worker is not None and worker.process.pid == pid:
            worker.ready = True
            log.info("%s (pid %d) is ready", _who(index), pid)

    def _check_workers(self, multiprocess: Any) -> int | None:
        """Restart workers that died after they were ready; a fatal exit status otherwise (None: all fine)."""
        for index, worker in list(self.workers.items()):
            proc = worker.process
            if proc.is_alive() or self.stop_signal is not None:
                continue
            code = proc.exitcode
            proc.join()
            multiprocess.mark_process_dead(f"w{index}")
            if not worker.ready:
                log.error(
                    "%s (pid %s) exited with status %s before it was ready; stopping the server",
                    _who(index),
                    proc.pid,
                    code,
                )
                del self.workers[index]
                return code if isinstance(code, int) and code > 0 else 1
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(self.restarts) > MAX_RESTARTS:
                log.error(
                    "%s (pid %s) died with status %s; %d restarts within %.0f s: stopping the server",
                    _who(index),
                    proc.pid,
                    code,
                    len(self.restarts) - 1,
                    RESTART_WINDOW_S,
                )
                del self.workers[index]
                return 1
            log.error("%s (pid %s) died with status %s; restarting it", _who(index), proc.pid, code)
            self._spawn(index)
        return None

    def _stop_all(self, signum: int, multiprocess: Any) -> None:
        # the HTTP workers first (they drain requests the engine process still answers), then the engine process
        self._stop([w for w in self.workers.values() if w.index > 0], signum)
        self._stop([w for w in self.workers.values() if w.index == 0], signum)
        for w in self.workers.values():
            multiprocess.mark_process_dead(f"w{w.index}")
            if w.process.exitcode not in (0, None, -signum):
                log.warning("%s exited with status %s", _who(w.index), w.process.exitcode)
        self.events.close()

    def _stop(self, workers: list[_Worker], signum: int) -> None:
        alive = [w for w in workers if w.process.is_alive()]
        for w in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.process.pid or 0, signum)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for w in alive:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                log.error(
                    "%s (pid %s) did not stop within %.0f s; killing it", _who(w.index), w.process.pid, STOP_TIMEOUT_S
                )
                w.process.kill()
                w.process.join(5)


def _who(index: int) -> str:
    return "the engine process" if index == 0 else f"worker {index}"


def run_workers(spec: ServeSpec) -> None:
    """Run ``spec.workers`` server processes (and with ``spec.shared_engine`` the engine process) until
    SIGINT/SIGTERM; ``SystemExit`` with a non-zero status when the server could not start or a worker kept
    failing."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT.format(who="main"))
    run_dir = ""
    if spec.session_store is None:  # the workers share their dialogue sessions in a SQLite file of the run
        run_dir = tempfile.mkdtemp(prefix="miaohui-run-")
        spec = replace(spec, session_store=f"sqlite:{os.path.join(run_dir, 'sessions.db')}")
    metrics_dir = tempfile.mkdtemp(prefix="miaohui-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # prometheus_client reads it in every worker at import
    try:
        status = Supervisor(spec).run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if status:
        log.error("miaohui server stopped with status %d (see the errors above)", status)
        raise SystemExit(status)
    log.info("all workers stopped")
