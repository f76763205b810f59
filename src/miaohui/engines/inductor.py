"""``inductor`` backend: the PyTorch compiler as the GPU engine we can run on the H200.

Build: the model is rewritten as :mod:`miaohui.models.fast_bert` (fused QKV GEMM, SDPA), then
``torch.export`` with dynamic batch/sequence dims from the ``--shapes`` profile. Two artifact formats:

* **AOTInductor package** ``model.pt2`` (preferred): ``aoti_compile_and_package`` compiles the exported program
  ahead of time into a shared library + weights. Loading it runs no Python compiler at all (no Dynamo, no
  Inductor): the e5 intent engine (fp32, this CPU) is loaded and has answered two request shapes after 1.4 s,
  against 6.9 s for the exported-program format (``benchmarks/bench_cold_start.py``). Before it is accepted, the
  package is loaded and run in a **fresh child process** and its outputs compared with the exported program's: on
  one H200 image ``aoti_load_package`` segfaulted, and a crash must fail the probe, not the server
  that loads the artifact later.
* **exported program + Inductor cache** (fallback when the package does not build or fails its probe): the
  exported program ``program.pt2``, compiled by Inductor over the profile's buckets, the compiled kernels saved with
  ``torch.compiler.save_cache_artifacts`` → ``inductor-cache.bin``. Loading re-traces with Dynamo and every kernel
  is a cache hit (no recompilation), which costs seconds per traced graph. Next to them the fast model's weights
  and spec (``eager.safetensors``, ``eager.json``: :func:`~miaohui.models.fast_bert.save_fast`), which
  ``fast_start`` answers with at once while the program loads and compiles in the background.

The manifest says which (``engine_file``, ``extra["format"]``, and why the package was not used in
``extra["aoti"]``). Half precision is a cast of the graph; LayerNorm and SDPA accumulate in fp32 on CUDA, and the
logits leave the graph as fp32.

The loaded engine (CUDA graphs per bucket, fast start, polled batches) is :mod:`miaohui.engines.inductor_engine`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from miaohui.engines import fast_graphs
from miaohui.engines.context import BuildContext, BuiltEngine
from miaohui.engines.encoder_buckets import check_static_shapes
from miaohui.engines.onnxruntime_builder import io_specs
from miaohui.engines.target import cpu_target, cuda_target
from miaohui.errors import BuildError
from miaohui.models import tuning
from miaohui.models.fast_bert import FAST_WEIGHTS, from_module, save_fast, use_fused_gelu, use_kernels
from miaohui.models.fast_hf import Unsupported, fast_from_hf
from miaohui.sources.detect import load_source

log = logging.getLogger(__name__)

AOTI_FILE = "model.pt2"
"""The AOTInductor package (preferred format)."""
ENGINE_FILE = "program.pt2"
"""The exported program (fallback format, with ``CACHE_FILE``)."""
CACHE_FILE = "inductor-cache.bin"
PROBE_TIMEOUT_S = 600
"""Longest the child process that loads and runs a fresh AOTInductor package may take."""
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class FloatLogits(torch.nn.Module):
    """Wraps the model so the exported graph returns fp32 whatever its compute precision."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids, attention_mask).float()


