"""Start the server: model manager + HTTP (uvicorn) + gRPC in one process, one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from miaohui.server.http import ServerState, create_app
from miaohui.server.metrics import Metrics
from miaohui.serving.repository import ModelManager

log = logging.getLogger("miaohui.server")


def build_app(repository: Path, models: list[str] | None = None) -> FastAPI:
    """The HTTP app with a lifespan that loads (and warms up) the repository before serving."""
    metrics = Metrics()
    manager = ModelManager(repository, observer_factory=metrics.observer)
    state = ServerState(manager, metrics)
    app = create_app(state)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.load_all(models)
        try:
            yield
        finally:
            state.shutting_down = True
            await manager.stop()

    app.router.lifespan_context = lifespan
    return app


async def serve_async(repository: Path, host: str, port: int, grpc_port: int, models: list[str] | None) -> None:
    app = build_app(repository, models)
    state: ServerState = app.state.miaohui
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    grpc_server = None
    if grpc_port:
        from miaohui.server.grpc import start_grpc

        async def _start_grpc_when_ready() -> None:
            nonlocal grpc_server
            while not server.started:
                await asyncio.sleep(0.05)
            grpc_server = await start_grpc(state, host, grpc_port)

        grpc_starter = asyncio.ensure_future(_start_grpc_when_ready())
    log.info("serving %s on http://%s:%d (gRPC %s)", repository, host, port, grpc_port or "off")
    try:
        await server.serve()
    finally:
        if grpc_port:
            grpc_starter.cancel()
        if grpc_server is not None:
            await grpc_server.stop(grace=2.0)


def run_server(
    repository: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    grpc_port: int = 8001,
    models: list[str] | None = None,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_async(repository, host, port, grpc_port, models))
