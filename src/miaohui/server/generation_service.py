"""The server's causal-LM engines: one :class:`AsyncLLMEngine` per causal-LM model of the repository.

:class:`GenerationService` loads the newest version of each causal-LM model (see
:mod:`miaohui.generation.build.artifact` for the layout) on ONNX Runtime, warms it up (one short prefill +
decode) and starts its loop; ``stop()`` stops them (unfinished streams end with an error). Metrics go to
the server's :class:`Metrics` through :class:`~miaohui.server.observer_metrics.MetricsObserver`.
:class:`LLMTextGenerator` lets the dialogue pipelines use a served model for their replies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miaohui.errors import ModelNotFoundError
from miaohui.generation.build.artifact import (
    CONFIG_NAME,
    CausalLMInfo,
    ChatTokenizer,
    causal_lm_names,
    latest_version,
    load_generation_config,
    read_info,
)
from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine
from miaohui.generation.engine.llamacpp_engine import LlamaCppLLMEngine
from miaohui.generation.engine.observer import GenerationObserver
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.server.status import message
from miaohui.serving.engine_process import EngineClient
from miaohui.serving.remote_llm import RemoteLLMEngine

if TYPE_CHECKING:
    from miaohui.dialogue.pipeline import ChatMessage
    from miaohui.generation.executors.base import AnyCausalLMEngine
    from miaohui.generation.executors.slot_engine import TorchSlotEngine
    from miaohui.generation.executors.slot_options import SlotEngineOptions
    from miaohui.server.metrics import Metrics

log = logging.getLogger("miaohui.generation")


@dataclass
class LoadedLLM:
    """One served causal-LM version."""

    name: str
    version: int
    path: Path | None
    """The repository version folder (None for an engine added with ``add_engine``)."""
    info: CausalLMInfo
    tokenizer: ChatTokenizer
    engine: AsyncLLMEngine | RemoteLLMEngine | LlamaCppLLMEngine
    """The model's loop here (llama.cpp's server for a ``llamacpp`` version), or (an HTTP worker of
    ``--shared-engine``) the engine process's."""
    max_model_len: int
    vocab: int
    """Token ids a prompt may hold: [0, vocab)."""