def build(ctx: BuildContext) -> BuiltEngine:
    if ctx.model is None:
        raise BuildError("the inductor backend compiles a PyTorch model", "pass a model directory")
    rng = ctx.shapes["input_ids"]  # the static shapes are checked before any model work
    check_static_shapes(ctx.cfg.static_shapes, rng.min[1], rng.max[0], rng.max[1])
    if ctx.cfg.inductor_format == "aoti-package" and ctx.cfg.static_shapes:
        raise BuildError(
            "an AOTInductor package holds one program; static_shapes asks for one more per shape",
            "drop --static-shapes for a package, or use --inductor-format auto / exported-program",
        )
    target = cuda_target()
    device = "cuda" if target else "cpu"
    if device == "cpu" and ctx.cfg.precision == "fp16":
        raise BuildError("fp16 inductor engines need a CUDA GPU", "build on the GPU, or use fp32/bf16 on CPU")
    loaded = load_source(ctx.model.path, attn_implementation="sdpa")
    generic = loaded.meta.source_format != "miaohui"
    fast = True
    if generic:  # a team's HF model: miaohui's fast encoder with the model's own head, where it maps onto it
        try:
            module = fast_from_hf(loaded.module)
        except Unsupported as exc:  # torch.export of its own HF forward, library kernels
            module, fast = loaded.module, False
            kernels: dict[str, Any] = {"mode": "library", "reason": f"Hugging Face forward: {exc}"}
            ctx.log(f"compiling the model's own forward: {exc}")
    else:
        model_type = loaded.meta.bert_config.get("model_type", "bert")
        if model_type != "bert":  # FastBert copies BERT's weights by name: another architecture would compute wrongly
            raise BuildError(
                f"the inductor backend compiles BERT encoders; {ctx.model.path} holds a {model_type!r} encoder",
                "build this model with --backend onnxruntime (or torch)",
            )
        module = from_module(loaded.module)
    if fast:
        use_fused_gelu(module, device == "cuda")  # cuBLASLt's GEMM+bias+GELU epilogue (tanh GELU); CPU: erf GELU
        kernels = use_gpu_kernels(module, ctx.cfg.gpu_kernels if device == "cuda" else "library", ctx.cfg.precision)
    fmt = ctx.cfg.inductor_format
    if fmt == "fast-graphs" and not (fast and device == "cuda" and not ctx.cfg.static_shapes):
        why = "on a CUDA GPU" if device != "cuda" else "without --static-shapes" if fast else "for this model"
        raise BuildError(
            f"the fast-graphs format needs miaohui's fast encoder {why}",
            "build with --inductor-format auto or exported-program",
        )
    if kernels["mode"] == "tuned":
        ctx.log(f"miaohui's kernels where the tuning file measured them faster on this GPU: {kernels}")
    meta = ctx.model.meta
    width = len(meta.labels) if meta.kind == "intent" else int(meta.bert_config["hidden_size"])
    inputs, outputs = io_specs(ctx, "logits" if meta.kind == "intent" else "embeddings", ["batch", width])
    if fast and target is not None and fmt in ("auto", "fast-graphs") and not ctx.cfg.static_shapes:
        model = FloatLogits(module).to(device=device, dtype=DTYPES[ctx.cfg.precision]).eval()
        built = fast_graphs.build(ctx, model, rng.min, rng.max)
        return BuiltEngine(
            engine_file=FAST_WEIGHTS,
            backend_version=str(torch.__version__).split("+")[0],
            target=target,
            inputs=inputs,
            outputs=outputs,
            extra={"torch": torch.__version__, "cuda": torch.version.cuda, "ffn_gelu": "cublaslt-epilogue-tanh",
                   "gpu_kernels": kernels, "format": "fast-graphs", **built},
        )  # fmt: skip
    model = FloatLogits(module).to(device=device, dtype=DTYPES[ctx.cfg.precision]).eval()
    (batch, b), (seq, s) = (
        _export_dim(n, rng.min[i], rng.opt[i], rng.max[i]) for i, n in enumerate(("batch", "sequence"))
    )
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
        if fmt == "aoti-package" and kernels["mode"] == "tuned":
            raise BuildError(
                "an AOTInductor package cannot hold miaohui's tuned kernels (Python custom ops)",
                "build with --gpu-kernels library for a package, or --inductor-format auto / exported-program",
            )
        if fmt == "exported-program":
            aoti: dict[str, Any] = {"ok": False, "reason": "not tried (inductor_format exported-program)"}
        elif ctx.cfg.static_shapes:
            aoti = {"ok": False, "reason": "not tried (static_shapes: a program per static shape)"}
        elif kernels["mode"] == "tuned":
            aoti = {"ok": False, "reason": "not tried (gpu_kernels tuned: Python custom ops in the graph)"}
        else:
            aoti = build_aoti_package(ep, ctx.out_dir / AOTI_FILE, shapes, ctx.cfg.precision, ctx.cfg.autotune, ctx.log)
        if not aoti["ok"] and fmt == "aoti-package":
            raise BuildError(
                f"the AOTInductor package was not accepted: {aoti['reason']}",
                "build with --inductor-format auto (falls back to the exported program) or exported-program",
            )
        if not aoti["ok"]:
            ctx.log(f"AOTInductor package not used ({aoti['reason']}): saving the exported program + Inductor cache")
            _build_exported_program(ctx, ep, first_calls(rng.min, rng.opt, rng.max), device, kernels)
            if fast:
                save_fast(module, ctx.out_dir)  # what ``fast_start`` answers with while the program loads and compiles
    compile_s = time.perf_counter() - started - export_s
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
            "gpu_kernels": kernels,
            "static_shapes": [f"{b}x{s}" for b, s in ctx.cfg.static_shapes],
            "format": "aoti-package" if aoti["ok"] else "exported-program",
            "aoti": aoti,
        },
    )


