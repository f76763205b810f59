"""Start the server: model manager + HTTP (uvicorn) + gRPC in one process, one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import uvicorn
from fastapi import FastAPI

from miaohui.gcpolicy import flush_pauses_every, freeze_heap
from miaohui.server.http import create_app
from miaohui.server.metrics import Metrics
from miaohui.server.state import ServerState, ServeSpec
from miaohui.server.status import message
from miaohui.serving.engine_process import EngineClient
from miaohui.serving.repository import ModelManager

log = logging.getLogger("miaohui.server")
GRPC_GRACE_S = 2.0
"""How long in-flight gRPC calls may finish at shutdown."""


def build_app(
    repository: Path,
    models: list[str] | None = None,
    *,
    dialogue_intent: str = "intent",
    dialogue_llm: str | None = None,
    freeze_when_warm: bool = False,
    worker: int = 0,
    workers: int = 1,
    engine_socket: str | None = None,
    session_store: str | None = None,
    api_keys: Path | None = None,
) -> FastAPI:
    """The HTTP app with a lifespan that loads (and warms up) the repository before serving.

    ``freeze_when_warm``: once everything is loaded, collect and freeze the heap (:func:`miaohui.gcpolicy.freeze_heap`),
    before HTTP accepts connections; ``miaohui serve`` does, tests that serve in their own process do not.

    The dialogue pipelines classify with the served model ``dialogue_intent`` and generate their llm
    replies with the causal LM ``dialogue_llm`` (None: those routes answer with their templates).

    ``worker`` / ``workers`` / ``engine_socket``: this process's place among the processes of ``--workers N``
    (:class:`~miaohui.server.state.ServeSpec`); with ``engine_socket`` the models run in the engine process.
    ``session_store``: where the dialogue sessions live (``--session-store``; None: this process's memory).
    ``api_keys``: the key file that HTTP and gRPC check (``--api-keys``; None: an open server)."""
    from miaohui.server.console import mount_console
    from miaohui.server.dialogue_api import DialogueService
    from miaohui.server.observer_metrics import chat_observers
    from miaohui.server.openai_api import LLMTextGenerator
    from miaohui.serving.shadow import ShadowManager

    metrics = Metrics()
    engine = EngineClient(engine_socket) if engine_socket else None  # an HTTP worker of `--shared-engine`
    manager = ModelManager(
        repository,
        observer_factory=metrics.observer,
        engine_process=engine,  # `--shared-engine`: every model runs there, for every worker
        chat_observer_factory=chat_observers(metrics),
    )
    state = ServerState(manager, metrics, worker=worker, workers=workers)
    if api_keys is not None:
        from miaohui.server.auth import Authenticator

        state.auth = Authenticator.from_file(api_keys)
    generator = LLMTextGenerator(manager, dialogue_llm) if dialogue_llm else None
    dialogue = DialogueService.for_manager(
        manager, metrics, intent_model=dialogue_intent, generator=generator, session_store=session_store
    )
    dialogue.worker = worker
    state.dialogue = dialogue
    state.shadow = ShadowManager(manager, metrics)
    app = create_app(state)
    console = mount_console(app, state)  # /ui and /v1/console/*
    shadow = state.shadow

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.load_all(models or None)
        if manager.states():
            dialogue.check_labels()  # logs each pipeline whose routes the intent model lacks
        await shadow.start()
        if freeze_when_warm:
            freeze_heap(f"server pid {os.getpid()}")
        gc_flusher = asyncio.ensure_future(flush_pauses_every())
        console.start()
        try:
            yield
        finally:
            state.shutting_down = True
            gc_flusher.cancel()
            await console.stop()
            await shadow.stop()
            await manager.stop()
            await dialogue.close()

    app.router.lifespan_context = lifespan
    return app


async def serve_async(
    spec: ServeSpec,
    *,
    sockets: list[socket.socket] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Serve until stopped; the exit status: 0 after a normal stop, 1 when gRPC could not start.

    gRPC starts once HTTP listens; ``/v2/health/ready`` says ready only once it listens too. If it cannot (port in
    use, bad host), the error is logged and the whole server stops: a server that silently lacks one protocol is
    worse than none. At shutdown gRPC stops first (in-flight RPCs get a grace period), then the models.

    ``sockets``: listening sockets to serve HTTP on instead of binding ``host:port`` (a worker of
    ``--workers N``, :mod:`miaohui.server.workers`); then gRPC binds its port with SO_REUSEPORT, shared with
    the other workers. ``on_ready`` is called once the models are warm and both protocols listen.
    """
    app = build_app(
        spec.repository,
        spec.models,
        dialogue_llm=spec.dialogue_llm,
        freeze_when_warm=True,
        worker=spec.worker,
        workers=spec.workers,
        engine_socket=spec.engine_socket,
        session_store=spec.session_store,
        api_keys=spec.api_keys,
    )
    state: ServerState = app.state.miaohui
    host, port, grpc_port = spec.host, spec.port, spec.grpc_port
    tls = (spec.tls_cert, spec.tls_key) if spec.tls_cert is not None and spec.tls_key is not None else None
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        ssl_certfile=str(tls[0]) if tls else None,
        ssl_keyfile=str(tls[1]) if tls else None,
    )
    server = uvicorn.Server(config)
    grpc_server: grpc.aio.Server | None = None
    grpc_error: BaseException | None = None

    async def start_grpc_when_ready() -> None:
        nonlocal grpc_server, grpc_error
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        if not grpc_port:
            if on_ready is not None:
                on_ready()
            return
        try:  # the import too: grpcio older than the generated stubs need fails here, and must stop the server
            from miaohui.server.grpc import start_grpc

            grpc_server = await start_grpc(state, host, grpc_port, reuse_port=sockets is not None, tls=tls)
        except Exception as exc:
            grpc_error = exc
            log.error("gRPC could not start, stopping the server: %s", message(exc))
            server.should_exit = True
            return
        state.listening = True
        if on_ready is not None:
            on_ready()

    models_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        async with models_lifespan(a):  # its exit stops the models: stop gRPC before that
            try:
                yield
            finally:
                state.shutting_down = True
                await stop_grpc()

    async def stop_grpc() -> None:
        nonlocal grpc_server
        if grpc_server is not None:
            stopping, grpc_server = grpc_server, None
            await stopping.stop(grace=GRPC_GRACE_S)

    app.router.lifespan_context = lifespan
    state.listening = not grpc_port  # ready only once gRPC listens too
    grpc_starter = asyncio.ensure_future(start_grpc_when_ready()) if grpc_port or on_ready else None
    log.info("serving %s on http://%s:%d (gRPC %s)", spec.repository, host, port, grpc_port or "off")
    try:
        await server.serve(sockets=sockets)
    finally:
        if grpc_starter is not None and not grpc_starter.done():
            grpc_starter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await grpc_starter
        await stop_grpc()  # done in the lifespan already, unless the server never got that far
    return 1 if grpc_error is not None else 0


def run_server(
    spec: ServeSpec,
    *,
    sockets: list[socket.socket] | None = None,
    on_ready: Callable[[], None] | None = None,
    log_as: str | None = None,
) -> None:
    """Run one server process until SIGINT/SIGTERM. Exits non-zero (``SystemExit``) when startup failed: uvicorn
    exits with 3 when HTTP cannot listen or the models' startup raises; 1 when gRPC cannot listen.

    ``sockets``/``on_ready``/``log_as`` are how a worker of ``--workers N`` runs (see :func:`serve_async`); the
    supervisor that starts such workers is :func:`miaohui.server.workers.run_workers`."""
    who = f"{log_as} " if log_as else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s")
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    if spec.worker == 0:  # a worker of --workers N applied its spec (and its core share) at start
        spec.apply_process_settings()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    status = 0
    with contextlib.suppress(KeyboardInterrupt):
        status = asyncio.run(serve_async(spec, sockets=sockets, on_ready=on_ready))
    if status:
        log.error("miaohui server did not start (see the error above); exiting with status %d", status)
        raise SystemExit(status)