class GenerationService:
    """Loads every causal-LM model of ``repository`` (newest version each) and serves it.

    ``scheduler`` / ``threads`` are the defaults for models without a ``generation.yaml``; ``names``
    restricts loading to those models. A model that fails to load is logged and left out (its error is
    kept in ``failures`` and named in its 404); the others serve.
    """

    def __init__(
        self,
        repository: Path,
        metrics: Metrics | None = None,
        *,
        names: Sequence[str] | None = None,
        scheduler: SchedulerConfig | None = None,
        threads: int | None = None,
        engine_process: EngineClient | None = None,
    ) -> None:
        self.repository = Path(repository)
        self.metrics = metrics
        self.names = list(names) if names is not None else None
        self.scheduler = scheduler or SchedulerConfig()
        self.threads = threads
        self.engine_process = engine_process
        """In an HTTP worker of ``--shared-engine``: the models run in the engine process (:class:`RemoteLLMEngine`)."""
        self.failures: dict[str, str] = {}
        self._models: dict[str, LoadedLLM] = {}
        self._started = False

    async def start(self) -> None:
        """Load and warm up (one short prefill + decode) every model, one after the other."""
        if self.engine_process is not None:
            await self._start_remote(self.engine_process)
            return
        for name in self.names if self.names is not None else causal_lm_names(self.repository):
            try:
                self._models[name] = await self._load(name)
                self.failures.pop(name, None)
            except Exception as exc:  # a broken model must not keep the others from serving
                self.failures[name] = message(exc)
                log.error("causal LM %s failed to load: %s", name, message(exc))
        self._started = True

    async def _start_remote(self, client: EngineClient) -> None:
        """The engine process's models: their tokenizer and info from the artifact, the engine over the socket."""
        status = await client.llm_status()
        names = self.names if self.names is not None else causal_lm_names(self.repository)
        for name in names:
            served = status["models"].get(name)
            if served is None:
                self.failures[name] = status["failures"].get(name, "the engine process did not load it")
                continue
            path = self.repository / name / str(served["version"])
            info = read_info(path)
            engine = RemoteLLMEngine(client, name, int(served["vocab"]))
            await engine.start()
            tokenizer = ChatTokenizer.from_dir(path, info)
            self._models[name] = LoadedLLM(
                name, info.version, path, info, tokenizer, engine, int(served["max_model_len"]), engine.vocab
            )
        self._started = True

    async def _load(self, name: str) -> LoadedLLM:
        from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

        model_dir = self.repository / name
        version = latest_version(model_dir)
        if version is None:
            raise ModelNotFoundError(f"no versions of {name!r} in {self.repository}", "run `miaohui build-llm`")
        path = model_dir / str(version)
        info = read_info(path)
        cfg = load_generation_config(model_dir)
        sched = cfg.scheduler if (model_dir / CONFIG_NAME).is_file() else self.scheduler
        started = time.perf_counter()
        if info.backend == "llamacpp":
            return await self._serve_llamacpp(info, path, sched, cfg.threads or self.threads, started)
        engine: AnyCausalLMEngine
        if info.backend == "inductor":
            engine = await asyncio.to_thread(_load_static, path, cfg.engine)
        else:
            engine = await asyncio.to_thread(OrtCausalLMEngine, path, threads=cfg.threads or self.threads)
        try:
            return await self._serve(info, path, engine, ChatTokenizer.from_dir(path, info), sched, started)
        except BaseException:
            engine.close()
            raise

    async def _serve_llamacpp(
        self, info: CausalLMInfo, path: Path, sched: SchedulerConfig, threads: int | None, started: float
    ) -> LoadedLLM:
        """A ``llamacpp`` version: llama.cpp's server in this process behind miaohui's admission and streams."""
        tokenizer = ChatTokenizer.from_dir(path, info)
        llm = LlamaCppLLMEngine(path, sched, self._observer(info), threads=threads)
        await llm.start(warmup=True)
        seconds = time.perf_counter() - started
        log.info("causal LM %s v%d (llamacpp %s) ready in %.1fs", info.name, info.version, info.precision, seconds)
        return LoadedLLM(info.name, info.version, path, info, tokenizer, llm, llm.config.max_model_len, llm.vocab)

    def _observer(self, info: CausalLMInfo) -> GenerationObserver | None:
        if self.metrics is None:
            return None
        from miaohui.server.observer_metrics import MetricsObserver

        return MetricsObserver(self.metrics, info.name, info.version)

    async def add_engine(
        self,
        info: CausalLMInfo,
        engine: AnyCausalLMEngine,
        tokenizer: ChatTokenizer,
        scheduler: SchedulerConfig | None = None,
    ) -> LoadedLLM:
        """Serve an engine that was made elsewhere (a torch/GPU engine, a test double) as ``info.name``;
        it replaces a model of that name only after it started. The service owns it: ``stop()`` closes it."""
        llm = await self._serve(info, None, engine, tokenizer, scheduler or self.scheduler, time.perf_counter())
        old = self._models.get(info.name)
        self._models[info.name] = llm
        if old is not None:
            await old.engine.stop()
        return llm

    async def _serve(
        self,
        info: CausalLMInfo,
        path: Path | None,
        engine: AnyCausalLMEngine,
        tokenizer: ChatTokenizer,
        sched: SchedulerConfig,
        started: float,
    ) -> LoadedLLM:
        if sched.max_model_len > engine.max_positions:
            sched = sched.model_copy(update={"max_model_len": engine.max_positions})
        loop = AsyncLLMEngine(LLMEngine(engine, tokenizer.tokenizer, sched), self._observer(info))
        await loop.start(warmup=True)
        seconds = time.perf_counter() - started
        log.info("causal LM %s v%d (%s) ready in %.1fs", info.name, info.version, info.precision, seconds)
        vocab = engine.dims.vocab
        return LoadedLLM(info.name, info.version, path, info, tokenizer, loop, sched.max_model_len, vocab)

    async def stop(self) -> None:
        """Stop every engine; unfinished streams end with an error event, waiting requests with 503."""
        models, self._models = list(self._models.values()), {}
        self._started = False
        for m in models:
            await m.engine.stop()
            if isinstance(m.engine, AsyncLLMEngine):
                m.engine.llm.engine.close()

    @property
    def ready(self) -> bool:
        """Started, and every loaded engine is running."""
        return self._started and all(m.engine.is_running for m in self._models.values())

    def loaded(self) -> list[LoadedLLM]:
        return [self._models[n] for n in sorted(self._models)]

    def get(self, name: str) -> LoadedLLM:
        """The served model ``name``; ModelNotFoundError (404) naming the served ones otherwise."""
        llm = self._models.get(name)
        if llm is not None:
            return llm
        if name in self.failures:
            raise ModelNotFoundError(f"model {name!r} failed to load: {self.failures[name]}", "rebuild it and restart")
        known = ", ".join(sorted(self._models)) or "none"
        raise ModelNotFoundError(f"The model '{name}' does not exist", f"generation models served here: {known}")

    def engine(self, name: str) -> AsyncLLMEngine | RemoteLLMEngine | LlamaCppLLMEngine:
        return self.get(name).engine


def _load_static(path: Path, options: SlotEngineOptions | None) -> TorchSlotEngine:
    """Load an ``inductor`` causal-LM version and compile / capture its CUDA graphs (the warm-up)."""
    from miaohui.generation.build.static_artifact import load_slot_engine

    engine = load_slot_engine(path, options)
    try:
        engine.warmup(log=log.info)
    except BaseException:
        engine.close()
        raise
    return engine


class LLMTextGenerator:
    """A served causal LM as the dialogue pipelines' ``TextGenerator`` (greedy by default)."""

    def __init__(self, service: GenerationService, model: str) -> None:
        self.service, self.model = service, model

    async def generate(self, messages: list[ChatMessage], max_tokens: int, temperature: float = 0.0) -> str:
        llm = self.service.get(self.model)
        ids = llm.tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
        room = llm.max_model_len - len(ids)
        params = SamplingParams.create(max_tokens=max(1, min(max_tokens, room)), temperature=temperature)
        parts = [event.text async for event in llm.engine.generate(ids, params)]
        return "".join(parts)
