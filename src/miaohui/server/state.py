"""What the HTTP and gRPC servers of one process share: :class:`ServerState` and the checks both protocols make
before they act on it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from miaohui.errors import ConflictError, UnavailableError

if TYPE_CHECKING:
    from miaohui.server.dialogue_api import DialogueService
    from miaohui.server.generation_service import GenerationService
    from miaohui.server.metrics import Metrics
    from miaohui.serving.repository import ModelManager
    from miaohui.serving.shadow import ShadowManager


class ServerState:
    """What the routes share: the model manager, metrics and extension routers' state."""

    def __init__(self, manager: ModelManager, metrics: Metrics, *, worker: int = 0, workers: int = 1) -> None:
        self.manager = manager
        self.metrics = metrics
        self.started = time.time()
        self.shutting_down = False
        self.generation: GenerationService | None = None
        """Causal-LM engines (OpenAI routes); None: the server has no generation models."""
        self.dialogue: DialogueService | None = None
        """Dialogue pipelines (``/v1/dialogue``, ``pipeline/<name>`` chat models); None: not served."""
        self.shadow: ShadowManager | None = None
        """Shadow comparisons of candidate versions (``/v1/shadow``); None: not served."""
        self.worker = worker
        """This process's worker index with ``--workers N`` (1..N); 0 in a single-process server."""
        self.workers = workers
        """N: how many worker processes serve (each holds its own models)."""


def check_model_control(state: ServerState) -> None:
    """Model load/unload changes one process's models: refused when several workers serve (each holds its own)."""
    if state.workers > 1:
        raise ConflictError(
            f"model control (load/unload) is not available with --workers {state.workers}: each worker process "
            "holds its own copy of the models, and a load would reach only the worker that received it",
            "change the repository and restart the server, or serve with --workers 1 to load/unload over the API",
        )


def check_not_shutting_down(state: ServerState) -> None:
    if state.shutting_down:
        raise UnavailableError("the server is shutting down", "retry on another replica")
