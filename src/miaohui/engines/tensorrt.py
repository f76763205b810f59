"""TensorRT and TensorRT-RTX: one builder/runtime code path for both libraries.

``tensorrt`` (full TensorRT 10+) and ``tensorrt_rtx`` (TensorRT for RTX) share the Python API used here:
``Builder`` / ``OnnxParser`` / ``IBuilderConfig`` / ``IOptimizationProfile`` / ``Runtime`` /
``IExecutionContext.execute_async_v3``. The code branches on the flavor in few, marked places:

* :func:`trt_module` — the module name (``tensorrt`` vs ``tensorrt_rtx``) and install hint.
* :func:`_resolve_target` — TensorRT-RTX builds ahead of time on CPU for a chosen compute capability
  (``IBuilderConfig.set_compute_capability``, an RTX-only API); full TensorRT has no such API and builds
  for the GPU it runs on, so it needs that GPU at build time.
* :func:`_check_header` / :func:`inspect_engine` — the RTX plan header (magic ``vtrt``) is decoded on CPU;
  full TensorRT plans are only size-checked.
* ``Runtime.get_engine_validity`` (RTX-only) is used when present (feature-detected, not flavor-checked).

Precision is a property of the graph (ARCHITECTURE.md): networks are always created STRONGLY_TYPED —
TensorRT-RTX only has strongly typed networks, and TensorRT 11 removed the FP16/BF16/INT8 builder flags —
so fp16 comes from casting the ONNX graph (done here when the graph is still fp32), bf16 from a graph that
is already cast, and int8 from explicit QuantizeLinear/DequantizeLinear nodes.

``tensorrt`` / ``tensorrt_rtx`` / ``torch`` / ``rich`` are imported lazily, never at module import time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from miaohui.config import BuildConfig, InputRange
from miaohui.engines.base import Engine, Manifest
from miaohui.engines.target import cuda_target
from miaohui.errors import (
    ArtifactError,
    BackendUnavailableError,
    BuildError,
    ConfigError,
    ShapeError,
    UnsupportedOperatorError,
)

if TYPE_CHECKING:
    import onnx

Flavor = Literal["tensorrt", "tensorrt-rtx"]

_MODULES: dict[str, str] = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}
_NAMES: dict[str, str] = {"tensorrt": "TensorRT", "tensorrt-rtx": "TensorRT-RTX"}
_INSTALL: dict[str, str] = {
    "tensorrt-rtx": "install it with `pip install tensorrt-rtx-cu13` (tensorrt-rtx-cu12 for CUDA 12)",
    "tensorrt": "full TensorRT 10+ is not on this project's package index; install NVIDIA TensorRT on a GPU "
    "machine (`pip install tensorrt` from pypi.nvidia.com, or the NVIDIA tarball), or use "
    "--backend tensorrt-rtx, which is installed here and builds ahead of time on CPU",
}
_DTYPES: dict[str, str] = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "UINT8": "uint8",
    "FP8": "float8",
    "INT4": "int4",
    "FP4": "float4",
}
# Ops kept in fp32 when miaohui casts a graph to fp16: normalizations accumulate over the hidden size.
_FP32_OPS = (
    "LayerNormalization",
    "SimplifiedLayerNormalization",
    "RMSNormalization",
    "SkipLayerNormalization",
)
_RTX_MAGIC = b"vtrt"
# TensorRT-RTX plan header: magic, plan bytes, version major/minor/patch/build, magic again, cc bitmask.
_RTX_HEADER = struct.Struct("<4s12xQBBBB4sQ")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- module


def trt_module(flavor: Flavor) -> Any:
    """Import and return ``tensorrt`` or ``tensorrt_rtx``; :class:`BackendUnavailableError` if missing."""
    if flavor not in _MODULES:
        raise ConfigError(f"unknown TensorRT flavor {flavor!r}", "use 'tensorrt' or 'tensorrt-rtx'")
    try:
        trt = importlib.import_module(_MODULES[flavor])
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend {flavor} needs the Python module {_MODULES[flavor]!r}, which is not importable ({exc})",
            _INSTALL[flavor],
        ) from None
    # Branch: full TensorRT must be 10+ (strongly typed networks, execute_async_v3, IProgressMonitor).
    if flavor == "tensorrt" and int(str(trt.__version__).split(".")[0]) < 10:
        raise BackendUnavailableError(f"TensorRT {trt.__version__} is too old for miaohui", "install TensorRT 10+")
    return trt


def backend_version(flavor: Flavor) -> str:
    """Version string of the installed library, e.g. ``1.7.1.116`` for TensorRT-RTX."""
    return str(trt_module(flavor).__version__)


class _Log:
    """Collects TensorRT log messages so errors can be quoted in miaohui's exceptions."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def begin(self) -> None:
        self.errors.clear()

    def tail(self, n: int = 6) -> str:
        return " | ".join(m.strip() for m in self.errors[-n:]) or "no error message from the library"


