"""SmoothQuant-style migration for dynamic int8: move a MatMul input's outlier channels into its weight.

ONNX Runtime's dynamic int8 quantizes a MatMul's activation with one scale per tensor and call, so a few
channels with large values (BERT's FFN down-projection input, after GELU) make the step coarse for all the
others — those are the MatMuls :func:`~miaohui.compile.quantize.activation_sensitivity` ranks worst. SmoothQuant
(Xiao et al., 2023) divides input channel ``j`` by ``s_j`` and multiplies weight row ``j`` by it, which leaves the
fp32 product unchanged::

    X @ W = (X / s) @ (s[:, None] * W),   s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

so the activation's range is flattened at the weight's expense (the weights are quantized per output channel,
offline, where a wider row costs less). Here ``X / s`` is an explicit ``Mul`` by a constant in front of the MatMul
(in a post-LayerNorm BERT the previous op is GELU or a residual stream, into which a scale cannot be folded):
one element-wise pass over the MatMul's input, cheap next to the product. ``max|X_j|`` is measured on the
calibration text through the fp32 graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from miaohui.compile.quantize import iter_matmul_inputs


def input_channel_absmax(
    fp32_onnx: Path, nodes: list[str], feeds: list[dict[str, np.ndarray]], disabled_optimizers: tuple[str, ...] = ()
) -> dict[str, np.ndarray]:
    """Per input channel (last axis), the largest |value| each MatMul in ``nodes`` sees over ``feeds``."""
    peaks: dict[str, np.ndarray] = {}
    for inputs in iter_matmul_inputs(fp32_onnx, nodes, feeds, disabled_optimizers):
        for n, x in inputs.items():
            m = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)
            peaks[n] = m if n not in peaks else np.maximum(peaks[n], m)
    return peaks


def _weight(model: onnx.ModelProto, name: str) -> tuple[np.ndarray, onnx.TensorProto]:
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init), init
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            attr = next(a for a in node.attribute if a.name == "value")
            return numpy_helper.to_array(attr.t), attr.t
    raise KeyError(name)


def smooth_matmuls(
    fp32_onnx: Path, out_path: Path, absmax: dict[str, np.ndarray], alpha: float = 0.5
) -> dict[str, float]:
    """Rewrite each MatMul named in ``absmax`` as ``MatMul(Mul(X, 1/s), s[:, None] * W)`` (see the module
    docstring); writes ``out_path``. Returns, per MatMul, how much flatter its input became: the ratio of its
    largest to its median channel peak, before over after."""
    model = onnx.load(str(fp32_onnx))
    users: dict[str, int] = {}
    for node in model.graph.node:
        for i in node.input:
            users[i] = users.get(i, 0) + 1
    index = {n.name: i for i, n in enumerate(model.graph.node)}
    flatter: dict[str, float] = {}
    inserted: list[tuple[int, onnx.NodeProto]] = []
    for name, a_max in absmax.items():
        node = model.graph.node[index[name]]
        w, proto = _weight(model, node.input[1])
        if w.ndim != 2 or w.shape[0] != a_max.shape[0]:
            continue  # not an [in, out] weight fed by this input's channels
        w_max = np.abs(w).max(axis=1).astype(np.float64)
        a = a_max.astype(np.float64)
        s = np.ones_like(a)
        ok = (a > 0) & (w_max > 0)
        s[ok] = np.clip(a[ok] ** alpha / w_max[ok] ** (1.0 - alpha), 1e-4, 1e4)
        scaled = (w.astype(np.float64) * s[:, None]).astype(w.dtype)
        if users.get(node.input[1], 0) == 1:
            proto.CopyFrom(numpy_helper.from_array(scaled, proto.name))
        else:  # a shared weight keeps its other users: this MatMul gets its own copy
            new = f"{node.input[1]}_smoothed_{len(flatter)}"
            model.graph.initializer.append(numpy_helper.from_array(scaled, new))
            node.input[1] = new
        inv = f"{name}_smooth_inv"
        model.graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inv))
        smoothed = f"{node.input[0]}_smoothed_for_{name}"
        inserted.append((index[name], onnx.helper.make_node("Mul", [node.input[0], inv], [smoothed], f"{name}_smooth")))
        node.input[0] = smoothed
        before = a.max() / max(float(np.median(a)), 1e-12)
        after_a = a / s
        flatter[name] = float(before / (after_a.max() / max(float(np.median(after_a)), 1e-12)))
    for pos, mul in sorted(inserted, key=lambda x: -x[0]):  # from the back, so earlier positions stay valid
        model.graph.node.insert(pos, mul)
    onnx.save(model, str(out_path))
    return flatter
