"""ORT graph rewrites of the int8 intent engine on small real graphs: SkipLayerNormalization / BiasGelu
unfused into plain ops (same outputs, ORT kept from re-fusing them), the run-time quantization
sensitivity ranking that picks the MatMuls kept fp32, and SmoothQuant input scales (same fp32 outputs, a
flatter input to quantize)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from miaohui.compile.optimize import ORT_SLOW_FUSIONS, op_counts, unfuse_slow_ops
from miaohui.compile.quantize import activation_sensitivity
from miaohui.compile.smooth import input_channel_absmax, smooth_matmuls
from miaohui.engines.target import int8_reduce_range

H = 16


def _session(path: Path, disabled: tuple[str, ...] = ()) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"], disabled_optimizers=list(disabled))


def _block(path: Path) -> Path:
    """x → MatMul → SkipLayerNormalization(+bias, skip=x) → MatMul(4H) → BiasGelu → MatMul → y."""
    rng = np.random.default_rng(0)

    def init(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)

    inits = [init("w1", H, H), init("w2", H, 4 * H), init("w3", 4 * H, H)]
    inits += [init("gamma", H), init("beta", H), init("b1", H), init("b2", 4 * H)]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="proj/MatMul"),
        helper.make_node(
            "SkipLayerNormalization",
            ["h1", "x", "gamma", "beta", "b1"],
            ["n1"],
            name="sln",
            domain="com.microsoft",
            epsilon=1e-12,
        ),
        helper.make_node("MatMul", ["n1", "w2"], ["h2"], name="up/MatMul"),
        helper.make_node("BiasGelu", ["h2", "b2"], ["g"], name="gelu", domain="com.microsoft"),
        helper.make_node("MatMul", ["g", "w3"], ["y"], name="down/MatMul"),
    ]
    graph = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", H])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    onnx.save(model, str(path))
    return path


def test_unfused_graph_computes_the_same_and_is_not_refused(tmp_path: Path) -> None:
    src = _block(tmp_path / "fused.onnx")
    dst = tmp_path / "plain.onnx"
    assert unfuse_slow_ops(src, dst) == {"SkipLayerNormalization": 1, "BiasGelu": 1}
    ops = op_counts(dst)
    assert ops == {"Add": 3, "MatMul": 3, "LayerNormalization": 1, "Gelu": 1}
    x = np.random.default_rng(1).standard_normal((2, 5, H)).astype(np.float32)
    want = _session(src).run(None, {"x": x})[0]
    got = _session(dst, ORT_SLOW_FUSIONS).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # with the fusions left on, ORT would put the slow kernels back: the optimized graph shows it
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for disabled, fused in (((), True), (ORT_SLOW_FUSIONS, False)):
        opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(str(dst), opts, providers=["CPUExecutionProvider"], disabled_optimizers=list(disabled))
        kinds = set(op_counts(tmp_path / "optimized.onnx"))
        assert ("SkipLayerNormalization" in kinds) is fused and ("BiasGelu" in kinds) is fused


def test_sensitivity_ranks_the_long_tailed_input_first(tmp_path: Path) -> None:
    src = _block(tmp_path / "fused.onnx")
    rng = np.random.default_rng(2)
    feeds = []
    for _ in range(4):
        x = rng.standard_normal((1, 8, H)).astype(np.float32)
        x[0, 3, 5] = 60.0  # one outlier: per-tensor uint8 steps become coarse for the whole of x
        feeds.append({"x": x})
    scores = activation_sensitivity(src, ["proj/MatMul", "up/MatMul", "down/MatMul"], feeds)
    assert next(iter(scores)) == "proj/MatMul"  # its input is x itself
    assert all(v >= 0 for v in scores.values()) and list(scores.values()) == sorted(scores.values(), reverse=True)


def _outlier_feeds(channel: int, n: int = 4) -> list[dict[str, np.ndarray]]:
    """Inputs whose channel ``channel`` is ~40x the others on every token (the outlier-channel pattern
    SmoothQuant targets, unlike one stray value)."""
    rng = np.random.default_rng(3)
    feeds = []
    for _ in range(n):
        x = rng.standard_normal((1, 8, H)).astype(np.float32)
        x[..., channel] *= 40.0
        feeds.append({"x": x})
    return feeds


def test_smoothing_keeps_fp32_outputs_and_flattens_the_outlier_channel(tmp_path: Path) -> None:
    plain = tmp_path / "plain.onnx"
    unfuse_slow_ops(_block(tmp_path / "fused.onnx"), plain)
    feeds = _outlier_feeds(channel=5)
    absmax = input_channel_absmax(plain, ["proj/MatMul"], feeds, ORT_SLOW_FUSIONS)
    assert int(absmax["proj/MatMul"].argmax()) == 5
    smoothed = tmp_path / "smoothed.onnx"
    flatter = smooth_matmuls(plain, smoothed, absmax, alpha=0.5)
    assert flatter["proj/MatMul"] > 3.0
    assert op_counts(smoothed)["Mul"] == op_counts(plain).get("Mul", 0) + 1
    x = feeds[0]["x"]
    want = _session(plain, ORT_SLOW_FUSIONS).run(None, {"x": x})[0]
    got = _session(smoothed, ORT_SLOW_FUSIONS).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)  # the same product in fp32
    # the MatMul in dynamic int8 in both graphs: the smoothed one's output is closer to fp32
    errors = []
    for graph in (plain, smoothed):
        q = tmp_path / f"{graph.stem}.int8.onnx"
        quantize_dynamic(
            str(graph),
            str(q),
            weight_type=QuantType.QInt8,
            per_channel=True,
            nodes_to_quantize=["proj/MatMul"],
            reduce_range=int8_reduce_range(),  # as the build quantizes on this CPU
        )
        y = _session(q, ORT_SLOW_FUSIONS).run(None, {"x": x})[0]
        errors.append(float(np.linalg.norm(y - want) / np.linalg.norm(want)))
    assert errors[1] < errors[0] / 2, errors  # the test graph: ~3x smaller


def test_smoothing_one_user_of_a_shared_weight_leaves_the_other_alone(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    w = numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y1"], name="m1"),
        helper.make_node("MatMul", ["x", "w"], ["y2"], name="m2"),
    ]
    out = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", H]) for n in ("y1", "y2")]
    graph = helper.make_graph(
        nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", H])], out, [w]
    )
    src = tmp_path / "shared.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    feeds = _outlier_feeds(channel=2)
    dst = tmp_path / "smoothed.onnx"
    smooth_matmuls(src, dst, input_channel_absmax(src, ["m1"], feeds), alpha=0.5)
    model = onnx.load(str(dst))
    by_name = {n.name: n for n in model.graph.node}
    assert by_name["m2"].input[1] == "w" and by_name["m1"].input[1] != "w"
    np.testing.assert_array_equal(numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w")),
                                  numpy_helper.to_array(w))  # fmt: skip
    x = feeds[0]["x"]
    want = _session(src).run(None, {"x": x})
    got = _session(dst).run(None, {"x": x})
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)
