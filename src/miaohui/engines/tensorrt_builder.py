"""The TensorRT / TensorRT-RTX builder: ONNX → parsed network → serialized engine (one code path for both
flavors, :mod:`miaohui.engines.tensorrt`), and the backend's build step from a :class:`BuildContext`.

int8 first inserts symmetric QDQ from calibration (TensorRT's explicit quantization); fp16 casts the graph.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miaohui.compile.quantize import quantize_qdq
from miaohui.config import BuildConfig, InputRange
from miaohui.engines.base import Target, TensorSpec
from miaohui.engines.context import BuildContext, BuiltEngine
from miaohui.engines.support import require_supported
from miaohui.engines.tensorrt import (
    DTYPES,
    NAMES,
    Flavor,
    local_gpu,
    log,
    require_file,
    rtx_targets,
    trt_logger,
    trt_module,
)
from miaohui.errors import BackendUnavailableError, BuildError, ConfigError, UnsupportedOperatorError

if TYPE_CHECKING:
    import onnx

# Ops kept in fp32 when miaohui casts a graph to fp16: normalizations accumulate over the hidden size.
_FP32_OPS = (
    "LayerNormalization",
    "SimplifiedLayerNormalization",
    "RMSNormalization",
    "SkipLayerNormalization",
)


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
    require_file(onnx_path, "ONNX file")
    nodes = list(_load_graph(onnx_path).graph.node)
    logger = trt_logger(trt)
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


def _resolve_target(trt: Any, flavor: Flavor, target: str | None) -> tuple[str, str | None, Any]:
    """Pick the build target: (``smXY``, GPU name or None, RTX ``ComputeCapability`` or None).

    Branch: TensorRT-RTX selects the compute capability through the builder config (ahead of time, no GPU
    needed); full TensorRT tunes kernels on the GPU it runs on, so the target must be this machine's GPU.
    """
    gpu = local_gpu()
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
    logger = trt_logger(trt)
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
            f"{NAMES[flavor]} cannot import {len(bad)} node(s) of {shown.name}: {listed} [{text[:300]}]",
            "replace those ops in the model (or export with a different opset), register a TensorRT "
            "plugin for custom ops, or build with --backend onnxruntime / inductor",
        )
    raise BuildError(
        f"{NAMES[flavor]} could not parse {shown.name}: {text or logger.sink.tail()}",
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
            raise BuildError(f"TensorRT-RTX refused compute capability {cc}", trt_logger(trt).sink.tail())
    if profile:
        opt = builder.create_optimization_profile()
        for name, rng in profile.items():
            opt.set_shape(name, rng.min, rng.opt, rng.max)
        if config.add_optimization_profile(opt) < 0:
            raise ConfigError(
                f"the shape profile was rejected: {trt_logger(trt).sink.tail()}",
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
        return {"name": t.name, "dtype": DTYPES.get(t.dtype.name, t.dtype.name.lower()), "dims": dims}

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
    require_file(onnx_path, "ONNX file")
    model = _load_graph(onnx_path)
    cc_name, gpu_name, cc = _resolve_target(trt, flavor, cfg.target)
    onnx_dims = _input_dims(model)
    with tempfile.TemporaryDirectory(prefix="miaohui-trt-") as tmp:
        source, precision_from = _prepare_graph(onnx_path, model, cfg.precision, Path(tmp))
        builder, network, _parser = _parse(trt, source, flavor, onnx_path)
        net_dims = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
        profile = _resolve_profile(net_dims, onnx_dims, cfg.shapes)
        config = _builder_config(trt, builder, cfg, cc, profile)
        label = f"building {NAMES[flavor]} engine ({cc_name}, {cfg.precision})"
        start = time.perf_counter()
        with _progress(trt, config, label, progress):
            blob = builder.build_serialized_network(network, config)
        seconds = time.perf_counter() - start
        if blob is None:
            raise BuildError(
                f"{NAMES[flavor]} failed to build {onnx_path.name} for {cc_name}: {trt_logger(trt).sink.tail()}",
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


# ---------------------------------------------------------------------------------------------- backend


ENGINE_FILE = "model.engine"


def build(ctx: BuildContext) -> BuiltEngine:
    if ctx.onnx_path is None:
        raise BuildError("TensorRT builds need an exported ONNX graph", "build from a model directory")
    flavor = ctx.cfg.backend
    if flavor not in ("tensorrt", "tensorrt-rtx"):
        raise BuildError(f"backend {flavor} is not a TensorRT flavour", "use tensorrt or tensorrt-rtx")
    source = ctx.onnx_path
    require_supported(source, flavor)
    extra: dict[str, object] = {}
    if ctx.cfg.precision == "int8":
        qdq = ctx.out_dir / "model.qdq.onnx"
        ctx.log(f"calibrating on {len(ctx.calib_texts)} texts ({ctx.cfg.calibration.method}), symmetric int8 QDQ")
        summary = quantize_qdq(source, qdq, ctx.calibration_feeds(), ctx.calib_texts, ctx.cfg.calibration, "tensorrt")
        (ctx.out_dir / "calibration.json").write_text(summary.model_dump_json(indent=1))
        extra["calibration"] = summary.model_dump(exclude={"ranges"})
        source = qdq
    cfg = ctx.cfg.model_copy(update={"shapes": ctx.shapes})
    facts = build_engine(source, ctx.out_dir / ENGINE_FILE, cfg, flavor)
    if ctx.cfg.precision == "int8":
        (ctx.out_dir / "model.qdq.onnx").unlink()  # the engine holds it; keep the artifact small
    target = Target.model_validate(facts["target"])
    inputs = [
        TensorSpec(name=s["name"], dtype=s["dtype"], dims=s["dims"], profile=ctx.shapes.get(s["name"]))
        for s in facts["inputs"]
    ]
    outputs = [TensorSpec(name=s["name"], dtype=s["dtype"], dims=s["dims"]) for s in facts["outputs"]]
    keep = (
        "precision_from",
        "strongly_typed",
        "opt_level",
        "engine_bytes",
        "build_seconds",
        "network_layers",
        "profile",
        "unsupported_nodes",
    )
    extra |= {k: facts[k] for k in keep if k in facts}
    return BuiltEngine(
        engine_file=ENGINE_FILE,
        backend_version=str(facts["backend_version"]),
        target=target,
        inputs=inputs,
        outputs=outputs,
        extra=extra,
    )
