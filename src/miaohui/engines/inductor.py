"""``inductor`` backend: the PyTorch compiler as the GPU engine we can run on the H200.

Build: the model is rewritten as :mod:`miaohui.models.fast_bert` (fused QKV GEMM, SDPA), then
``torch.export`` with dynamic batch/sequence dims from the ``--shapes`` profile. Two artifact formats:

* **AOTInductor package** ``model.pt2`` (preferred): ``aoti_compile_and_package`` compiles the exported program
  ahead of time into a shared library + weights. Loading it runs no Python compiler at all (no Dynamo, no
  Inductor): the e5 intent engine (fp32, this CPU) is loaded and has answered two request shapes after 1.4 s,
  against 6.9 s for the exported-program format (``benchmarks/bench_cold_start.py``). Before it is accepted, the
  package is loaded and run in a **fresh child process** and its outputs compared with the exported program's: on
  the H200 image of session 2 ``aoti_load_package`` segfaulted, and a crash must fail the probe, not the server
  that loads the artifact later.
* **exported program + Inductor cache** (fallback when the package does not build or fails its probe): the
  exported program ``program.pt2``, compiled by Inductor over the profile's buckets, the compiled kernels saved with
  ``torch.compiler.save_cache_artifacts`` → ``inductor-cache.bin``. Loading re-traces with Dynamo and every kernel
  is a cache hit (no recompilation), which costs seconds per traced graph.

The manifest says which (``engine_file``, ``extra["format"]``, and why the package was not used in
``extra["aoti"]``). Half precision is a cast of the graph; LayerNorm and SDPA accumulate in fp32 on CUDA, and the
logits leave the graph as fp32.

Run: on CUDA every (batch, sequence) bucket gets one CUDA graph over static input buffers, captured on
first use (warm-up shapes are captured before ready), on this instance's own stream; inputs are staged
through pinned host memory and padded to the bucket.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miaohui.engines.base import Engine, Manifest
from miaohui.engines.context import BuildContext, BuiltEngine
from miaohui.engines.onnxruntime import io_specs
from miaohui.engines.target import cpu_target, cuda_target
from miaohui.errors import ArtifactError, BuildError
from miaohui.models.checkpoint import load_checkpoint
from miaohui.models.fast_bert import from_module, use_fused_gelu

AOTI_FILE = "model.pt2"
"""The AOTInductor package (preferred format)."""
ENGINE_FILE = "program.pt2"
"""The exported program (fallback format, with ``CACHE_FILE``)."""
CACHE_FILE = "inductor-cache.bin"
PROBE_TIMEOUT_S = 600
"""Longest the child process that loads and runs a fresh AOTInductor package may take."""
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
log = logging.getLogger(__name__)
_CAPTURE_LOCK = threading.Lock()
SEQ_BUCKETS = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class _Logits(torch.nn.Module):
    """Wraps the model so the exported graph returns fp32 whatever its compute precision."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids, attention_mask).float()