_LOGGERS: dict[str, Any] = {}
_LOGGER_LOCK = threading.Lock()


def _logger(trt: Any) -> Any:
    """One logger per module for the whole process (TensorRT keeps the first logger it is given)."""
    with _LOGGER_LOCK:
        if trt.__name__ not in _LOGGERS:

            class _Collector(trt.ILogger):
                def __init__(self) -> None:
                    trt.ILogger.__init__(self)
                    self.sink = _Log()

                def log(self, severity: Any, msg: str) -> None:
                    if int(severity) <= int(trt.ILogger.Severity.ERROR):
                        self.sink.errors.append(msg)
                    log.debug("%s [%s] %s", trt.__name__, severity, msg)

            _LOGGERS[trt.__name__] = _Collector()
        return _LOGGERS[trt.__name__]


# ---------------------------------------------------------------------------------------------- ONNX


def _require_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise BuildError(f"{what} {path} does not exist", "export the model to ONNX first (miaohui export)")


def _load_graph(onnx_path: Path) -> onnx.ModelProto:
    """Load the ONNX graph structure without external weights (cheap; for names, dims and op types)."""
    import onnx

    try:
        return onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # protobuf/onnx raise several types
        raise BuildError(f"cannot read ONNX file {onnx_path}: {exc}", "re-export the model (miaohui export)") from None


def _op_label(node: Any) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}:{node.op_type}"


def _node_label(node: Any, index: int) -> str:
    return node.name or f"<unnamed {node.op_type} #{index}>"


def _input_dims(model: onnx.ModelProto) -> dict[str, list[str | int]]:
    """ONNX graph inputs (initializers excluded) → dims; dynamic dims are their names (or ``?``)."""
    inits = {t.name for t in model.graph.initializer}
    dims: dict[str, list[str | int]] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = vi.type.tensor_type.shape.dim
        dims[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in shape]
    return dims


def _float_types(model: onnx.ModelProto) -> set[str]:
    """Float element types present in the graph's weights, I/O, value infos and Cast targets."""
    import onnx

    types = {int(t.data_type) for t in model.graph.initializer}
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        types.add(int(vi.type.tensor_type.elem_type))
    for node in model.graph.node:
        types.update(int(a.i) for a in node.attribute if node.op_type == "Cast" and a.name == "to")
        types.update(int(a.t.data_type) for a in node.attribute if a.type == onnx.AttributeProto.TENSOR)
    tp = onnx.TensorProto
    names = {int(tp.FLOAT): "fp32", int(tp.FLOAT16): "fp16", int(tp.BFLOAT16): "bf16"}
    return {names[t] for t in types if t in names}


