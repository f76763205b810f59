"""Chat (causal-LM) versions of the model repository, served by the same
:class:`~miaohui.serving.repository.ModelManager` as the encoders.

A :class:`ServedChatVersion` is one loaded, warmed-up version: its tokenizer and chat template, and its front end —
an :class:`~miaohui.generation.engine.client.LLMClient` chosen once, when the version loads, by :func:`make_client`:

* ``--shared-engine`` HTTP worker → :class:`~miaohui.serving.remote_llm.RemoteLLMEngine` (the engine process runs it);
* ``llamacpp`` version → :class:`~miaohui.generation.engine.llamacpp_engine.LlamaCppLLMEngine`;
* ``onnxruntime`` / ``inductor`` version → :class:`~miaohui.generation.engine.engine_loop.AsyncLLMEngine` over the
  version's executor.

A version that the manager swaps out or unloads *retires*: it takes no new request (the manager no longer routes to
it, or answers 503 while a model unloads), the streams running on it finish there, then it shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from miaohui.generation.build.artifact import (
    CONFIG_NAME,
    CausalLMInfo,
    ChatTokenizer,
    GenerationModelConfig,
    read_info,
)
from miaohui.generation.engine.client import LLMClient
from miaohui.generation.engine.observer import GenerationObserver
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.serving.remote_llm import RemoteLLMEngine

if TYPE_CHECKING:
    from miaohui.generation.engine.params import SamplingParams
    from miaohui.generation.executors.base import AnyCausalLMEngine
    from miaohui.generation.executors.slot_defaults import ServeDefaults
    from miaohui.generation.executors.slot_engine import TorchSlotEngine
    from miaohui.generation.executors.slot_options import SlotEngineOptions
    from miaohui.serving.engine_process import EngineClient

log = logging.getLogger("miaohui.generation")

ChatObserverFactory = Callable[[str, int], GenerationObserver | None]
"""``(model, version)`` → the metrics hooks of that version's generation loop (None: no metrics)."""

ChatShadowTap = Callable[[list[int], "SamplingParams", list[int], str], None]
"""Called with (prompt ids, sampling parameters, answer token ids, answer text) of every request the OpenAI API
answered on a version in full (shadow mode, :mod:`miaohui.serving.shadow`); it must return at once (schedule its
work) and never fail the request."""