def first_calls(lo: tuple[int, ...], opt: tuple[int, ...], hi: tuple[int, ...]) -> list[tuple[int, int]]:
    """The dynamic program's first calls, the same at build and at load: the build saves Inductor's compile of
    exactly these, and the engine makes them before any other, so a load is all cache hits.

    One call at batch 1 where the profile has it (Dynamo specialises size 1: a graph of its own), one at the opt
    batch (at least 2), both at the opt sequence (at least 2). Same sequence in both and the same calls at both
    ends, because Dynamo names the batch graph's sequence symbol after whether the sequence changed since the
    first call, and the name is part of Inductor's cache key: a load that ran 1×9 then 4×16 recompiled the graph a
    build had compiled after 1×16 then 4×16. At opt, too, Inductor's kernels take their size hints and its
    runtime autotuning picks each reduction's launch configuration (what TensorRT tunes for)."""
    s = min(max(2, opt[1], lo[1]), hi[1])
    calls = [(1, s)] if lo[0] == 1 else []
    if hi[0] > 1:
        calls.append((min(max(2, opt[0], lo[0]), hi[0]), s))
    return calls


@contextlib.contextmanager
def _private_inductor_cache() -> Iterator[None]:
    """Compile into an empty Inductor cache of the build's own: every graph is compiled there and so recorded in
    what ``save_cache_artifacts`` saves. Over the shared cache, a graph an earlier build of this process had
    compiled came back as a cache hit without its Inductor entry being recorded, and the artifact then made a fresh
    machine recompile it at load. Afterwards the private cache is merged into this machine's (its entries are
    content-addressed), so loads here still find the compiled kernels — on the CPU the saved cache carries the
    graphs but not their compiled C++, which a machine that did not build them compiles at its first load."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="miaohui-inductor-cache-") as private:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = private
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
        shutil.copytree(private, previous or default_cache_dir(), dirs_exist_ok=True)


def _build_exported_program(
    ctx: BuildContext, ep: Any, calls: list[tuple[int, int]], device: str, kernels: dict[str, Any]
) -> None:
    """The fallback format: the exported program + Inductor's compile cache of its :func:`first_calls` and of each
    static shape's own program (each with PDL or not as ``kernels``, what ``use_gpu_kernels`` recorded, says)."""
    torch.export.save(ep, str(ctx.out_dir / ENGINE_FILE))
    ctx.log(f"Inductor compile ({ctx.cfg.precision}, max-autotune {'on' if ctx.cfg.autotune else 'off'})")
    torch.compiler.reset()
    module = ep.module()
    fn = compile_program(module, ctx.cfg.autotune, program_pdl(kernels, None))
    runs = [(fn, shape) for shape in calls]
    for shape in ctx.cfg.static_shapes:
        pdl = program_pdl(kernels, shape[0] * shape[1])
        ctx.log(f"Inductor compile of the static program for {shape[0]}x{shape[1]}" + (" (PDL)" if pdl else ""))
        runs.append((compile_program(static_view(module), ctx.cfg.autotune, pdl, dynamic=False), shape))
    with _private_inductor_cache():
        for run, (wb, ws) in runs:
            ids = torch.randint(5, 1000, (wb, ws), device=device)
            run(ids, torch.ones_like(ids))
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


def compile_program(module: torch.nn.Module, autotune: bool, pdl: bool = False, dynamic: bool = True) -> Any:
    """The same compile call at build and at load, so the load is all cache hits. ``pdl``: Inductor's Triton
    kernels launched as programmatic dependents (``gpu_kernels tuned``; Hopper and newer). ``dynamic=False``: a
    program for one shape (``static_shapes``; give it a :func:`static_view`)."""
    mode = "max-autotune-no-cudagraphs" if autotune else None
    module.requires_grad_(False)
    if not pdl:
        return torch.compile(module, dynamic=dynamic, mode=mode)
    from torch._inductor import list_mode_options

    options = {**(list_mode_options(mode) if mode else {}), "triton.enable_pdl": True}
    return torch.compile(module, dynamic=dynamic, options=options)


