"""What a server process is told and what its protocols share: :class:`ServeSpec` (the process's settings, the one
object that crosses into spawned workers and the engine process), :class:`ServerState` (what the HTTP and gRPC
servers of one process share) and the checks both protocols make before they act on it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miaohui.errors import ConfigError, ConflictError, UnavailableError
from miaohui.generation.build.artifact import is_causal_lm_model

if TYPE_CHECKING:
    from miaohui.server.auth import Authenticator
    from miaohui.server.dialogue_api import DialogueService
    from miaohui.server.metrics import Metrics
    from miaohui.serving.repository import ModelManager
    from miaohui.serving.shadow import ShadowManager


@dataclass(frozen=True)
class ServeSpec:
    """What a server process serves and how (picklable: it crosses the spawn boundary). ``miaohui serve`` makes one;
    the supervisor of ``--workers N`` hands each worker a copy with its ``worker`` index and, with
    ``--shared-engine``, the ``engine_socket`` of the engine process."""

    repository: Path
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 8001
    """0: no gRPC."""
    models: list[str] | None = None
    """Models to load; None: every model of the repository."""
    dialogue_llm: str | None = None
    """Causal LM the dialogue pipelines generate with; None: their templates only."""
    workers: int = 1
    """Server processes sharing the ports (more than 1: a supervisor process starts them)."""
    shared_engine: bool = False
    """With ``workers`` > 1: one engine process loads the models and runs them for every worker."""
    worker: int = 0
    """This process's worker index (1..workers); 0 in a single-process server, the supervisor and the engine
    process."""
    engine_socket: str | None = None
    """Set in the workers of ``--shared-engine``: the Unix socket of the engine process they send their rows to."""
    cores: int | None = None
    """Cores each process sizes its engine thread pools for (``--cores``); None: a worker's share of the cores the
    server may run on (all of them in a single-process server and the engine process), so N workers do not each
    start a pool as wide as the machine."""
    gc_freeze: bool = True
    """Once warm, collect once and freeze the heap (``gc.freeze()``), again after every model change: later
    collections walk only what serving made, so their pauses stay short (``--no-gc-freeze`` for A/B runs)."""
    session_store: str | None = None
    """Where the dialogue sessions live (``--session-store``): ``memory`` (None: this process's memory), ``sqlite:PATH``
    (the processes of one host; ``--workers N`` makes one in its run directory when none is given) or
    ``redis://host:port/db`` (several servers)."""
    api_keys: Path | None = None
    """The API key file (``--api-keys``, :mod:`miaohui.server.auth`); None: no keys asked (an open server)."""
    tls_cert: Path | None = None
    """PEM certificate (chain) for HTTPS and gRPC over TLS (``--tls-cert``, with ``--tls-key``); None: plain text."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert`` (``--tls-key``)."""
    gil_switch_us: float | None = None
    """Python's GIL switch interval in every server process (``--gil-switch-us``); None: 50 µs where a generation
    loop runs (its step thread gets the GIL back sooner), else Python's 5 ms."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers {self.workers} is not a process count", "use --workers 1 or more")
        if self.shared_engine and self.workers < 2:
            raise ConfigError(
                "--shared-engine needs --workers 2 or more", "add --workers N (one process already owns its engines)"
            )
        from miaohui.dialogue.session_stores import store_kind

        store_kind(self.session_store)  # a bad --session-store fails here, before any process starts
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together", "give both PEM files, or neither for plain text")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{flag} {path} is not a file", f"give the PEM file's path with {flag}")
        if self.cores is not None and self.cores < 1:
            raise ConfigError(f"--cores {self.cores} is not a core count", "use --cores 1 or more, or leave it out")

    def apply_process_settings(self, share: int = 1) -> None:
        """What a server process does first with its spec: size thread pools for ``cores`` (else the usable cores
        divided by ``share``), set the GIL switch interval it configures and whether the heap is frozen."""
        from miaohui.engines.target import affinity_cores, set_core_share
        from miaohui.gcpolicy import set_freeze
        from miaohui.gil import apply_switch_interval, configure

        set_core_share(self.cores if self.cores is not None else max(1, affinity_cores() // share))
        set_freeze(self.gc_freeze)
        configure(self.gil_switch_us)
        apply_switch_interval()


class ServerState:
    """What the routes share: the model manager, metrics and extension routers' state."""

    def __init__(self, manager: ModelManager, metrics: Metrics, *, worker: int = 0, workers: int = 1) -> None:
        self.manager = manager
        self.metrics = metrics
        self.started = time.time()
        self.shutting_down = False
        self.listening = True
        """False while a protocol the server was started with does not listen yet (gRPC starts once HTTP accepts):
        ``/v2/health/ready`` answers 503 until it does, so a client told "ready" can use either protocol."""
        self.dialogue: DialogueService | None = None
        """Dialogue pipelines (``/v1/dialogue``, ``pipeline/<name>`` chat models); None: not served."""
        self.shadow: ShadowManager | None = None
        """Shadow comparisons of candidate versions (``/v1/shadow``); None: not served."""
        self.auth: Authenticator | None = None
        """API keys (``--api-keys``); None: an open server."""
        self.worker = worker
        """This process's worker index with ``--workers N`` (1..N); 0 in a single-process server."""
        self.workers = workers
        """N: how many worker processes serve (each holds its own models)."""


def check_model_control(state: ServerState, model: str | None = None) -> None:
    """Model load/unload changes one process's models: refused when several workers serve (each holds its own) —
    except a chat model under ``--shared-engine``, which the engine process loads for every worker (their requests
    go to its serving version)."""
    shared_chat = (
        model is not None
        and state.manager.engine_process is not None
        and is_causal_lm_model(state.manager.repository / model)
    )
    if state.workers > 1 and not shared_chat and model is not None and state.manager.engine_process is not None:
        raise ConflictError(
            f"loading or unloading encoder model {model!r} is not available with --workers {state.workers} "
            "--shared-engine: the engine process would load it, but every worker keeps its own copy of the versions "
            "it sends rows to and would keep asking for the old ones",
            "change the repository and restart the server (chat models load and unload over the API under "
            "--shared-engine), or serve with --workers 1",
        )
    if state.workers > 1 and not shared_chat:
        raise ConflictError(
            f"model control (load/unload) is not available with --workers {state.workers}: each worker process "
            "holds its own copy of the models, and a load would reach only the worker that received it",
            "change the repository and restart the server, or serve with --workers 1 to load/unload over the API",
        )


def check_not_shutting_down(state: ServerState) -> None:
    if state.shutting_down:
        raise UnavailableError("the server is shutting down", "retry on another replica")