def _network_flags(trt: Any) -> int:
    """Strongly typed for both flavors (RTX has nothing else; TensorRT 11 dropped weak typing's flags)."""
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def unsupported_nodes(onnx_path: Path, flavor: Flavor) -> list[tuple[str, str]]:
    """(node name, op type) of the nodes the flavor's ONNX parser cannot import, found before building.

    Uses ``supports_model_v2`` (TensorRT >= 10.1 and TensorRT-RTX; ``supports_model`` before). The culprits
    are the nodes the parser reports errors for plus the nodes outside every subgraph it could partition.
    Runs on CPU. Custom-domain ops appear as ``domain:OpType``.
    """
    trt = trt_module(flavor)
    onnx_path = Path(onnx_path)
    _require_file(onnx_path, "ONNX file")
    nodes = list(_load_graph(onnx_path).graph.node)
    logger = _logger(trt)
    builder = trt.Builder(logger)  # builder and network must outlive the parser (else: segfault)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    data = onnx_path.read_bytes()
    if hasattr(parser, "supports_model_v2"):
        ok = parser.supports_model_v2(data, str(onnx_path))
        subgraphs = [
            (list(parser.get_subgraph_nodes(i)), bool(parser.is_subgraph_supported(i)))
            for i in range(parser.num_subgraphs)
        ]
    else:  # TensorRT 10.0: the deprecated form returns the same partition directly
        ok, subgraphs = parser.supports_model(data, str(onnx_path))
    if ok:
        return []
    flagged = {int(parser.get_error(i).node()) for i in range(parser.num_errors)} - {-1}
    covered = {int(n) for sg, _ in subgraphs for n in sg}
    flagged |= set(range(len(nodes))) - covered
    if not flagged:
        flagged = {int(n) for sg, supported in subgraphs if not supported for n in sg}
    return [(_node_label(nodes[i], i), _op_label(nodes[i])) for i in sorted(flagged) if 0 <= i < len(nodes)]


# ---------------------------------------------------------------------------------------------- targets


def _local_gpu() -> tuple[str, str] | None:
    """(compute capability ``smXY``, name) of the current CUDA GPU, or None where there is none."""
    gpu = cuda_target()
    return (gpu.compute_capability or "", gpu.gpu_name or "") if gpu else None


def rtx_targets(trt: Any) -> dict[str, Any]:
    """TensorRT-RTX's buildable compute capabilities (``sm75`` …) → ``ComputeCapability`` member."""
    members = trt.ComputeCapability.__members__
    return {f"sm{name[2:].lower()}": m for name, m in members.items() if name.startswith("SM")}


def _resolve_target(trt: Any, flavor: Flavor, target: str | None) -> tuple[str, str | None, Any]:
    """Pick the build target: (``smXY``, GPU name or None, RTX ``ComputeCapability`` or None).

    Branch: TensorRT-RTX selects the compute capability through the builder config (ahead of time, no GPU
    needed); full TensorRT tunes kernels on the GPU it runs on, so the target must be this machine's GPU.
    """
    gpu = _local_gpu()
    if flavor == "tensorrt-rtx":
        supported = rtx_targets(trt)
        want = target or (gpu[0] if gpu else None)
        if want is None:
            raise ConfigError(
                "no --target given and no GPU here to build for",
                f"pass --target, one of {', '.join(supported)} (sm86: A10/RTX 30xx, sm89: L4/RTX 40xx, "
                "sm80: A100, sm120: RTX 50xx); TensorRT-RTX builds ahead of time on CPU",
            )
        if want not in supported:
            where = "" if target else " (this machine's GPU)"
            raise ConfigError(
                f"TensorRT-RTX {trt.__version__} cannot build for {want}{where}; it targets only "
                f"{', '.join(supported)}",
                f"choose --target among {', '.join(supported)}; for sm90 (H100/H200) use --backend tensorrt "
                "(full TensorRT) or --backend inductor",
            )
        return want, (gpu[1] if gpu and gpu[0] == want else None), supported[want]
    if gpu is None:
        raise BackendUnavailableError(
            "full TensorRT builds engines on the GPU they will run on, and no CUDA GPU was found here",
            "build on a machine with the target GPU, or use --backend tensorrt-rtx (builds on CPU)",
        )
    if target is not None and target != gpu[0]:
        raise ConfigError(
            f"--target {target} with full TensorRT on a {gpu[0]} GPU ({gpu[1]})",
            f"build on an {target} machine, drop --target, or use --backend tensorrt-rtx (ahead of time)",
        )
    return gpu[0], gpu[1], None


# ---------------------------------------------------------------------------------------------- build