def static_view(module: torch.nn.Module) -> torch.nn.Module:
    """A second module over the exported program's graph that shares its weights but not its code object:
    Dynamo keeps its compiled graphs (and their guards) per code object, so a static compile of the view cannot
    be answered by the dynamic program's graphs, nor the other way round."""
    if not isinstance(module, torch.fx.GraphModule):
        raise TypeError(f"static programs are compiled from an exported program's module, not {type(module)}")
    return torch.fx.GraphModule(module, module.graph)


def _export_dim(name: str, lo: int, opt: int, hi: int) -> tuple[Any, int]:
    """The profile's range of a dim as ``torch.export``'s and the example size to trace it at: a ``Dim`` and a size
    > 1 (so export does not specialise the dim to 1), or None (static) and that size where min equals max — a
    batch-1-only profile (``input_ids:1x1,1x64,1x128``) — as ``Dim`` refuses an empty range."""
    if lo == hi:
        return None, hi
    return torch.export.Dim(name, min=lo, max=hi), max(2, min(opt, hi))


def use_gpu_kernels(
    module: torch.nn.Module, choice: str, precision: str = "fp16", runtime: tuning.Runtime | None = None
) -> dict[str, Any]:
    """``gpu_kernels``: with ``tuned`` and a tuning file for this GPU (:mod:`miaohui.models.tuning`) that has entries
    for this model, switch FastBert's layers to miaohui's ops and load the entries; returns what the manifest
    records (the file's name and digest among it). ``runtime``: the GPU and library versions to match the file
    against (default: this process's)."""
    if choice != "tuned":
        return {"mode": "library"}
    from miaohui.models import kernel_tables  # imports Triton (~0.3 s): only when the kernels are asked for

    dims = kernel_tables.model_dims(module)
    if dims is None:
        return {"mode": "library"}
    selection = tuning.select(runtime if runtime is not None else tuning.Runtime.detect(), dims, precision)
    source = {"tuning_file": selection.file, "tuning_digest": selection.digest} if selection.file else {}
    if not selection.skinny and not selection.attention:
        return {"mode": "library", "reason": selection.reason or f"no tuned kernel for this model {dims}", **source}
    info = kernel_tables.apply(selection)
    use_kernels(module, skinny=bool(selection.skinny), attention=bool(selection.attention),
                cublaslt=bool(selection.cublaslt))  # fmt: skip
    if selection.reason:
        info["reason"] = selection.reason
    return {"mode": "tuned", "dims": list(dims), **source, **info}


def gpu_kernels_at_load(extra: dict[str, Any]) -> dict[str, Any]:
    """An artifact built with ``gpu_kernels tuned``: load this GPU's tuning entries into the ops before its program
    runs (a tuning file changed since the build: a warning, rebuild). Returns the manifest's record, from which
    :func:`program_pdl` compiles each program with PDL as the build did."""
    info: dict[str, Any] = extra.get("gpu_kernels") or {}
    if info.get("mode") != "tuned":
        return info
    from miaohui.models import kernel_tables  # imports Triton: not on the load path of other artifacts

    hidden, intermediate, heads = (int(v) for v in info["dims"])
    selection = tuning.select(tuning.Runtime.detect(), (hidden, intermediate, heads))
    kernel_tables.apply(selection)
    if selection.digest != info.get("tuning_digest"):
        log.warning(
            "this artifact was built with tuning file %s (sha256 %s), this machine has %s (%s): the ops run "
            "this machine's entries; rebuild the engine here to match",
            info.get("tuning_file"), str(info.get("tuning_digest"))[:12], selection.file,
            str(selection.digest)[:12],
        )  # fmt: skip
    return info


def program_pdl(kernels: dict[str, Any], rows: int | None) -> bool:
    """Whether a program is compiled with Inductor's PDL, by the manifest's ``gpu_kernels`` record (what
    ``kernel_tables.apply`` returned at build): the dynamic-shape one (``rows`` None) whenever PDL is on, a static one
    of ``rows`` rows only up to ``pdl_max_rows``."""
    if kernels.get("mode") != "tuned" or not kernels.get("pdl"):
        return False
    limit = kernels.get("pdl_max_rows")
    return rows is None or limit is None or rows <= int(limit)


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