def build(ctx: BuildContext) -> BuiltEngine:
    if ctx.model is None:
        raise BuildError("the inductor backend compiles a PyTorch model", "pass a model directory")
    target = cuda_target()
    device = "cuda" if target else "cpu"
    if device == "cpu" and ctx.cfg.precision == "fp16":
        raise BuildError("fp16 inductor engines need a CUDA GPU", "build on the GPU, or use fp32/bf16 on CPU")
    module = from_module(load_checkpoint(ctx.model.path, attn_implementation="sdpa").module)
    use_fused_gelu(module, device == "cuda")  # cuBLASLt's GEMM+bias+GELU epilogue (tanh GELU); CPU keeps erf GELU
    model = _Logits(module).to(device=device, dtype=DTYPES[ctx.cfg.precision]).eval()
    rng = ctx.shapes["input_ids"]
    batch = torch.export.Dim("batch", min=rng.min[0], max=rng.max[0])
    seq = torch.export.Dim("sequence", min=rng.min[1], max=rng.max[1])
    # example sizes > 1 so export does not specialise the dynamic dims to 1
    b, s = max(2, min(rng.opt[0], rng.max[0])), max(2, min(rng.opt[1], rng.max[1]))
    ids = torch.randint(5, 1000, (b, s), device=device)
    mask = torch.ones_like(ids)
    ctx.log(f"torch.export with batch {rng.min[0]}..{rng.max[0]}, sequence {rng.min[1]}..{rng.max[1]}")
    started = time.perf_counter()
    shapes = sorted({(max(wb, rng.min[0]), max(ws, rng.min[1])) for wb, ws in
                     ((1, min(16, rng.max[1])), (b, s), (rng.max[0], rng.max[1]))})  # fmt: skip
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
        export_s = time.perf_counter() - started
        fmt = ctx.cfg.inductor_format
        if fmt == "exported-program":
            aoti: dict[str, Any] = {"ok": False, "reason": "not tried (inductor_format exported-program)"}
        else:
            aoti = build_aoti_package(ep, ctx.out_dir / AOTI_FILE, shapes, ctx.cfg.precision, ctx.cfg.autotune, ctx.log)
        if not aoti["ok"] and fmt == "aoti-package":
            raise BuildError(
                f"the AOTInductor package was not accepted: {aoti['reason']}",
                "build with --inductor-format auto (falls back to the exported program) or exported-program",
            )
        if not aoti["ok"]:
            ctx.log(f"AOTInductor package not used ({aoti['reason']}): saving the exported program + Inductor cache")
            _build_exported_program(ctx, ep, shapes, device)
    compile_s = time.perf_counter() - started - export_s
    meta = ctx.model.meta
    width = len(meta.labels) if meta.kind == "intent" else int(meta.bert_config["hidden_size"])
    inputs, outputs = io_specs(ctx, "logits" if meta.kind == "intent" else "embeddings", ["batch", width])
    return BuiltEngine(
        engine_file=AOTI_FILE if aoti["ok"] else ENGINE_FILE,
        backend_version=str(torch.__version__).split("+")[0],
        target=target or cpu_target(),
        inputs=inputs,
        outputs=outputs,
        extra={
            "export_seconds": round(export_s, 2),
            "compile_seconds": round(compile_s, 2),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "autotune": ctx.cfg.autotune,
            "ffn_gelu": "cublaslt-epilogue-tanh" if device == "cuda" else "erf",
            "format": "aoti-package" if aoti["ok"] else "exported-program",
            "aoti": aoti,
        },
    )


def _build_exported_program(ctx: BuildContext, ep: Any, shapes: list[tuple[int, int]], device: str) -> None:
    """The fallback format: the exported program + Inductor's compile cache of the profile's shapes."""
    torch.export.save(ep, str(ctx.out_dir / ENGINE_FILE))
    ctx.log(f"Inductor compile ({ctx.cfg.precision}, max-autotune {'on' if ctx.cfg.autotune else 'off'})")
    torch.compiler.reset()
    fn = compile_program(ep.module(), ctx.cfg.autotune)
    for wb, ws in shapes:
        fn(torch.randint(5, 1000, (wb, ws), device=device), torch.ones((wb, ws), dtype=torch.int64, device=device))
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise BuildError("Inductor produced no compile cache to save", "report the torch version; rebuild")
    (ctx.out_dir / CACHE_FILE).write_bytes(saved[0])


_PROBE = """
import sys, torch
from pathlib import Path
from miaohui.engines.inductor import load_package
package, feeds_file, out_file, device = sys.argv[1:5]
runner = load_package(Path(package), single_threaded=device.startswith("cuda"))  # as InductorEngine loads it
with torch.no_grad():
    outs = [runner(ids.to(device), mask.to(device)).float().cpu() for ids, mask in torch.load(feeds_file)]
torch.save(outs, out_file)
"""