@dataclass(frozen=True)
class ChatDefaults:
    """How chat models without a ``generation.yaml`` are served (``miaohui serve`` flags, tests)."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    threads: int | None = None
    drain_timeout_s: float = 600.0
    """A retiring version waits this long for its running streams, then ends the rest with 503."""


class ServedChatVersion:
    """One chat version that is loaded and warmed up (``ready``), or retiring."""

    def __init__(
        self,
        info: CausalLMInfo,
        path: Path | None,
        tokenizer: ChatTokenizer,
        client: LLMClient,
        config: GenerationModelConfig | None = None,
    ) -> None:
        self.info, self.path, self.tokenizer, self.client = info, path, tokenizer, client
        self.name, self.version = info.name, info.version
        self.config = config
        """What it was loaded with (a reload with an equal config keeps the version serving)."""
        self.ready = False
        self.load_seconds = 0.0
        self.shadow_tap: ChatShadowTap | None = None
        """Set by :class:`miaohui.serving.shadow.ShadowManager` on a primary version that is shadowed."""

    @property
    def vocab(self) -> int:
        return self.client.vocab

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def busy(self) -> int:
        """Requests running or waiting on this version."""
        return self.client.num_running + self.client.num_waiting

    async def start(self) -> None:
        """Start the front end with its warm-up request; only then is the version ready."""
        started = time.perf_counter()
        await self.client.start(warmup=True)
        self.ready = True
        self.load_seconds += time.perf_counter() - started
        if not isinstance(self.client, RemoteLLMEngine):  # the engine process logs its own
            info, seconds = self.info, self.load_seconds
            log.info("causal LM %s v%d (%s) ready in %.1fs", self.name, self.version, info.precision, seconds)

    def start_timings(self) -> dict[str, float]:
        """Where this version's start went, in seconds (``miaohui_model_start_seconds``): ``load`` and ``warmup``
        (together the cold start) and, for a GPU slot engine in this process, its own split: ``engine_load``
        (weights and compile cache), ``engine_compile`` (torch.compile) and ``engine_capture`` (CUDA graphs)."""
        phases = {f"engine_{k}": v for k, v in self.client.start_phases.items()}
        load = phases.get("engine_load", self.load_seconds)
        return {"load": load, "warmup": max(0.0, self.load_seconds - load)} | phases

    async def retire(self, timeout_s: float) -> None:
        """Let the running streams finish (up to ``timeout_s``; the rest end with EngineStoppedError, 503), then
        shut down. The caller has stopped routing requests here."""
        self.ready = False
        deadline = time.monotonic() + timeout_s
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.busy:
            log.warning("chat model %s v%d retired with %d streams unfinished", self.name, self.version, self.busy)
        await self.client.shutdown()
        log.info("chat model %s v%d retired", self.name, self.version)

    async def stop(self) -> None:
        """Shut down now: unfinished streams end with EngineStoppedError."""
        self.ready = False
        await self.client.shutdown()


def chat_scheduler(model_dir: Path, config: GenerationModelConfig, defaults: ChatDefaults) -> SchedulerConfig:
    """The model's ``generation.yaml`` scheduler if it has one, else the server's default."""
    return config.scheduler if (model_dir / CONFIG_NAME).is_file() else defaults.scheduler


async def make_client(
    path: Path,
    info: CausalLMInfo,
    tokenizer: ChatTokenizer,
    config: GenerationModelConfig,
    defaults: ChatDefaults,
    observer: GenerationObserver | None,
    engine_process: EngineClient | None,
    *,
    pinned: bool = False,
) -> LLMClient:
    """The version's front end, chosen once (see the module docstring); not started. ``pinned``: an engine-process
    version takes requests as itself, not as the model's serving version (a shadow candidate)."""
    if engine_process is not None:
        return await RemoteLLMEngine.connect(engine_process, info.name, info.version, pinned=pinned)
    sched = chat_scheduler(path.parent, config, defaults)
    threads = config.threads or defaults.threads
    if info.backend == "llamacpp":
        from miaohui.generation.engine.llamacpp_engine import LlamaCppLLMEngine

        return LlamaCppLLMEngine(path, sched, observer, threads=threads, cache_prompt=True)
    from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

    engine: AnyCausalLMEngine
    if info.backend == "inductor":
        given = config.engine if (path.parent / CONFIG_NAME).is_file() else None
        engine, sched = await asyncio.to_thread(_load_static, path, info, given, sched)
    else:
        engine = await asyncio.to_thread(OrtCausalLMEngine, path, threads=threads)
    return local_client(engine, tokenizer, sched, observer)


def local_client(
    engine: AnyCausalLMEngine, tokenizer: ChatTokenizer, sched: SchedulerConfig, observer: GenerationObserver | None
) -> LLMClient:
    """miaohui's step loop in this process over ``engine`` (an executor made here or elsewhere)."""
    from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine

    if sched.max_model_len > engine.max_positions:
        sched = sched.model_copy(update={"max_model_len": engine.max_positions})
    return AsyncLLMEngine(LLMEngine(engine, tokenizer.tokenizer, sched), observer)


