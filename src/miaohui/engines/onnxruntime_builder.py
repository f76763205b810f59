"""``onnxruntime`` backend, the build half: fp32 with graph fusion, or int8 (calibrated QDQ or dynamic).

The runtime half is :mod:`miaohui.engines.onnxruntime`."""

from __future__ import annotations

from pathlib import Path

from miaohui.compile.optimize import ORT_SLOW_FUSIONS, fuse_bert, op_counts, unfuse_slow_ops
from miaohui.compile.quantize import quantize_dynamic_int8, quantize_qdq
from miaohui.engines.base import TensorSpec
from miaohui.engines.context import BuildContext, BuiltEngine
from miaohui.engines.onnxruntime import ENGINE_FILE, backend_version
from miaohui.engines.support import require_supported
from miaohui.engines.target import cpu_target, int8_reduce_range
from miaohui.errors import BuildError


def io_specs(ctx: BuildContext, output: str, out_dims: list[str | int]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    inputs = [
        TensorSpec(name=n, dtype="int64", dims=["batch", "sequence"], profile=ctx.shapes[n])
        for n in ("input_ids", "attention_mask")
    ]
    return inputs, [TensorSpec(name=output, dtype="float32", dims=out_dims)]


def build(ctx: BuildContext) -> BuiltEngine:
    """fp32: fused graph. int8 static: fused graph (attention unfused) → calibrated QDQ.
    int8 dynamic: fused graph with plain LayerNorm/GELU (ORT's SkipLayerNorm/BiasGelu kernels are slow) →
    int8 weights, per-call activation scales (QAttention, DynamicQuantizeMatMul), sensitive MatMuls fp32."""
    if ctx.onnx_path is None:
        raise BuildError("the onnxruntime builder needs an exported model", "build from a model directory")
    require_supported(ctx.onnx_path, "onnxruntime")
    if ctx.model is None:
        return build_from_file(ctx, ctx.onnx_path)
    bert = ctx.model.meta.bert_config
    heads, hidden = int(bert["num_attention_heads"]), int(bert["hidden_size"])
    out = ctx.out_dir / ENGINE_FILE
    extra: dict[str, object] = {}
    if ctx.cfg.precision == "fp32":
        ctx.log("fusing attention, layer norm and GELU for ONNX Runtime")
        fuse_bert(ctx.onnx_path, out, heads, hidden, attention=True)
    elif ctx.cfg.precision == "int8" and ctx.cfg.calibration.mode == "dynamic":
        fused, plain = ctx.work_dir / "fused.onnx", ctx.work_dir / "plain-norms.onnx"
        ctx.log("fusing attention; int8 weights with run-time activation ranges")
        fuse_bert(ctx.onnx_path, fused, heads, hidden, attention=True)
        unfused = unfuse_slow_ops(fused, plain)
        cal = ctx.cfg.calibration
        ranked = cal.fp32_fallback or cal.smooth
        feeds = ctx.text_feeds() if ranked and ctx.calib_texts else None
        if ranked:
            ctx.log(f"ranking MatMuls by run-time quantization error on {len(feeds or [])} calibration texts")
        dynamic = quantize_dynamic_int8(
            plain, out, cal, feeds, ctx.calib_texts, ORT_SLOW_FUSIONS, reduce_range=int8_reduce_range()
        )
        extra["int8"] = {"mode": "dynamic", "per_channel": cal.per_channel, **dynamic.model_dump(), "unfused": unfused}
        extra["ort_disabled_optimizers"] = list(ORT_SLOW_FUSIONS)
    elif ctx.cfg.precision == "int8":
        fused = ctx.work_dir / "fused.onnx"
        ctx.log("fusing layer norm and GELU (attention kept as MatMuls for int8)")
        fuse_bert(ctx.onnx_path, fused, heads, hidden, attention=False)
        ctx.log(f"calibrating on {len(ctx.calib_texts)} texts ({ctx.cfg.calibration.method})")
        summary = quantize_qdq(fused, out, ctx.calibration_feeds(), ctx.calib_texts, ctx.cfg.calibration, "onnxruntime")
        (ctx.out_dir / "calibration.json").write_text(summary.model_dump_json(indent=1))
        extra["calibration"] = summary.model_dump(exclude={"ranges"})
    else:
        raise BuildError(f"precision {ctx.cfg.precision} is not built by onnxruntime", "use fp32 or int8")
    extra["op_counts"] = op_counts(out)
    output = (ctx.model.meta.kind == "intent" and "logits") or "embeddings"
    width = len(ctx.model.meta.labels) if ctx.model.meta.kind == "intent" else int(hidden)
    inputs, outputs = io_specs(ctx, output, ["batch", width])
    return BuiltEngine(
        engine_file=ENGINE_FILE,
        backend_version=backend_version(),
        target=cpu_target(),
        inputs=inputs,
        outputs=outputs,
        extra=extra,
    )


def build_from_file(ctx: BuildContext, source: Path) -> BuiltEngine:
    """A user's ONNX file: used as it is (fp32; ONNX Runtime fuses at load what it recognises), or quantized
    (int8 static QDQ calibrated on ``--calib-data``, or dynamic). Inputs and outputs as the graph declares them."""
    import shutil

    from miaohui.sources.onnx_file import read_graph

    out = ctx.out_dir / ENGINE_FILE
    extra: dict[str, object] = {}
    cal = ctx.cfg.calibration
    if ctx.cfg.precision == "fp32":
        shutil.copyfile(source, out)
    elif ctx.cfg.precision == "int8" and cal.mode == "dynamic":
        dynamic = quantize_dynamic_int8(source, out, cal, None, ctx.calib_texts, reduce_range=int8_reduce_range())
        extra["int8"] = {"mode": "dynamic", "per_channel": cal.per_channel, **dynamic.model_dump()}
    elif ctx.cfg.precision == "int8":
        ctx.log(f"calibrating on {len(ctx.calib_texts)} texts ({cal.method})")
        summary = quantize_qdq(source, out, ctx.calibration_feeds(), ctx.calib_texts, cal, "onnxruntime")
        (ctx.out_dir / "calibration.json").write_text(summary.model_dump_json(indent=1))
        extra["calibration"] = summary.model_dump(exclude={"ranges"})
    else:
        raise BuildError(f"precision {ctx.cfg.precision} is not built by onnxruntime", "use fp32 or int8")
    extra["op_counts"] = op_counts(out)
    graph = read_graph(source)
    inputs = [
        TensorSpec(name=t.name, dtype=t.dtype, dims=list(t.dims), profile=ctx.shapes[t.name]) for t in graph.inputs
    ]
    outputs = [TensorSpec(name=t.name, dtype=t.dtype, dims=list(t.dims)) for t in graph.outputs]
    return BuiltEngine(
        engine_file=ENGINE_FILE,
        backend_version=backend_version(),
        target=cpu_target(),
        inputs=inputs,
        outputs=outputs,
        extra=extra,
    )
