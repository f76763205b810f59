"""One loaded model version: engine instances, its dynamic batcher, tokenizer, warm-up.

Requests never touch an engine directly: rows go through the batcher, which pads rows of one length
bucket into a batch and runs it on a free engine instance in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miaohui.engines.base import Engine, Manifest
from miaohui.engines.gpu_base import GpuEngine
from miaohui.engines.loader import load_engine
from miaohui.engines.store import read_manifest
from miaohui.errors import InputError, UnavailableError
from miaohui.models.decision import IntentDecision, decide
from miaohui.nlp.normalize import normalize_text
from miaohui.nlp.slots import Slot, extract_slots
from miaohui.nlp.tokenizer import TextTokenizer, check_length, pad_batch, truncate_ids
from miaohui.serving.batcher import BatcherConfig, BatcherObserver, DynamicBatcher
from miaohui.serving.engine_process import EngineClient
from miaohui.serving.model_config import ModelConfig

MAX_TEXT_CHARS = 4096
log = logging.getLogger("miaohui.served")

ShadowTap = Callable[[list[str], np.ndarray], None]
"""Called with the texts and logits of every :meth:`ServedVersion.classify` (shadow mode,
:mod:`miaohui.serving.shadow`); it must return at once (schedule its work) and never fail the request."""


@dataclass
class Row:
    """One sequence of a request, as the batcher carries it."""

    ids: list[int]


@dataclass
class RowResult:
    output: np.ndarray
    """This row's output vector (logits or embedding)."""


@dataclass
class IntentResult:
    intent: str
    """The best label, or the model's out-of-scope label when its confidence is below the model's threshold."""
    confidence: float
    """The best label's confidence, temperature-scaled as the model was calibrated."""
    slots: list[Slot]
    model: str
    version: int
    candidate: str = ""
    """The best label (equal to ``intent`` unless the answer is out of scope)."""
    out_of_scope: bool = False