async def load_chat_version(
    path: Path,
    config: GenerationModelConfig,
    defaults: ChatDefaults,
    observer: GenerationObserver | None,
    engine_process: EngineClient | None,
) -> ServedChatVersion:
    """Load version folder ``path`` and start it (warm-up included): ready to serve, or an error and nothing left.
    The model's shadow candidate (``config.shadow``) is pinned (:func:`make_client`)."""
    started = time.perf_counter()
    info = read_info(path)
    # named where it is served: a version folder copied in keeps the name and number it was built as in causal_lm.json
    info = info.model_copy(update={"name": path.parent.name, "version": int(path.name)})
    tokenizer = ChatTokenizer.from_dir(path, info)
    pinned = config.shadow is not None and config.shadow.version == info.version
    client = await make_client(path, info, tokenizer, config, defaults, observer, engine_process, pinned=pinned)
    served = ServedChatVersion(info, path, tokenizer, client, config)
    served.load_seconds = time.perf_counter() - started
    try:
        await served.start()
    except BaseException:
        await client.shutdown()
        raise
    return served


def _default_options(
    path: Path, info: CausalLMInfo, sched: SchedulerConfig
) -> tuple[SlotEngineOptions, SchedulerConfig]:
    """A decoder without engine options (no ``generation.yaml``, or one without ``engine:``): on a GPU, the options
    :func:`version_defaults` picks for its memory; on a CPU,
    :func:`~miaohui.generation.executors.slot_defaults.choose_cpu_defaults` for ``sched`` and the machine's memory
    (the engine's own 64 slots x 2048 tokens are a GPU server's: in fp32 on a CPU, GBs of RAM)."""
    import torch

    if torch.cuda.is_available():
        chosen = version_defaults(path, info, torch.cuda.mem_get_info()[1])
    else:
        import psutil

        from miaohui.generation.build.static_artifact import read_static_meta
        from miaohui.generation.executors.slot_defaults import choose_cpu_defaults

        meta = read_static_meta(path)
        memory = psutil.virtual_memory().total
        chosen = choose_cpu_defaults(meta.dims, memory, meta.precision, sched.max_running_seqs, sched.max_model_len)
    has_file = (path.parent / CONFIG_NAME).is_file()
    given = f"'s {CONFIG_NAME} has no engine section" if has_file else f" has no {CONFIG_NAME}"
    log.info("%s v%d%s: %s", info.name, info.version, given, chosen.reason)
    return chosen.engine, sched.model_copy(update=chosen.scheduler)


def version_defaults(path: Path, info: CausalLMInfo, gpu_memory_bytes: int) -> ServeDefaults:
    """What :func:`~miaohui.generation.executors.slot_defaults.choose_defaults` picks for the ``inductor`` version
    ``path`` on a GPU of ``gpu_memory_bytes``: from its dims and precision (``static_decoder.json``), with int8 at
    batch 1 only where ``miaohui validate`` passed on it (``causal_lm.json``'s ``validation["int8_batch1"]``)."""
    from miaohui.generation.build.static_artifact import serve_defaults

    return serve_defaults(path, info.validation, gpu_memory_bytes)


def _load_static(
    path: Path, info: CausalLMInfo, options: SlotEngineOptions | None, sched: SchedulerConfig
) -> tuple[TorchSlotEngine, SchedulerConfig]:
    """Load an ``inductor`` causal-LM version and compile / capture its CUDA graphs (the warm-up), with ``options``
    (its generation.yaml's) or, where it has none, the defaults for this GPU or CPU (:func:`_default_options`). One
    thread does it all, CUDA's initialisation included, as the build does: on the H200 a serve that initialised CUDA
    on the event loop's thread and compiled on this one missed every entry of its compile cache, where the engine
    process, doing both on one thread, hit them (the one difference found between the two;
    lab/notes/2026-12-05-own-gpu-start.md)."""
    from miaohui.generation.build.static_artifact import load_slot_engine

    if options is None:
        options, sched = _default_options(path, info, sched)
    engine = load_slot_engine(path, options)
    try:  # the graphs a start's first requests do not need are captured after ready (capture_after_ready)
        engine.warmup(log=log.info, defer=True)
    except BaseException:
        engine.close()
        raise
    return engine, sched