def build_aoti_package(
    ep: Any,
    package: Path,
    shapes: list[tuple[int, int]],
    precision: str,
    autotune: bool,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Compile ``ep`` into an AOTInductor package and accept it only if a fresh process loads it and gives the
    exported program's outputs at ``shapes``. Returns ``{"ok": bool, "reason": str | None, ...seconds}``; a package
    that is not accepted is deleted (the caller then builds the fallback format)."""
    from torch._inductor import aoti_compile_and_package

    log(f"AOTInductor compile ({precision}, max-autotune {'on' if autotune else 'off'})")
    started = time.perf_counter()
    try:
        aoti_compile_and_package(ep, package_path=str(package), inductor_configs={"max_autotune": autotune})
    except Exception as exc:
        package.unlink(missing_ok=True)
        return {"ok": False, "reason": f"compile failed: {exc!r}"[:500]}
    compiled_s = time.perf_counter() - started
    reason = probe_aoti_package(ep, package, shapes, precision)
    if reason is not None:
        package.unlink(missing_ok=True)
    return {
        "ok": reason is None,
        "reason": reason,
        "compile_seconds": round(compiled_s, 2),
        "probe_seconds": round(time.perf_counter() - started - compiled_s, 2),
    }


def probe_aoti_package(ep: Any, package: Path, shapes: list[tuple[int, int]], precision: str) -> str | None:
    """Load and run ``package`` in a child process at ``shapes``; None if its outputs match the exported
    program's, else why not (a crash, a timeout, an error, or the relative error)."""
    module = ep.module()
    device = str(next(iter(module.parameters())).device)
    gen = torch.Generator().manual_seed(0)
    feeds = []
    for b, s in shapes:
        ids = torch.randint(5, 1000, (b, s), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, max(1, s // 2) :] = 0  # one padded row: the mask must reach the kernels
        feeds.append((ids, mask))
    with tempfile.TemporaryDirectory(prefix="miaohui-aoti-probe-") as tmp:
        feeds_file, out_file = Path(tmp) / "feeds.pt", Path(tmp) / "out.pt"
        torch.save(feeds, feeds_file)
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _PROBE, str(package), str(feeds_file), str(out_file), device],
                capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env={**os.environ},
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"loading and running the package took over {PROBE_TIMEOUT_S}s in a child process"
        if proc.returncode != 0:
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"status {proc.returncode}"
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            return f"a child process loading the package ended with {how}: {tail[0][:300]}"
        outs = torch.load(out_file)
    tol = 1e-3 if precision == "fp32" else 3e-2
    with torch.no_grad():
        for (ids, mask), got in zip(feeds, outs, strict=True):
            want = module(ids.to(device), mask.to(device)).float().cpu()
            rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
            if not rel <= tol:
                return f"outputs differ from the exported program at {tuple(ids.shape)}: relative error {rel:.2e}"
    return None


def compile_program(module: torch.nn.Module, autotune: bool) -> Any:
    """The same compile call at build and at load, so the load is all cache hits."""
    mode = "max-autotune-no-cudagraphs" if autotune else None
    module.requires_grad_(False)
    return torch.compile(module, dynamic=True, mode=mode)


def load_package(package: Path, single_threaded: bool) -> Any:
    """The AOTInductor package's runner: ``runner(input_ids, attention_mask) -> logits``.

    torch's ``aoti_load_package`` wraps a C++ loader in Python code whose imports pull in the whole compiler
    stack (Dynamo: ~1 s on this CPU, more on the GPU host). Our graphs take two tensors and return one, so the C++
    loader is called directly (e5 fp32 on this CPU: 0.6 s instead of 2.1 s); torch's wrapper is the fallback where
    that private constructor differs."""
    loader_cls = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    try:
        loader = loader_cls(str(package), "model", single_threaded, 1, -1)  # type: ignore[misc]
    except TypeError:
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(package), run_single_threaded=single_threaded)

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = loader.boxed_run([input_ids, attention_mask])[0]
        return out

    return run


def batch_buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def seq_buckets(max_seq: int) -> list[int]:
    return [s for s in SEQ_BUCKETS if s < max_seq] + [max_seq]


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


class InductorEngine(Engine):
    """A loaded inductor artifact (either format); CUDA-graph replay per (batch, sequence) bucket on GPUs."""

    def __init__(
        self,
        manifest: Manifest,
        path: Path,
        use_cuda_graphs: bool = True,
        graph_copies: bool = False,
        fast_start: bool = False,
    ) -> None:
        super().__init__(manifest, path)
        self.device = torch.device("cuda" if manifest.target.device == "cuda" else "cpu")
        self.packaged = manifest.engine_file == AOTI_FILE
        self.use_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.polls = self.use_graphs  # infer_polled launches a replay and polls its done event
        self.graph_copies = graph_copies
        """Capture the input copy (pinned host → device) and the output copy (device → pinned host) inside each
        bucket's graph: a batch is then one replay and one wait instead of copy, replay, copy, wait — each of them
        a call that lets go of the GIL and must take it back while an event loop may hold it (session 13: ~0.3 ms of
        host gaps around a 0.03 ms input copy). Falls back to copies outside the graph where this torch cannot
        capture them. Off by default (``ModelConfig.graph_copies``) until measured on the H200."""
        self._eager: Any = None
        """``fast_start``: the exported program run as is (no Dynamo, no Inductor) until :meth:`upgrade` is done."""
        started = time.perf_counter()
        try:
            if self.packaged:  # ahead-of-time compiled: nothing to trace or compile
                # single-threaded runner: its thread-synchronisation logic conflicts with CUDA-graph capture
                # (torch's docs); one owner thread per instance calls it anyway
                self._runner: Any = load_package(path / AOTI_FILE, single_threaded=self.use_graphs)
            else:
                torch.compiler.load_cache_artifacts((path / CACHE_FILE).read_bytes())
                module = torch.export.load(str(path / manifest.engine_file)).module()
                self._runner = compile_program(module, bool(manifest.build_config.autotune))
                if fast_start:  # the same module, called directly: no second copy of the weights
                    self._eager = module
        except Exception as exc:
            raise ArtifactError(
                f"cannot load inductor engine {path}: {exc}",
                "the files are corrupt or were built by another torch; rebuild it",
            ) from exc
        self.load_seconds = time.perf_counter() - started
        profile = manifest.inputs[0].profile
        max_b, max_s = profile.max if profile else (64, manifest.max_length or 128)
        self.min_s = profile.min[1] if profile else 1
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

    def warmed_up(self) -> None:
        """Warm-up is done: restart stage sampling; with ``fast_start``, compile in the background now."""
        self._batches = 0
        if not self.upgraded.is_set() and self._upgrader is None:
            self._upgrader = threading.Thread(target=self._upgrade_logged, name="inductor-upgrade", daemon=True)
            self._upgrader.start()

    def _active(self) -> Any:
        return self._runner if self.upgraded.is_set() else self._eager

    def upgrade(self) -> None:
        """``fast_start``'s second half: compile the program (Inductor cache hits; Dynamo traces it once) and put
        graphs captured from it in place of the eager ones, bucket by bucket on a stream of its own, while the
        eager graphs keep serving; from then on every batch runs the compiled program. Idempotent."""
        if self.upgraded.is_set():
            return
        started = time.perf_counter()
        dev = self.device
        if self.use_graphs:
            stream = torch.cuda.Stream(dev)
            for key in list(self._graphs):
                self._graphs[key] = self._capture_bucket(*key, self._runner, stream, compiled=True)
        else:
            with torch.no_grad():  # Dynamo specialises size 1: trace batch 1 and the dynamic graph
                for b, s in ((1, 4), (3, 5)):
                    ids = torch.full((b, s), 5, dtype=torch.int64, device=dev)
                    self._runner(ids, torch.ones_like(ids))
        self.upgraded.set()
        if self.use_graphs:  # a bucket first met while this ran was captured eagerly: redo it
            stream = torch.cuda.Stream(dev)
            for key, k in list(self._graphs.items()):
                if not k.compiled:
                    self._graphs[key] = self._capture_bucket(*key, self._runner, stream, compiled=True)
        self.upgrade_seconds = time.perf_counter() - started

    def _upgrade_logged(self) -> None:
        try:
            self.upgrade()
            log.info("%s: compiled graphs in place after %.1fs", self.manifest.name, self.upgrade_seconds)
        except Exception:  # the eager graphs keep serving
            log.exception("%s: compiling the program failed; the eager graphs keep serving", self.manifest.name)

    def bucket(self, b: int, s: int) -> tuple[int, int]:
        return (
            self.batches[bisect.bisect_left(self.batches, b)],
            self.seqs[bisect.bisect_left(self.seqs, max(s, self.min_s))],
        )

    def warmup_buckets(self) -> list[tuple[int, int]]:
        if not self.use_graphs:
            return []
        return [(b, s) for b in self.batches for s in self.seqs if s >= self.min_s]

    def capture(self, b: int, s: int) -> None:
        """Capture the CUDA graph of bucket (b, s) (idempotent).

        One capture at a time per process (``_CAPTURE_LOCK``), in ``thread_local`` mode: another instance's thread
        keeps replaying its graphs and waiting on its events meanwhile. In CUDA's default (``global``) mode those
        calls are forbidden during any capture and failed the other instance's batch (H200, two instances, a bucket
        captured while serving: ``operation not permitted when stream is capturing``)."""
        if (b, s) in self._graphs:
            return
        self._graphs[(b, s)] = self._capture_bucket(b, s, self._active(), self.stream, self.upgraded.is_set())

    def _capture_bucket(self, b: int, s: int, runner: Any, stream: Any, compiled: bool) -> _Bucket:
        with _CAPTURE_LOCK:
            io = torch.ones((2, b, s), dtype=torch.int64, device=self.device)
            io[0].fill_(5)
            ids, mask = io[0], io[1]
            with torch.no_grad(), torch.cuda.stream(stream):
                for _ in range(2):  # warm the kernels and the allocator outside the graph
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
                out = self._active()(torch.from_numpy(ids_np), torch.from_numpy(mask_np))
            return {self.output_names[0]: out.numpy()}
        if not self.use_graphs:
            with torch.no_grad(), torch.cuda.stream(self.stream):
                out = self._active()(
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
            return self._infer_impl(feeds)
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
            self._upgrader.join(timeout=60)
        self._graphs.clear()