class ServedVersion:
    """A model version that is loaded, warmed up and batching."""

    def __init__(self, path: Path, config: ModelConfig, observer: BatcherObserver | None = None) -> None:
        self.path = path
        self.config = config
        instances = config.batching.instances
        self.engines: list[Engine] = self._open_engines()
        self.manifest: Manifest = self.engines[0].manifest if self.engines else read_manifest(path)
        self.name, self.version = self.manifest.name, self.manifest.version
        found = self.manifest.extra.get("decision")
        self.decision = IntentDecision.model_validate(found) if found else None
        """Temperature and out-of-scope threshold from training (None: plain softmax, never out of scope)."""
        self.output_name = self.manifest.outputs[0].name
        self.tensors = self.manifest.task == "tensor"
        """A raw-tensor model (a user's ONNX file): requests go to an engine as they come, no batcher."""
        profile = self.manifest.inputs[0].profile
        self.max_length = self.manifest.max_length or (profile.max[-1] if profile else 1 << 30)
        self.max_batch = min(config.batching.max_batch_size, profile.max[0] if profile else 1 << 30)
        self.tokenizer = (
            TextTokenizer.from_file(path / self.manifest.tokenizer_file, self.max_length)
            if self.manifest.tokenizer_file
            else None
        )
        self.pad_id = self.tokenizer.pad_id if self.tokenizer else 0
        bcfg = (
            config.batching.model_copy(update={"max_batch_size": self.max_batch})
            if config.dynamic_batching
            else BatcherConfig(
                max_batch_size=1,
                max_queue_delay_ms=0,
                max_queue_size=config.batching.max_queue_size,
                instances=instances,
                default_timeout_ms=config.batching.default_timeout_ms,
            )
        )
        self._free: asyncio.Queue[Engine] = asyncio.Queue()
        for engine in self.engines:
            self._free.put_nowait(engine)
        self._pool = ThreadPoolExecutor(max_workers=instances, thread_name_prefix=f"{self.name}-v{self.version}")
        self.batcher: DynamicBatcher[Row, RowResult] = DynamicBatcher(
            self._run_batch, bcfg, observer, name=f"{self.name}:{self.version}"
        )
        self.ready = False
        self.load_seconds = 0.0
        self.warmup_seconds = 0.0
        self.shadow_tap: ShadowTap | None = None
        """Set by :class:`miaohui.serving.shadow.ShadowManager` on a primary version that is shadowed."""

    # ------------------------------------------------------------------ lifecycle

    def _open_engines(self) -> list[Engine]:
        config = self.config
        return [
            load_engine(
                self.path,
                threads=config.instance_threads(),
                verify_checksums=i == 0,
                spin_wait=config.spin_wait,
                graph_copies=config.graph_copies,
                fast_start=config.fast_start,
            )
            for i in range(config.batching.instances)
        ]

    async def start(self) -> None:
        """Start batching and run the warm-up shapes on every instance; only then is the version ready.

        Instances warm up one after another (not at once): CUDA graph capture is not safe from two threads."""
        self.batcher.start()
        started = time.perf_counter()
        engines = [await self._free.get() for _ in self.engines]
        try:
            for engine in engines:
                await asyncio.get_running_loop().run_in_executor(self._pool, self._warm_up, engine)
        finally:
            for engine in engines:
                self._free.put_nowait(engine)
        self.warmup_seconds = time.perf_counter() - started
        self.ready = True
        phases = ", ".join(f"{k.removeprefix('engine_')} {v:.2f}s" for k, v in self.engine_phases().items())
        log.info(
            "%s v%d ready: load %.2fs, warm-up %.2fs%s%s",
            self.name, self.version, self.load_seconds, self.warmup_seconds, f" (engine: {phases})" if phases else "",
            "; compiling in the background (fast_start)" if self.compile_seconds() is None else "",
        )  # fmt: skip

    def compile_seconds(self) -> float | None:
        """Seconds the background compile of a ``fast_start`` version took (the slowest instance); None while one
        runs; 0.0 where there is none."""
        took = [e.compile_seconds() if isinstance(e, GpuEngine) else 0.0 for e in self.engines]
        return None if None in took else max((t for t in took if t is not None), default=0.0)

    def start_timings(self) -> dict[str, float]:
        """Where this version's start went, in seconds: ``load``, ``warmup`` (until ready) and, once done,
        ``compile`` (a ``fast_start`` version's background compile, after ready)."""
        timings = {"load": self.load_seconds, "warmup": self.warmup_seconds}
        compiled = self.compile_seconds()
        if compiled:
            timings["compile"] = compiled
        return timings | self.engine_phases()

    def engine_phases(self) -> dict[str, float]:
        """The GPU engines' own split of load and warm-up (:attr:`GpuEngine.start_phases`, the slowest instance per
        phase), as ``engine_load``, ``engine_compile`` (first calls) and ``engine_capture`` (CUDA graphs)."""
        phases: dict[str, float] = {}
        for engine in self.engines:
            for phase, seconds in (engine.start_phases if isinstance(engine, GpuEngine) else {}).items():
                phases[f"engine_{phase}"] = max(phases.get(f"engine_{phase}", 0.0), seconds)
        return phases

    def warmup_shapes(self, engine: Engine) -> list[tuple[int, int]]:
        """The config's warm-up shapes, then every bucket the engine specialises on (CUDA graphs: none is then
        captured while serving), clamped to this version's limits, each once."""
        buckets = engine.warmup_buckets() if isinstance(engine, GpuEngine) else []
        wanted = [(w.batch, w.sequence) for w in self.config.warmup] + buckets
        # clamped, a bucket past the limits becomes the largest shape served, which the engine pads to that bucket
        return list(dict.fromkeys((max(1, min(b, self.max_batch)), max(2, min(s, self.max_length))) for b, s in wanted))

    def _warm_up(self, engine: Engine) -> None:
        if self.tensors:  # each input at its profile's opt shape, once
            engine.infer({t.name: np.zeros(t.profile.opt if t.profile else [], t.dtype) for t in self.manifest.inputs})
            if isinstance(engine, GpuEngine):
                engine.warmed_up()
            return
        took: list[tuple[float, int, int]] = []
        for batch, seq in self.warmup_shapes(engine):
            ids = np.full((batch, seq), 5, dtype=np.int64)
            started = time.perf_counter()
            engine.infer({"input_ids": ids, "attention_mask": np.ones_like(ids)})
            took.append((time.perf_counter() - started, batch, seq))
        if isinstance(engine, GpuEngine):
            engine.warmed_up()
        if took:  # where a slow start goes (first call, new CUDA-graph buckets, a compile)
            slowest = ", ".join(f"{b}x{s} {t:.2f}s" for t, b, s in sorted(took, reverse=True)[:3])
            log.info(
                "%s v%d instance warmed up: %d shapes in %.2fs (slowest: %s)",
                self.name, self.version, len(took), sum(t for t, _, _ in took), slowest,
            )  # fmt: skip

    async def stop(self) -> None:
        self.ready = False
        await self.batcher.stop(drain=True)
        self._pool.shutdown(wait=True)
        for engine in self.engines:
            engine.close()

    # ------------------------------------------------------------------ compute

    async def _run_batch(self, rows: list[Row]) -> list[RowResult | BaseException]:
        engine = await self._free.get()
        try:
            if self.config.gpu_wait == "poll" and isinstance(engine, GpuEngine) and engine.polls:
                # launched here, polled between other callbacks
                out = await engine.infer_polled(self._feeds(rows))
                return self._results(engine, out, len(rows))
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._compute, engine, rows)
        finally:
            self._free.put_nowait(engine)

    def _compute(self, engine: Engine, rows: list[Row]) -> list[RowResult | BaseException]:
        return self._results(engine, engine.infer(self._feeds(rows)), len(rows))

    def _feeds(self, rows: list[Row]) -> dict[str, np.ndarray]:
        ids, mask = pad_batch([r.ids for r in rows], self.pad_id)
        return {"input_ids": ids, "attention_mask": mask}

    def _results(self, engine: Engine, out: dict[str, np.ndarray], n: int) -> list[RowResult | BaseException]:
        if isinstance(engine, GpuEngine):
            for stage, seconds in engine.last_stages.items():
                self._stage(stage, seconds)
        logits = out[self.output_name]
        return [RowResult(output=logits[i]) for i in range(n)]

    def _stage(self, stage: str, seconds: float) -> None:
        self.batcher.observe("on_stage", stage, seconds)

    async def run_rows(self, rows: list[list[int]], deadline: float | None) -> np.ndarray:
        """Submit every row to the batcher and gather the outputs in order."""
        return await self._outputs(self._submit(rows, deadline))

    def _submit(self, rows: list[list[int]], deadline: float | None) -> asyncio.Task[list[RowResult]]:
        return self.batcher.submit_many([(Row(ids), len(ids)) for ids in rows], deadline)

    @staticmethod
    async def _outputs(pending: asyncio.Task[list[RowResult]]) -> np.ndarray:
        try:
            results = await pending
        except asyncio.CancelledError:
            pending.cancel()  # drops the rows still queued
            raise
        return np.stack([r.output for r in results])

    # ------------------------------------------------------------------ requests

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise InputError(f"model {self.name!r} takes tensors, not text", f"send input_ids to {self.name}")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise InputError(f"text #{i} is empty", "send non-empty text")
            if len(text) > MAX_TEXT_CHARS:
                raise InputError(
                    f"text #{i} has {len(text)} characters; the limit is {MAX_TEXT_CHARS}",
                    "shorten the text or split it",
                )
        ids = self.tokenizer.token_ids([normalize_text(t) for t in texts])
        if self.config.truncate:
            return [truncate_ids(seq, self.max_length) for seq in ids]
        for i, seq in enumerate(ids):
            check_length(seq, self.max_length, i)
        return ids

    async def infer_raw(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A raw-tensor model's request, on a free engine instance as it is (the engine checks names, dtypes and
        the profile)."""
        self.require_task("tensor", "raw tensor inference")
        engine = await self._free.get()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, engine.infer, tensors)
        finally:
            self._free.put_nowait(engine)

    def require_task(self, task: str, endpoint: str) -> None:
        """A request for ``task`` on a model of another task is the caller's mistake: say where to send it."""
        if self.manifest.task != task:
            where = {"intent": "POST /v1/intent", "encoder": "POST /v1/embeddings"}.get(self.manifest.task, "KServe v2")
            raise InputError(
                f"model {self.name!r} is a{'n' if self.manifest.task[0] in 'aeiou' else ''} {self.manifest.task} "
                f"model; {endpoint} needs a{'n' if task[0] in 'aeiou' else ''} {task} model",
                f"send it to {where}, or name a{'n' if task[0] in 'aeiou' else ''} {task} model",
            )

    async def embed(self, texts: list[str], deadline: float | None) -> tuple[np.ndarray, int]:
        """The embeddings of ``texts`` (an ``encoder`` model), through the batcher, and how many tokens they took."""
        self.require_task("encoder", "embeddings")
        started = time.perf_counter()
        rows = self.tokenize(texts)
        self._stage("tokenize", time.perf_counter() - started)
        vectors = await self._outputs(self._submit(rows, deadline))
        return vectors.astype(np.float32, copy=False), sum(len(r) for r in rows)

    async def classify(self, texts: list[str], deadline: float | None, with_slots: bool = True) -> list[IntentResult]:
        self.require_task("intent", "intent classification")
        started = time.perf_counter()
        rows = self.tokenize(texts)
        self._stage("tokenize", time.perf_counter() - started)
        pending = self._submit(rows, deadline)  # queued now
        slots: list[list[Slot]] = [[] for _ in texts]
        if with_slots:  # extract slots while the rows are batched and computed, not after
            try:
                await asyncio.sleep(0)  # one loop turn: the batcher's owner takes the rows to the engine first
                started = time.perf_counter()
                slots = [extract_slots(t) for t in texts]
                self._stage("slots", time.perf_counter() - started)
            except BaseException:
                pending.cancel()
                raise
        logits = await self._outputs(pending)
        if self.shadow_tap is not None:
            try:
                self.shadow_tap(texts, logits)
            except Exception:  # shadowing must never fail the primary request
                log.exception("shadow tap of %s v%d failed", self.name, self.version)
        return [
            IntentResult(
                intent=d.intent,
                confidence=d.confidence,
                slots=slots[i],
                model=self.name,
                version=self.version,
                candidate=d.candidate,
                out_of_scope=d.out_of_scope,
            )
            for i, d in enumerate(decide(logits, self.manifest.labels, self.decision))
        ]

    async def infer_tensors(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, deadline: float | None
    ) -> np.ndarray:
        """Raw tensor path: each row is batched on its own (trailing padding removed)."""
        if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
            raise InputError(
                f"input_ids {list(input_ids.shape)} and attention_mask {list(attention_mask.shape)} "
                "must both be [batch, sequence]",
                "send two int64 tensors of the same 2-D shape",
            )
        if input_ids.shape[1] > self.max_length:
            raise InputError(
                f"sequence length {input_ids.shape[1]} exceeds this model's maximum {self.max_length}",
                "truncate the sequence",
            )
        rows = []
        for r in range(input_ids.shape[0]):
            n = int(attention_mask[r].sum())
            if n < 1 or not np.all(attention_mask[r, :n] == 1) or np.any(attention_mask[r, n:] != 0):
                raise InputError(
                    f"attention_mask row {r} is not right-padded ones then zeros",
                    "use 1 for tokens and 0 for trailing padding",
                )
            rows.append([int(x) for x in input_ids[r, :n]])
        return await self.run_rows(rows, deadline)


