"""The loaded ``inductor`` engine (built by :mod:`miaohui.engines.inductor`): either artifact format; on CUDA one
CUDA graph per (batch, sequence) bucket over static input buffers, captured at warm-up on this instance's own
stream, inputs staged through pinned host memory and padded to the bucket. Options: ``graph_copies`` (the copies
inside the graph), ``fast_start`` (answer at once with the fast model's saved weights run as is, load and compile
the program in the background and swap its graphs in),
:meth:`InductorEngine.infer_polled` (``gpu_wait: poll``).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miaohui.engines.base import Manifest
from miaohui.engines.encoder_buckets import batch_buckets, seq_buckets
from miaohui.engines.fast_graphs import TRITON_FILE, restore_triton_cache, triton_version
from miaohui.engines.gpu_base import GpuEngine
from miaohui.engines.inductor import (
    AOTI_FILE,
    CACHE_FILE,
    FloatLogits,
    compile_program,
    first_calls,
    gpu_kernels_at_load,
    load_package,
    program_pdl,
    static_view,
)
from miaohui.errors import ArtifactError
from miaohui.models.fast_bert import has_fast, load_fast, use_direct_ops, use_kernels

log = logging.getLogger(__name__)
_CAPTURE_LOCK = threading.Lock()


class _Bucket:
    """One captured CUDA graph with its static device buffers and pinned host staging buffers.

    ``input_ids`` and ``attention_mask`` are the two halves of one device tensor ``io`` [2, b, s] (the graph reads
    them as views), staged through one pinned ``host_io``: a batch's inputs go over in a single copy. With
    ``copies`` the graph itself starts with that copy and ends with the outputs' copy into ``host_out``, so a batch
    is one replay (see :attr:`InductorEngine.graph_copies`); without, the two copies are launched around it."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        io: torch.Tensor,
        out: torch.Tensor,
        host_io: torch.Tensor,
        host_out: torch.Tensor,
        copies: bool,
        compiled: bool,
    ) -> None:
        self.graph, self.io, self.out = graph, io, out
        self.host_io, self.host_out = host_io, host_out
        self.copies = copies
        self.compiled = compiled
        """Captured from the compiled program; False: from the eager program (``fast_start``, until upgraded)."""


STAGE_SAMPLE_EVERY = 16
"""Batches per timed batch: the first batch after warm-up and every 16th after it record their stages (h2d, gpu,
d2h) with CUDA events. Timing every batch cost 4 event records + 3 elapsed-time reads (each a GIL release and
take-back) on the host path of every batch; a sample keeps the stage histograms
(``miaohui_stage_duration_seconds``) without that."""