def _prepare_graph(onnx_path: Path, model: onnx.ModelProto, precision: str, workdir: Path) -> tuple[Path, str]:
    """Check/convert the graph for ``precision``; returns (ONNX to parse, how precision was obtained)."""
    floats = _float_types(model)
    if precision == "int8":
        if not any(n.op_type == "QuantizeLinear" for n in model.graph.node):
            raise BuildError(
                f"precision int8 but {onnx_path.name} has no QuantizeLinear nodes",
                "run the QDQ int8 calibration first and build the calibrated (QDQ) ONNX; TensorRT takes "
                "int8 only from explicit QuantizeLinear/DequantizeLinear nodes (no implicit calibrator)",
            )
        return onnx_path, "graph (explicit QDQ)"
    if precision == "bf16" and "bf16" not in floats:
        raise BuildError(
            f"precision bf16 but {onnx_path.name} has no bf16 tensors",
            "cast the ONNX graph to bf16 first (keep normalizations in fp32), or use --precision fp16, "
            "which miaohui casts automatically; networks are strongly typed, so the graph decides",
        )
    if precision == "fp16" and "fp16" not in floats:
        return _cast_fp16(onnx_path, workdir), "graph cast to fp16 by miaohui (normalizations kept fp32)"
    return onnx_path, "graph"


def _cast_fp16(onnx_path: Path, workdir: Path) -> Path:
    """fp32 → fp16 graph (I/O types kept, normalization ops kept fp32) with ONNX Runtime's converter."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    model = onnx.load(str(onnx_path))
    cast = convert_float_to_float16(model, keep_io_types=True, op_block_list=[*DEFAULT_OP_BLOCK_LIST, *_FP32_OPS])
    out = workdir / f"{onnx_path.stem}.fp16.onnx"
    onnx.save(cast, str(out), save_as_external_data=True, location=f"{out.name}.data", size_threshold=1024)
    return out


def _parse(trt: Any, source: Path, flavor: Flavor, shown: Path) -> tuple[Any, Any, Any]:
    """Parse ONNX (external data resolved next to ``source``) into a strongly typed network."""
    logger = _logger(trt)
    logger.sink.begin()
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if parser.parse_from_file(str(source)):
        return builder, network, parser
    errors = [parser.get_error(i) for i in range(parser.num_errors)]
    text = "; ".join(f"node {e.node_name() or e.node()} ({e.node_operator()}): {e.desc()}" for e in errors)
    bad = unsupported_nodes(source, flavor)
    if bad:
        listed = ", ".join(f"{name} ({op})" for name, op in bad[:10]) + (" …" if len(bad) > 10 else "")
        raise UnsupportedOperatorError(
            f"{_NAMES[flavor]} cannot import {len(bad)} node(s) of {shown.name}: {listed} [{text[:300]}]",
            "replace those ops in the model (or export with a different opset), register a TensorRT "
            "plugin for custom ops, or build with --backend onnxruntime / inductor",
        )
    raise BuildError(
        f"{_NAMES[flavor]} could not parse {shown.name}: {text or logger.sink.tail()}",
        "check the ONNX export (opset 17+, onnx.checker) and re-export",
    )


def _resolve_profile(
    network_dims: dict[str, tuple[int, ...]],
    onnx_dims: dict[str, list[str | int]],
    shapes: dict[str, InputRange],
) -> dict[str, InputRange]:
    """One min/opt/max per dynamic input: given in ``shapes``, or inherited through shared named axes."""
    unknown = sorted(set(shapes) - set(network_dims))
    if unknown:
        raise ConfigError(
            f"--shapes names {unknown}, not inputs of the model",
            f"the model's inputs are {sorted(network_dims)}",
        )
    axes: dict[str, tuple[int, int, int]] = {}
    for name, rng in shapes.items():
        _check_range(name, rng, network_dims[name])
        for axis, lo, mid, hi in zip(onnx_dims.get(name, []), rng.min, rng.opt, rng.max, strict=False):
            if isinstance(axis, str) and axis != "?":
                axes.setdefault(axis, (lo, mid, hi))
    profile = dict(shapes)
    for name, dims in network_dims.items():
        if name in profile or all(d >= 0 for d in dims):
            continue
        names = onnx_dims.get(name, ["?"] * len(dims))
        triples = [
            (d, d, d) if d >= 0 else axes.get(str(names[i]) if i < len(names) else "?") for i, d in enumerate(dims)
        ]
        if any(t is None for t in triples):
            raise ConfigError(
                f"input {name!r} has dynamic dimensions {names} but the shape profile gives no range for it",
                f"add it to --shapes, e.g. {name}:1x1,8x64,32x128 (min,opt,max per dimension)",
            )
        rows = list(zip(*[t for t in triples if t is not None], strict=True))
        profile[name] = InputRange(min=tuple(rows[0]), opt=tuple(rows[1]), max=tuple(rows[2]))
    return profile


def _check_range(name: str, rng: InputRange, dims: tuple[int, ...]) -> None:
    """Rank, order and fixed dims of one profile entry against the network input."""
    if len(rng.min) != len(dims):
        raise ConfigError(
            f"shape profile for {name!r} has rank {len(rng.min)}, the input has rank {len(dims)}",
            f"give {len(dims)} dimensions per shape for {name!r}",
        )
    for i, (d, lo, mid, hi) in enumerate(zip(dims, rng.min, rng.opt, rng.max, strict=True)):
        if not 1 <= lo <= mid <= hi:
            raise ConfigError(
                f"shape profile for {name!r} is not ordered at dim {i}: {rng}",
                "each dimension must satisfy 1 <= min <= opt <= max",
            )
        if d >= 0 and not lo == mid == hi == d:
            raise ConfigError(
                f"input {name!r} dimension {i} is fixed at {d}, the profile says {lo}..{hi}",
                f"use {d} for dimension {i} in min, opt and max",
            )


def _builder_config(trt: Any, builder: Any, cfg: BuildConfig, cc: Any, profile: dict[str, InputRange]) -> Any:
    """Builder config: optimization level, RTX target compute capability, the one optimization profile."""
    config = builder.create_builder_config()
    config.builder_optimization_level = cfg.opt_level
    if cc is not None:  # TensorRT-RTX only (see _resolve_target)
        config.num_compute_capabilities = 1
        if not config.set_compute_capability(cc, 0):
            raise BuildError(f"TensorRT-RTX refused compute capability {cc}", _logger(trt).sink.tail())
    if profile:
        opt = builder.create_optimization_profile()
        for name, rng in profile.items():
            opt.set_shape(name, rng.min, rng.opt, rng.max)
        if config.add_optimization_profile(opt) < 0:
            raise ConfigError(
                f"the shape profile was rejected: {_logger(trt).sink.tail()}",
                "check --shapes against the model's inputs",
            )
    return config


@contextlib.contextmanager
def _progress(trt: Any, config: Any, label: str, enabled: bool) -> Iterator[None]:
    """Show a rich progress line fed by TensorRT's ``IProgressMonitor`` while the builder runs."""
    from rich.console import Console

    console = Console(stderr=True)
    if not enabled or not console.is_terminal or not hasattr(trt, "IProgressMonitor"):
        log.info("%s …", label)
        yield
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task(label, total=None)

    class _Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.top: str | None = None

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            if parent_phase is None:
                self.top = phase_name
                bar.update(task, description=f"{label}: {phase_name}", total=num_steps, completed=0)
            else:
                bar.update(task, description=f"{label}: {parent_phase} › {phase_name}")

        def step_complete(self, phase_name: str, step: int) -> bool:
            if phase_name == self.top:
                bar.update(task, completed=step + 1)
            return True

        def phase_finish(self, phase_name: str) -> None:
            pass

    monitor = _Monitor()  # must outlive the build
    config.progress_monitor = monitor
    try:
        with bar:
            yield
    finally:
        config.progress_monitor = None
        del monitor


