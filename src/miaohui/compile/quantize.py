"""INT8 by calibration: explicit QuantizeLinear/DequantizeLinear (QDQ) inserted from activation ranges
measured on representative text. Ranges are saved in ``calibration.json``.

Two flavours of the same recipe (weights: int8, symmetric, per output channel):

* ``onnxruntime`` — activations uint8 with a zero point (ONNX Runtime's fast U8S8 VNNI kernels on x86);
  ORT fuses each Q→DQ→MatMul into ``MatMulIntegerToFloat`` at load time.
* ``tensorrt`` — activations int8, symmetric (zero point 0, what TensorRT requires), biases left in fp32.

Only MatMuls with a constant weight are quantized (the projections and FFN); attention's
activation×activation products, LayerNorm and softmax stay fp32.

ONNX Runtime's *dynamic* int8 (:func:`quantize_dynamic_int8`, the default intent engine) needs no activation
ranges: int8 weights, per-call activation scales, fused ``QAttention``. Its sensitive layers can be chosen on
calibration text (:func:`activation_sensitivity`) and kept fp32.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
from pydantic import BaseModel

from miaohui.config import CalibrationConfig
from miaohui.errors import BuildError

Flavor = Literal["onnxruntime", "tensorrt"]


class CalibrationSummary(BaseModel):
    """What ``calibration.json`` holds."""

    method: str
    percentile: float | None
    num_samples: int
    data_digest: str
    """sha256 of the calibration texts, in order."""
    flavor: str
    activation_type: str
    weight_type: str
    per_channel: bool
    quantized_nodes: int
    ranges: dict[str, tuple[float, float]]
    """Activation tensor → (low, high) measured by the calibrator."""


def texts_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\x00")
    return h.hexdigest()


class _Reader:
    """ORT CalibrationDataReader over prepared feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._feeds = feeds
        self._it: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._feeds)

    def __len__(self) -> int:
        return len(self._feeds)


