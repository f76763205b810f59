"""``tensorrt`` / ``tensorrt-rtx`` builds from the exported ONNX (one code path, see engines/tensorrt.py).

int8 first inserts symmetric QDQ from calibration (TensorRT's explicit quantization); fp16 casts the graph.
"""

from __future__ import annotations

from miaohui.compile.quantize import quantize_qdq
from miaohui.engines import tensorrt
from miaohui.engines.base import Target, TensorSpec
from miaohui.engines.context import BuildContext, BuiltEngine
from miaohui.engines.support import require_supported
from miaohui.errors import BuildError

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
    facts = tensorrt.build_engine(source, ctx.out_dir / ENGINE_FILE, cfg, flavor)
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