def _write_atomic(path: Path, blob: Any) -> int:
    """Write bytes to ``path`` via a temp file in the same directory and a rename; returns the size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(memoryview(blob))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _io_specs(trt: Any, network: Any, onnx_dims: dict[str, list[str | int]]) -> tuple[list[dict], list[dict]]:
    """Network inputs/outputs as manifest-ready dicts (name, numpy dtype, dims with axis names)."""

    def spec(t: Any, names: list[str | int]) -> dict[str, Any]:
        dims = [d if d >= 0 else (names[i] if i < len(names) else "?") for i, d in enumerate(t.shape)]
        return {"name": t.name, "dtype": _DTYPES.get(t.dtype.name, t.dtype.name.lower()), "dims": dims}

    inputs = [
        spec(network.get_input(i), onnx_dims.get(network.get_input(i).name, [])) for i in range(network.num_inputs)
    ]
    outputs = [spec(network.get_output(i), []) for i in range(network.num_outputs)]
    return inputs, outputs


def build_engine(
    onnx_path: Path, engine_path: Path, cfg: BuildConfig, flavor: Flavor, *, progress: bool = True
) -> dict[str, Any]:
    """Build a serialized engine from ONNX; returns facts for the manifest.

    One optimization profile from ``cfg.shapes`` (inputs sharing named axes inherit ranges), precision from
    the graph (see module docstring), ``cfg.opt_level`` as builder optimization level, and for TensorRT-RTX
    the compute capability of ``cfg.target``. The engine is written to a temp file and renamed into place.
    """
    trt = trt_module(flavor)
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    _require_file(onnx_path, "ONNX file")
    model = _load_graph(onnx_path)
    cc_name, gpu_name, cc = _resolve_target(trt, flavor, cfg.target)
    onnx_dims = _input_dims(model)
    with tempfile.TemporaryDirectory(prefix="miaohui-trt-") as tmp:
        source, precision_from = _prepare_graph(onnx_path, model, cfg.precision, Path(tmp))
        builder, network, _parser = _parse(trt, source, flavor, onnx_path)
        net_dims = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
        profile = _resolve_profile(net_dims, onnx_dims, cfg.shapes)
        config = _builder_config(trt, builder, cfg, cc, profile)
        label = f"building {_NAMES[flavor]} engine ({cc_name}, {cfg.precision})"
        start = time.perf_counter()
        with _progress(trt, config, label, progress):
            blob = builder.build_serialized_network(network, config)
        seconds = time.perf_counter() - start
        if blob is None:
            raise BuildError(
                f"{_NAMES[flavor]} failed to build {onnx_path.name} for {cc_name}: {_logger(trt).sink.tail()}",
                "see the library message; try another --precision, --opt-level or --target",
            )
        size = _write_atomic(engine_path, blob)
        inputs, outputs = _io_specs(trt, network, onnx_dims)
        layers = int(network.num_layers)
    return {
        "backend": flavor,
        "backend_version": str(trt.__version__),
        "target": {"device": "cuda", "compute_capability": cc_name, "gpu_name": gpu_name},
        "precision": cfg.precision,
        "precision_from": precision_from,
        "strongly_typed": True,
        "opt_level": cfg.opt_level,
        "engine_file": engine_path.name,
        "engine_bytes": size,
        "build_seconds": round(seconds, 3),
        "network_layers": layers,
        "inputs": inputs,
        "outputs": outputs,
        "profile": {n: {"min": list(r.min), "opt": list(r.opt), "max": list(r.max)} for n, r in profile.items()},
        "unsupported_nodes": [],
    }


# ---------------------------------------------------------------------------------------------- artifacts


def _check_header(flavor: Flavor, blob: bytes, path: Path) -> dict[str, Any]:
    """Read what the plan header tells on CPU; ArtifactError for empty/truncated files.

    The TensorRT-RTX header layout (magic ``vtrt``, plan size at byte 16, version bytes 24-27, compute
    capability bitmask at byte 32 in ComputeCapability order) was read off engines built by 1.7.1; it is
    undocumented, so it is used only when the magic matches. Full TensorRT plans are only size-checked.
    """
    if len(blob) < 64:
        raise ArtifactError(
            f"engine file {path} is {len(blob)} bytes: corrupt or truncated",
            "rebuild it with `miaohui build`",
        )
    if flavor != "tensorrt-rtx" or blob[:4] != _RTX_MAGIC:
        return {"format": "unknown plan header", "magic": blob[:4].hex()}
    _magic, declared, major, minor, patch, build, _, mask = _RTX_HEADER.unpack_from(blob)
    if declared != len(blob):
        raise ArtifactError(
            f"engine file {path} is {len(blob)} bytes but its header says {declared}: corrupt or truncated engine file",
            "rebuild it with `miaohui build`",
        )
    order = ["sm75", "sm80", "sm86", "sm89", "sm120", "sm121"]  # bit i = i-th SM member of ComputeCapability
    ccs = [cc for bit, cc in enumerate(order) if mask >> bit & 1]
    ccs += [f"bit{bit}" for bit in range(len(order), 64) if mask >> bit & 1]
    return {
        "format": "TensorRT-RTX plan",
        "built_with": f"{major}.{minor}.{patch}.{build}",
        "compute_capabilities": ccs,
    }


def inspect_engine(engine_path: Path, flavor: Flavor) -> dict[str, Any]:
    """What can be learned about a serialized engine here.

    Always: size, sha256 and the header (TensorRT-RTX: version and compute capabilities; truncation check).
    With a CUDA GPU: deserializes and lists layers and I/O tensors with their profile shapes. Without one,
    deserialization is impossible (the runtime needs CUDA) and ``deserialized`` is False with a note.
    """
    trt = trt_module(flavor)
    engine_path = Path(engine_path)
    if not engine_path.is_file():
        raise ArtifactError(f"engine file {engine_path} does not exist", "build it with `miaohui build`")
    blob = engine_path.read_bytes()
    info: dict[str, Any] = {
        "path": str(engine_path),
        "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "runtime_version": str(trt.__version__),
        **_check_header(flavor, blob, engine_path),
    }
    if "built_with" in info:
        info["matches_runtime_version"] = info["built_with"] == info["runtime_version"]
    if _local_gpu() is None:
        info.update(deserialized=False, note="no CUDA GPU here: deserialization needs one; checked header and size")
        return info
    _runtime, engine = _deserialize(trt, blob, engine_path)
    info.update(
        deserialized=True,
        layers=int(engine.num_layers),
        io=[_tensor_info(trt, engine, i) for i in range(engine.num_io_tensors)],
    )
    return info


def _tensor_info(trt: Any, engine: Any, index: int) -> dict[str, Any]:
    name = engine.get_tensor_name(index)
    out: dict[str, Any] = {
        "name": name,
        "mode": engine.get_tensor_mode(name).name,
        "dtype": _DTYPES.get(engine.get_tensor_dtype(name).name, "?"),
        "shape": list(engine.get_tensor_shape(name)),
    }
    if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
        out["profile"] = [list(s) for s in engine.get_tensor_profile_shape(name, 0)]
    return out


def _deserialize(trt: Any, blob: bytes, path: Path) -> tuple[Any, Any]:
    """Deserialize on the current GPU → (runtime, engine); ArtifactError naming the file when refused."""
    logger = _logger(trt)
    logger.sink.begin()
    runtime = trt.Runtime(logger)
    validity = getattr(runtime, "get_engine_validity", None)  # TensorRT-RTX only: header check with reasons
    if validity is not None:
        state, diag = validity(blob[: runtime.engine_header_size])
        if state == trt.EngineValidity.INVALID:
            reasons = [n for n, m in trt.EngineInvalidityDiagnostics.__members__.items() if int(diag) & int(m)]
            raise ArtifactError(
                f"engine file {path} cannot run on this GPU: {', '.join(reasons) or 'invalid'}",
                "rebuild it for this GPU with `miaohui build … --target <this GPU's smXY>`",
            )
    engine = runtime.deserialize_cuda_engine(blob)
    if engine is None:
        raise ArtifactError(
            f"corrupt or truncated engine file {path} ({logger.sink.tail()})",
            "rebuild it with `miaohui build`",
        )
    return runtime, engine  # the runtime must outlive the engine


# ---------------------------------------------------------------------------------------------- runtime


def _check_compatibility(
    flavor: Flavor,
    built_cc: str | None,
    built_version: str,
    gpu_cc: str,
    gpu_name: str,
    runtime_version: str,
    runnable: list[str] | None,
) -> None:
    """Refuse, before deserializing, an engine made for another GPU or library version (pure)."""
    name = _NAMES[flavor]
    if runnable is not None and gpu_cc not in runnable:
        raise BackendUnavailableError(
            f"this GPU is {gpu_cc} ({gpu_name}), which {name} {runtime_version} cannot run on "
            f"(it runs on {', '.join(runnable)})",
            "serve this model with --backend tensorrt (full TensorRT) or --backend inductor on this GPU",
        )
    if built_cc != gpu_cc or built_version != runtime_version:
        raise ArtifactError(
            f"engine was built for {built_cc} with {name} {built_version}; this GPU is {gpu_cc} ({gpu_name}) "
            f"with {name} {runtime_version}",
            f"rebuild with `miaohui build … --backend {flavor} --target {gpu_cc}` ({name} {runtime_version})",
        )


class TensorRTEngine(Engine):
    """A serialized TensorRT / TensorRT-RTX engine loaded on the current CUDA GPU.

    ``path`` is the artifact directory (the engine is ``manifest.engine_file`` inside it) or the engine file.
    Buffers are torch CUDA tensors bound with ``set_tensor_address``; one stream, one context, one lock.
    """

    def __init__(self, manifest: Manifest, path: Path) -> None:
        super().__init__(manifest, path)
        if manifest.backend not in _MODULES:
            raise ArtifactError(
                f"manifest backend {manifest.backend!r} is not a TensorRT engine",
                "load it with the engine class of its backend",
            )
        self.flavor: Flavor = "tensorrt-rtx" if manifest.backend == "tensorrt-rtx" else "tensorrt"
        trt = trt_module(self.flavor)
        gpu = _local_gpu()
        if gpu is None:
            raise BackendUnavailableError(
                f"no CUDA GPU found; {_NAMES[self.flavor]} engines run on NVIDIA GPUs of compute capability "
                f"{self._runnable_text(trt)} (this one was built for {manifest.target.compute_capability})",
                "serve it on such a GPU, or use --backend onnxruntime (CPU) here",
            )
        runnable = list(rtx_targets(trt)) if self.flavor == "tensorrt-rtx" else None
        _check_compatibility(
            self.flavor,
            manifest.target.compute_capability,
            manifest.backend_version,
            gpu[0],
            gpu[1],
            str(trt.__version__),
            runnable,
        )
        file = path / manifest.engine_file if path.is_dir() else path
        if not file.is_file():
            raise ArtifactError(f"engine file {file} does not exist", "rebuild it with `miaohui build`")
        blob = file.read_bytes()
        _check_header(self.flavor, blob, file)
        self._trt = trt
        self._runtime, self._engine = _deserialize(trt, blob, file)
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise ArtifactError(
                f"could not create an execution context for {file} ({_logger(trt).sink.tail()})",
                "free GPU memory or rebuild the engine",
            )
        import torch

        self._torch = torch
        self._stream = torch.cuda.Stream()
        self._lock = threading.Lock()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        self._inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if n not in self._inputs]

    def _runnable_text(self, trt: Any) -> str:
        if self.flavor == "tensorrt-rtx":
            return "/".join(f"{cc[2:-1]}.{cc[-1]}" for cc in rtx_targets(trt))
        return "7.5 and newer"

    def _torch_dtype(self, name: str) -> Any:
        np_name = _DTYPES.get(self._engine.get_tensor_dtype(name).name)
        if np_name is None or not hasattr(self._torch, np_name):
            raise ArtifactError(
                f"tensor {name!r} has unsupported dtype {self._engine.get_tensor_dtype(name)}",
                "export the model with float/int tensors at its inputs and outputs",
            )
        return getattr(self._torch, np_name)

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch, ctx = self._torch, self._context
        with self._lock, torch.cuda.stream(self._stream):
            bound = []  # keep inputs alive until the stream is synchronized
            for name in self._inputs:
                host = torch.from_numpy(np.ascontiguousarray(feeds[name]))
                dev = host.to("cuda").to(self._torch_dtype(name)).contiguous()
                if not ctx.set_input_shape(name, tuple(dev.shape)):
                    raise ShapeError(
                        f"input {name!r} shape {tuple(dev.shape)} rejected by the engine",
                        "stay within the engine's shape profile",
                    )
                ctx.set_tensor_address(name, dev.data_ptr())
                bound.append(dev)
            outputs = {}
            for name in self._outputs:
                shape = tuple(ctx.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise ArtifactError(
                        f"output {name!r} has a data-dependent shape {shape}",
                        "export the model with outputs whose shape follows from the inputs",
                    )
                out = torch.empty(shape, dtype=self._torch_dtype(name), device="cuda")
                ctx.set_tensor_address(name, out.data_ptr())
                outputs[name] = out
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise ArtifactError(
                    f"{_NAMES[self.flavor]} execution failed: {_logger(self._trt).sink.tail()}",
                    "check the inputs against the manifest; rebuild the engine if it persists",
                )
            self._stream.synchronize()
        return {n: (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy() for n, t in outputs.items()}

    def close(self) -> None:
        """Release the context and engine (idempotent)."""
        self._context = self._engine = self._runtime = None