class RemoteServedVersion(ServedVersion):
    """A version an HTTP worker of ``--shared-engine`` serves: no engines here; its rows go to the engine process,
    which batches and computes them (:mod:`miaohui.serving.engine_process`). Manifest and tokenizer are read from
    the artifact, so tokenizing, slots and answers stay in the worker."""

    def __init__(
        self, path: Path, config: ModelConfig, observer: BatcherObserver | None, engine_process: EngineClient
    ) -> None:
        self.remote = engine_process
        super().__init__(path, config, observer)
        if self.tensors:
            raise UnavailableError(
                f"{self.name} serves raw tensors, which the shared engine process does not carry",
                "serve it without --shared-engine",
            )

    def _open_engines(self) -> list[Engine]:
        return []

    async def start(self) -> None:
        """Ready once the engine process says it serves this version (it warmed it up)."""
        ready = await self.remote.status()
        if self.version not in ready.get(self.name, []):
            raise UnavailableError(
                f"the engine process does not serve {self.name} version {self.version} "
                f"(it serves {ready or 'nothing'})",
                "see the engine process's load error in the server log",
            )
        self.ready = True

    def start_timings(self) -> dict[str, float]:
        """Empty: the engine process reports its own."""
        return {}

    async def stop(self) -> None:
        self.ready = False

    def _submit(self, rows: list[list[int]], deadline: float | None) -> asyncio.Task[list[RowResult]]:
        return asyncio.get_running_loop().create_task(self._remote_rows(rows, deadline))

    async def _remote_rows(self, rows: list[list[int]], deadline: float | None) -> list[RowResult]:
        out = await self.remote.infer(self.name, self.version, rows, deadline)
        return [RowResult(output=row) for row in out]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def deadline_from_ms(timeout_ms: float | None) -> float | None:
    if timeout_ms is None or not math.isfinite(timeout_ms) or timeout_ms <= 0:
        return None
    return time.monotonic() + timeout_ms / 1000.0