class InductorEngine(GpuEngine):
    """A loaded inductor artifact (either format); CUDA-graph replay per (batch, sequence) bucket on GPUs."""

    def __init__(
        self,
        manifest: Manifest,
        path: Path,
        use_cuda_graphs: bool = True,
        graph_copies: bool = True,
        fast_start: bool = False,
        program_check: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(manifest, path)
        self._program_check = program_check
        """Run before the program is read (its sha256, when the loader deferred it to a ``fast_start`` upgrade)."""
        self.device = torch.device("cuda" if manifest.target.device == "cuda" else "cpu")
        self.packaged = manifest.engine_file == AOTI_FILE
        self.use_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.polls = self.use_graphs  # infer_polled launches a replay and polls its done event
        self.graph_copies = graph_copies
        """Capture the input copy (pinned host → device) and the output copy (device → pinned host) inside each
        bucket's graph: a batch is then one replay and one wait instead of copy, replay, copy, wait — each of them
        a call that lets go of the GIL and must take it back while an event loop may hold it (host gaps of a few
        tenths of a millisecond around a copy of tens of microseconds). Falls back to copies outside the graph where
        this torch cannot capture them. On by default (``ModelConfig.graph_copies``)."""
        self._eager: Any = None
        """``fast_start``: the fast model rebuilt from ``eager.safetensors`` (or, in artifacts without it, the exported
        program) run as is — no Dynamo, no Inductor — until :meth:`upgrade` is done."""
        self._static: dict[tuple[int, ...], Any] = {}
        """Buckets with a program of their own, compiled for exactly that shape (``BuildConfig.static_shapes``)."""
        started = time.perf_counter()
        self._kernels = gpu_kernels_at_load(manifest.extra)
        """Built with ``gpu_kernels tuned``: the tuning entries are loaded, and each program compiles with PDL as at
        build."""
        self.fast_graphs = manifest.extra.get("format") == "fast-graphs"
        """miaohui's fast encoder run as is in CUDA graphs (:mod:`miaohui.engines.fast_graphs`): nothing to compile."""
        try:
            self._runner: Any = None
            if self.fast_graphs:
                self._runner = self._load_fast_graphs()
            elif self.packaged:  # ahead-of-time compiled: nothing to trace or compile
                # single-threaded runner: its thread-synchronisation logic conflicts with CUDA-graph capture
                # (torch's docs); one owner thread per instance calls it anyway
                self._runner = load_package(path / AOTI_FILE, single_threaded=self.use_graphs)
                if fast_start:
                    log.info("%s: fast_start is moot for an AOTInductor package (nothing to compile)", manifest.name)
            elif fast_start and has_fast(path):  # the fast model's weights: no program load, no trace until upgrade()
                self._eager = FloatLogits(load_fast(path, self.device))
                self._runner = None
            else:
                module = self._load_program()
                self._compile(module)
                if fast_start:  # an artifact without eager.safetensors: the program itself, called directly
                    self._eager = module
        except Exception as exc:
            raise ArtifactError(
                f"cannot load inductor engine {path}: {exc}",
                "the files are corrupt or were built by another torch; rebuild it",
            ) from exc
        self.load_seconds = time.perf_counter() - started
        self.start_phases["load"] = self.load_seconds
        profile = manifest.inputs[0].profile
        max_b, max_s = profile.max if profile else (64, manifest.max_length or 128)
        self.min_b, self.min_s = profile.min if profile else (1, 1)
        self._first_calls = first_calls((self.min_b, self.min_s), profile.opt if profile else (1, 16), (max_b, max_s))
        self.batches, self.seqs = batch_buckets(max_b), seq_buckets(max_s)
        self.width = int(manifest.outputs[0].dims[-1])
        self._graphs: dict[tuple[int, int], _Bucket] = {}
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            # A blocking event: waiting for the batch sleeps instead of spinning a core (CUDA's default sync
            # spins). With ``--workers N`` every worker waits at once; spinning took cores from the host path.
            self._done = torch.cuda.Event(blocking=True)
            # where a batch's GPU time goes (``last_stages``): copies in, the graph, copies out
            self._marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            self._batches = 0  # batches run (every STAGE_SAMPLE_EVERY-th is timed)
        self.upgraded = threading.Event()
        """Set once batches run the compiled program (at once without ``fast_start``)."""
        if self._eager is None:
            self.upgraded.set()
        self._upgrader: threading.Thread | None = None
        self.upgrade_seconds = 0.0
        self.background_capture_seconds: float | None = None
        """``fast-graphs``: seconds the capture of the remaining buckets took after ready (None until done)."""
        if self._eager is None and not self.packaged:  # the program's first calls, as at build: all cache hits
            traced = time.perf_counter()
            try:
                self._trace(self.stream if self.device.type == "cuda" else None)
            except Exception as exc:  # the first line names it (Dynamo's full report stays on the chained cause)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise ArtifactError(
                    f"inductor engine {path} failed its first calls {self._first_calls}: {first}",
                    "rebuild it with this torch on this machine; on a GPU, check it has memory free",
                ) from exc
            self.start_phases["compile"] = time.perf_counter() - traced
            self.load_seconds = time.perf_counter() - started

    def _load_fast_graphs(self) -> Any:
        """The fast model from its weights with the build's kernel choice, and the build's Triton kernels put into
        this process's Triton cache (a fresh machine then compiles none)."""
        module = use_direct_ops(load_fast(self.path, self.device))  # nothing traces it: no op dispatch needed
        if self._kernels.get("mode") == "tuned":
            k = self._kernels
            use_kernels(module, skinny=bool(k.get("skinny_gemm_shapes")), attention=bool(k.get("attention_shapes")),
                        cublaslt=bool(k.get("cublaslt_shapes")))  # fmt: skip
        tar = self.path / TRITON_FILE
        if tar.is_file():
            restored = restore_triton_cache(tar)
            log.info("%s: Triton kernels from the artifact: %s", self.manifest.name, restored)
        built_with = self.manifest.extra.get("triton")
        if built_with and built_with != triton_version():
            log.warning(
                "%s was built with Triton %s, this machine has %s: its kernels compile again at the first calls "
                "(rebuild it here to keep the start short)", self.manifest.name, built_with, triton_version(),
            )  # fmt: skip
        return FloatLogits(module).eval()

    def _load_program(self) -> torch.nn.Module:
        """The exported program as a module, with Inductor's cache of its kernels loaded (so compiling it is all
        cache hits; Dynamo still traces it at its first call)."""
        if self._program_check is not None:
            self._program_check()
        torch.compiler.load_cache_artifacts((self.path / CACHE_FILE).read_bytes())
        module: torch.nn.Module = torch.export.load(str(self.path / self.manifest.engine_file)).module()
        return module

    def _compile(self, module: torch.nn.Module) -> None:
        """The program compiled with dynamic shapes (every bucket), and once more per static shape (static sizes
        in every kernel), each over a view of the same module: the weights are shared, Dynamo's caches are not."""
        autotune = bool(self.manifest.build_config.autotune)
        self._runner = compile_program(module, autotune, program_pdl(self._kernels, None))
        self._static = {
            shape: compile_program(
                static_view(module), autotune, program_pdl(self._kernels, shape[0] * shape[1]), dynamic=False
            )
            for shape in self.manifest.build_config.static_shapes
        }

    def _compiled_for(self, shape: tuple[int, ...]) -> Any:
        """The compiled program that runs inputs of exactly ``shape``: its static one, else the dynamic one."""
        return self._static.get(shape, self._runner)

    def warmed_up(self) -> None:
        """Warm-up is done: restart stage sampling; with ``fast_start``, compile in the background now."""
        self._batches = 0
        if self._upgrader is not None:
            return
        if not self.upgraded.is_set():
            self._upgrader = threading.Thread(target=self._upgrade_logged, name="inductor-upgrade", daemon=True)
        elif self.fast_graphs and self.use_graphs:
            self._upgrader = threading.Thread(target=self._capture_rest, name="inductor-capture", daemon=True)
        else:
            return
        self._upgrader.start()

    def compile_seconds(self) -> float | None:
        return self.upgrade_seconds if self.upgraded.is_set() else None

    def _active(self, shape: tuple[int, ...]) -> Any:
        return self._compiled_for(shape) if self.upgraded.is_set() else self._eager

    def upgrade(self) -> None:
        """``fast_start``'s second half: load the program if not yet loaded, compile it (Inductor cache hits; Dynamo
        traces it once per specialisation, outside the capture lock, so a bucket met while serving is not held up by
        it), then capture its graph of every bucket — the eager ones and those warm-up left out — on a stream of its
        own and swap each in while the serving stream keeps replaying; from then on every batch runs the compiled
        program. Idempotent."""
        if self.upgraded.is_set():
            return
        started = time.perf_counter()
        if self._runner is None:  # started from eager.safetensors: the program is loaded only now
            self._compile(self._load_program())
        stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        self._trace(stream)
        if stream is not None:
            for key in self.all_buckets():
                self._capture_compiled(key, stream)
        self.upgraded.set()
        if stream is not None:
            for key in list(self._graphs):  # a bucket first met while the above ran was captured eagerly
                self._capture_compiled(key, stream)
        self.upgrade_seconds = time.perf_counter() - started

    def _trace(self, stream: Any) -> None:
        """Run the compiled program at its :func:`~miaohui.engines.inductor.first_calls` (the build's: Dynamo's two
        graphs, batch 1 and larger, traced as at build, so Inductor's compile of each is a cache hit; runtime
        autotuning at the profile's opt shape) and each static program at its shape, before any capture."""
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        shapes = self._first_calls + list(self._static)
        with torch.no_grad(), ctx:
            for b, n in shapes:
                ids = torch.full((b, n), 5, dtype=torch.int64, device=self.device)
                self._compiled_for((b, n))(ids, torch.ones_like(ids))
        if stream is not None:
            stream.synchronize()

    def _capture_compiled(self, key: tuple[int, int], stream: Any) -> None:
        """Capture bucket ``key`` from the compiled program and swap it in, unless a compiled graph is there."""
        with _CAPTURE_LOCK:
            held = self._graphs.get(key)
            if held is None or not held.compiled:
                self._graphs[key] = self._capture_bucket(*key, self._compiled_for(key), stream, compiled=True)

    def _upgrade_logged(self) -> None:
        """The background upgrade, with the GIL's switch interval held short (:func:`miaohui.gil.short_switch_interval`)
        so the serving threads are not kept waiting by the compile. A server that froze its warm heap
        (:mod:`miaohui.gcpolicy`) freezes again after it: the compile leaves many long-lived objects that every full
        collection would otherwise walk."""
        from miaohui import gcpolicy, gil

        try:
            with gil.short_switch_interval():
                self.upgrade()
            log.info("%s: compiled graphs in place after %.1fs", self.manifest.name, self.upgrade_seconds)
        except Exception:  # the eager graphs keep serving
            log.exception("%s: compiling the program failed; the eager graphs keep serving", self.manifest.name)
            return
        gcpolicy.refreeze(f"{self.manifest.name} compiled")

    def _capture_rest(self) -> None:
        """A ``fast-graphs`` version after ready: capture every bucket warm-up left out, on a stream of its own (one
        capture at a time with the serving thread's first-use captures, :meth:`capture`), smallest first, while the
        serving stream keeps replaying. Nothing compiles here: the fast model runs as is."""
        started = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        try:
            for key in self.all_buckets():
                self._capture_compiled(key, stream)
        except Exception:  # a bucket not captured here is captured at its first use
            log.exception("%s: capturing the remaining CUDA graphs failed", self.manifest.name)
            return
        self.background_capture_seconds = time.perf_counter() - started
        log.info(
            "%s: every bucket's CUDA graph captured %.1fs after ready (%d graphs)",
            self.manifest.name, self.background_capture_seconds, len(self._graphs),
        )  # fmt: skip

    def bucket(self, b: int, s: int) -> tuple[int, int]:
        return (
            self.batches[bisect.bisect_left(self.batches, max(b, self.min_b))],
            self.seqs[bisect.bisect_left(self.seqs, max(s, self.min_s))],
        )

    def all_buckets(self) -> list[tuple[int, int]]:
        """Every (batch, sequence) bucket of the profile."""
        return [(b, s) for b in self.batches for s in self.seqs if b >= self.min_b and s >= self.min_s]

    def warmup_buckets(self) -> list[tuple[int, int]]:
        """Every bucket, so none is captured while serving — except before a ``fast_start`` upgrade: then only the
        model's warm-up shapes are captured (eagerly) before ready, and :meth:`upgrade` captures every bucket from
        the compiled program in the background (a bucket met before that is captured eagerly on first use); and
        for a ``fast-graphs`` version, where only the warm-up shapes are captured before ready and
        :meth:`_capture_rest` captures the rest after it (nothing compiles there, so a start is the weights' load
        and a few graphs: on the H200 the 77 graphs of a BERT-base classifier took 5.2 s of a 13 s start)."""
        if not self.use_graphs or not self.upgraded.is_set() or self.fast_graphs:
            return []
        return self.all_buckets()

    def capture(self, b: int, s: int) -> None:
        """Capture the CUDA graph of bucket (b, s) (idempotent).

        One capture at a time per process (``_CAPTURE_LOCK``), in ``thread_local`` mode: another instance's thread
        keeps replaying its graphs and waiting on its events meanwhile. In CUDA's default (``global``) mode those
        calls are forbidden during any capture and failed the other instance's batch (H200, two instances, a bucket
        captured while serving: ``operation not permitted when stream is capturing``)."""
        if (b, s) in self._graphs:
            return
        with _CAPTURE_LOCK:
            if (b, s) in self._graphs:  # captured by the upgrade while this thread waited for the lock
                return
            compiled = self.upgraded.is_set()
            runner = self._compiled_for((b, s)) if compiled else self._eager
            started = time.perf_counter()
            self._graphs[(b, s)] = self._capture_bucket(b, s, runner, self.stream, compiled)
            self.start_phases["capture"] = self.start_phases.get("capture", 0.0) + time.perf_counter() - started

    def _capture_bucket(self, b: int, s: int, runner: Any, stream: Any, compiled: bool) -> _Bucket:
        """Bucket (b, s)'s graph of ``runner`` captured on ``stream``; the caller holds ``_CAPTURE_LOCK``."""
        io = torch.ones((2, b, s), dtype=torch.int64, device=self.device)
        io[0].fill_(5)
        ids, mask = io[0], io[1]
        # ``io`` was written (and the weights uploaded) on the current stream: the capture stream must wait for
        # them. Without it the warm-up read whatever the block held before while the current stream was still
        # busy — token ids out of range, a device-side assert (e.g. right after an fp32 reference ran on the
        # default stream).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(1 if self.fast_graphs else 2):  # warm the kernels and the allocator outside the graph
                warm = runner(ids, mask)
            stream.synchronize()
            host_io = io.cpu().pin_memory()  # what a replay copies in until a batch writes it
            host_out = torch.empty(warm.shape, dtype=warm.dtype).pin_memory()
            if self.graph_copies:
                try:
                    graph, out = self._capture(runner, stream, ids, mask, (io, host_io, host_out))
                except RuntimeError as exc:  # a torch that cannot capture host copies: launch them apart
                    log.warning("cannot capture host copies in CUDA graphs (%s); copying around replays", exc)
                    self.graph_copies = False
            if not self.graph_copies:
                graph, out = self._capture(runner, stream, ids, mask, None)
        return _Bucket(graph, io, out, host_io, host_out, self.graph_copies, compiled)

    @staticmethod
    def _capture(
        runner: Any,
        stream: Any,
        ids: torch.Tensor,
        mask: torch.Tensor,
        copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One graph of the runner on (ids, mask), with ``copies`` = (io, host_io, host_out): ``host_io → io`` first
        and ``out → host_out`` last (pinned host buffers, kept alive by the bucket for the graph's life)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            if copies is not None:
                copies[0].copy_(copies[1], non_blocking=True)
            out = runner(ids, mask)
            if copies is not None:
                copies[2].copy_(out, non_blocking=True)
        return graph, out

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids_np, mask_np = feeds["input_ids"], feeds["attention_mask"]
        if self.device.type == "cpu":
            if ids_np.shape[1] == 1 and not self.packaged:  # a size-1 dim would be a new specialisation: pad to 2
                ids_np = np.pad(ids_np, ((0, 0), (0, 1)))
                mask_np = np.pad(mask_np, ((0, 0), (0, 1)))
            with torch.no_grad():
                out = self._active(ids_np.shape)(torch.from_numpy(ids_np), torch.from_numpy(mask_np))
            return {self.output_names[0]: out.numpy()}
        if not self.use_graphs:
            with torch.no_grad(), torch.cuda.stream(self.stream):
                out = self._active(ids_np.shape)(
                    torch.from_numpy(ids_np).to(self.device), torch.from_numpy(mask_np).to(self.device)
                )
                host = out.cpu()
            return {self.output_names[0]: host.numpy()}
        launched = self._launch(ids_np, mask_np)
        self._done.synchronize()
        return self._collect(*launched)

    async def _infer_polled_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch is launched (a graph replay) and the event loop polls its completion event between other
        callbacks: no executor thread and no GIL hand-back per batch (``ModelConfig.gpu_wait: poll``)."""
        if not self.use_graphs:
            return await super()._infer_polled_impl(feeds)
        launched = self._launch(feeds["input_ids"], feeds["attention_mask"])
        while not self._done.query():
            await asyncio.sleep(0)
        return self._collect(*launched)

    def _launch(self, ids_np: np.ndarray, mask_np: np.ndarray) -> tuple[_Bucket, int, bool]:
        """Stage a batch into its bucket's pinned buffer and enqueue copy in, replay, copy out and the done event
        on the engine's stream (capturing the bucket first if new); returns what :meth:`_collect` needs."""
        b, s = ids_np.shape
        bb, ss = self.bucket(b, s)
        self.capture(bb, ss)
        k = self._graphs[(bb, ss)]
        host = k.host_io.numpy()
        host.fill(0)
        host[1, :, 0] = 1  # padding rows attend to one token (no all-masked softmax); their outputs are dropped
        host[0, :b, :s] = ids_np
        host[1, :b, :s] = mask_np
        timed = self._batches % STAGE_SAMPLE_EVERY == 0
        self._batches += 1
        marks = self._marks
        with torch.no_grad(), torch.cuda.stream(self.stream):
            if timed:
                marks[0].record(self.stream)
            if not k.copies:
                k.io.copy_(k.host_io, non_blocking=True)
                if timed:
                    marks[1].record(self.stream)
            k.graph.replay()
            if not k.copies:
                if timed:
                    marks[2].record(self.stream)
                k.host_out.copy_(k.out, non_blocking=True)
            if timed:
                marks[3].record(self.stream)
            self._done.record(self.stream)
        return k, b, timed

    def _collect(self, k: _Bucket, b: int, timed: bool) -> dict[str, np.ndarray]:
        """A launched batch's outputs, once its done event has passed."""
        self.last_stages = self._stages(k.copies) if timed else {}
        return {self.output_names[0]: k.host_out.numpy()[:b].copy()}

    def _stages(self, copies: bool) -> dict[str, float]:
        """The timed batch's stages in seconds: ``h2d``, ``gpu``, ``d2h``; with the copies inside the graph, one
        ``gpu`` stage that includes them."""
        m = self._marks
        if copies:
            return {"gpu": m[0].elapsed_time(m[3]) / 1e3}
        return {stage: m[i].elapsed_time(m[i + 1]) / 1e3 for i, stage in enumerate(("h2d", "gpu", "d2h"))}

    def close(self) -> None:
        if self._upgrader is not None:
            self._upgrader.join(timeout=10)  # a compile cannot be interrupted; the thread is a daemon
        self._graphs.clear()