def weight_matmuls(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """(MatMuls with a constant weight, MatMuls of two activations)."""
    inits = {i.name for i in model.graph.initializer}
    const_outputs = {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    weights: list[str] = []
    activations: list[str] = []
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        (weights if node.input[1] in inits or node.input[1] in const_outputs else activations).append(node.name)
    return weights, activations


def _infer_shapes(src: Path, dst: Path) -> None:
    """Symbolic shape inference (understands ORT contrib ops, which plain ONNX inference does not)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    model = SymbolicShapeInference.infer_shapes(onnx.load(str(src)), auto_merge=True)
    onnx.save(model, str(dst))


def quantize_qdq(
    fp32_onnx: Path,
    out_path: Path,
    feeds: list[dict[str, np.ndarray]],
    texts: list[str],
    cfg: CalibrationConfig,
    flavor: Flavor,
) -> CalibrationSummary:
    """Calibrate on ``feeds`` (made from ``texts``) and write the QDQ graph to ``out_path``."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[cfg.method]
    act_type = QuantType.QUInt8 if flavor == "onnxruntime" else QuantType.QInt8
    extra: dict[str, Any] = {
        "ActivationSymmetric": flavor == "tensorrt",
        "WeightSymmetric": True,
        "OpTypesToExcludeOutputQuantization": ["MatMul"],
        "QuantizeBias": flavor != "tensorrt",
        "CalibMovingAverage": False,
    }
    if cfg.method == "percentile":
        extra["CalibPercentile"] = cfg.percentile
    logging.getLogger().setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="miaohui-quant-") as tmp_dir:
        tmp = Path(tmp_dir)
        shaped = tmp / "shaped.onnx"
        _infer_shapes(fp32_onnx, shaped)
        model = onnx.load(str(shaped), load_external_data=False)
        weights, act_matmuls = weight_matmuls(model)
        kept = [n for n in weights if any(re.search(p, n) for p in cfg.keep_fp32)]
        weights = [n for n in weights if n not in kept]
        if not weights:
            raise BuildError(
                f"{fp32_onnx.name} has no MatMul with constant weights to quantize",
                "int8 needs a transformer-style graph; build it with --precision fp32",
            )
        cache = tmp / "calibration-cache.json"
        try:
            quantize_static(
                str(shaped),
                str(out_path),
                _Reader(feeds),
                quant_format=QuantFormat.QDQ,
                per_channel=cfg.per_channel,
                activation_type=act_type,
                weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"],
                nodes_to_exclude=act_matmuls + kept,
                calibrate_method=method,
                calibration_cache_path=str(cache),
                extra_options=extra,
            )
        except Exception as exc:
            raise BuildError(
                f"int8 calibration/quantization of {fp32_onnx.name} failed: {exc}",
                "try --calibration minmax, or more calibration text",
            ) from exc
        ranges = _read_cache(cache)
    return CalibrationSummary(
        method=cfg.method,
        percentile=cfg.percentile if cfg.method == "percentile" else None,
        num_samples=len(texts),
        data_digest=texts_digest(texts),
        flavor=flavor,
        activation_type="uint8" if flavor == "onnxruntime" else "int8",
        weight_type="int8",
        per_channel=cfg.per_channel,
        quantized_nodes=len(weights),
        ranges=ranges,
    )


class DynamicInt8Summary(BaseModel):
    """What the dynamic int8 pass did (kept in the manifest)."""

    kept_fp32: list[str]
    """Weight MatMuls left in fp32: ``keep_fp32`` matches plus the ``fp32_fallback`` most sensitive ones."""
    sensitivity: dict[str, float]
    """Weight MatMul → noise-to-signal ratio of its input under per-tensor uint8 run-time quantization on
    the calibration text (fp32 graph), the largest first; empty when ``fp32_fallback`` is 0."""
    smoothed: dict[str, float] = {}
    """MatMuls given a SmoothQuant input scale (``smooth``) → how much flatter their input became (largest over
    median channel peak, before / after)."""
    num_samples: int
    data_digest: str | None


def iter_matmul_inputs(
    fp32_onnx: Path, nodes: list[str], feeds: list[dict[str, np.ndarray]], disabled_optimizers: tuple[str, ...] = ()
) -> Iterator[dict[str, np.ndarray]]:
    """Run ``feeds`` through the fp32 graph; per feed, the input activation of each MatMul in ``nodes``."""
    import onnxruntime as ort

    model = onnx.load(str(fp32_onnx))
    by_name = {n.name: n for n in model.graph.node}
    tensors = sorted({by_name[n].input[0] for n in nodes})
    known = {o.name for o in model.graph.output}
    for t in tensors:
        if t not in known:
            model.graph.output.append(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(
        model.SerializeToString(),
        opts,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=list(disabled_optimizers),
    )
    source = {n: by_name[n].input[0] for n in nodes}
    del model, by_name
    for feed in feeds:
        values = dict(zip(tensors, sess.run(tensors, feed), strict=True))
        yield {n: values[t] for n, t in source.items()}


def activation_sensitivity(
    fp32_onnx: Path, nodes: list[str], feeds: list[dict[str, np.ndarray]], disabled_optimizers: tuple[str, ...] = ()
) -> dict[str, float]:
    """How much each MatMul's input loses to ONNX Runtime's dynamic quantization (uint8, one scale and zero
    point per tensor and call, range from the tensor's own min/max): mean noise-to-signal power ratio over
    ``feeds``, run through the fp32 graph. Long-tailed inputs (a few outlier channels) score high — those are
    the MatMuls whose int8 version moves the logits most."""
    totals = dict.fromkeys(nodes, 0.0)
    for inputs in iter_matmul_inputs(fp32_onnx, nodes, feeds, disabled_optimizers):
        for n, x in inputs.items():
            x = x.astype(np.float64)
            lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
            scale = (hi - lo) / 255.0 or 1.0
            zero = np.round(-lo / scale)
            deq = (np.clip(np.round(x / scale) + zero, 0, 255) - zero) * scale
            totals[n] += float(((deq - x) ** 2).mean() / max(float((x**2).mean()), 1e-30))
    scores = {n: totals[n] / max(1, len(feeds)) for n in nodes}
    return dict(sorted(scores.items(), key=lambda kv: -kv[1]))


def quantize_dynamic_int8(
    fp32_onnx: Path,
    out_path: Path,
    cfg: CalibrationConfig,
    feeds: list[dict[str, np.ndarray]] | None = None,
    texts: list[str] | None = None,
    disabled_optimizers: tuple[str, ...] = (),
    *,
    reduce_range: bool,
) -> DynamicInt8Summary:
    """ONNX Runtime dynamic int8: weights int8 now, activations quantized per call at run time, fused
    attention as ``QAttention``. Weight MatMuls matching ``cfg.keep_fp32`` stay fp32, and so do the
    ``cfg.fp32_fallback`` ones whose inputs :func:`activation_sensitivity` ranks worst on ``feeds``
    (the calibration text, one text per feed); the next ``cfg.smooth`` worst get a SmoothQuant input scale
    (:mod:`miaohui.compile.smooth`) and are quantized. ``reduce_range``: 7-bit weights, for CPUs whose int8 dot
    products saturate (:func:`miaohui.engines.target.int8_reduce_range`)."""
    from miaohui.compile.smooth import input_channel_absmax, smooth_matmuls

    model = onnx.load(str(fp32_onnx), load_external_data=False)
    weights, act_matmuls = weight_matmuls(model)
    del model
    kept = [n for n in weights if any(re.search(p, n) for p in cfg.keep_fp32)]
    sensitivity: dict[str, float] = {}
    smoothed: dict[str, float] = {}
    if cfg.fp32_fallback or cfg.smooth:
        if not feeds:
            raise BuildError(
                "int8 --fp32-fallback / --smooth rank layers on calibration text, and none was given",
                "pass --calib-data FILE, or --fp32-fallback 0 --smooth 0",
            )
        candidates = [n for n in weights if n not in kept]
        sensitivity = activation_sensitivity(fp32_onnx, candidates, feeds, disabled_optimizers)
        kept += list(sensitivity)[: cfg.fp32_fallback]
    with tempfile.TemporaryDirectory(prefix="miaohui-smooth-") as tmp:
        source = fp32_onnx
        if cfg.smooth:
            assert feeds is not None
            targets = [n for n in sensitivity if n not in kept][: cfg.smooth]
            absmax = input_channel_absmax(fp32_onnx, targets, feeds, disabled_optimizers)
            source = Path(tmp) / "smoothed.onnx"
            smoothed = smooth_matmuls(fp32_onnx, source, absmax, cfg.smooth_alpha)
        _quantize_dynamic(source, out_path, cfg, act_matmuls + kept, reduce_range)
    return DynamicInt8Summary(
        kept_fp32=kept,
        sensitivity={k: float(f"{v:.4g}") for k, v in sensitivity.items()},
        smoothed={k: float(f"{v:.4g}") for k, v in smoothed.items()},
        num_samples=len(feeds or []),
        data_digest=texts_digest(texts) if texts and (cfg.fp32_fallback or cfg.smooth) else None,
    )


def _quantize_dynamic(
    source: Path, out_path: Path, cfg: CalibrationConfig, exclude: list[str], reduce_range: bool
) -> None:
    """ORT's dynamic int8 of ``source`` (int8 per-channel weights) into ``out_path``; BuildError if it fails."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        quantize_dynamic(
            str(source),
            str(out_path),
            weight_type=QuantType.QInt8,
            per_channel=cfg.per_channel,
            reduce_range=reduce_range,  # 7-bit weights where the CPU lacks VNNI (the build key has its flags)
            op_types_to_quantize=["MatMul", "Attention"],
            nodes_to_exclude=exclude,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    except Exception as exc:
        raise BuildError(
            f"dynamic int8 quantization of {source.name} failed: {exc}",
            "use --int8-mode static, or --precision fp32",
        ) from exc


def _read_cache(cache: Path) -> dict[str, tuple[float, float]]:
    """ORT's calibration cache → {tensor: (low, high)}."""
    from onnxruntime.quantization.calibrate import load_tensors_data

    data = load_tensors_data(cache)
    ranges: dict[str, tuple[float, float]] = {}
    for name in data:
        lo, hi = data[name].range_value
        ranges[name] = (float(np.asarray(lo).ravel()[0]), float(np.asarray(hi).ravel()[0]))
    return dict(sorted(ranges.items()))
