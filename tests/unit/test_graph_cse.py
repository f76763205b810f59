"""miaohui.generation.build.graph_cse on a graph shaped like an exported decoder's repeated layers: the shape
arithmetic each layer rebuilds from the same scalars, with its own copies of the same constants, runs once, and ONNX
Runtime computes the same numbers from the merged graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from miaohui.generation.build.graph_cse import merge_common


def _layered(layers: int) -> onnx.ModelProto:
    """x [b, n*4] → per layer: reshape to [b, n, 4] through Shape/Gather/Unsqueeze/Concat with the layer's own
    constants, add the layer's weight, reshape back; plus a RandomUniformLike that must stay twice."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
    ]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero")]
    h = "x"
    for i in range(layers):
        inits += [
            numpy_helper.from_array(np.array([0], np.int64), f"onnx::axes_{i}"),  # equal values, other names
            numpy_helper.from_array(np.array([-1, 4], np.int64), f"onnx::tail_{i}"),
            numpy_helper.from_array(np.array([-1], np.int64), f"/layer_{i}/flat"),
            numpy_helper.from_array(np.full((4,), float(i > 0), np.float32), f"w_{i}"),  # weights, equal from 1 on
        ]
        nodes += [
            helper.make_node("Unsqueeze", ["batch", f"onnx::axes_{i}"], [f"b_{i}"]),
            helper.make_node("Concat", [f"b_{i}", f"onnx::tail_{i}"], [f"target_{i}"], axis=0),
            helper.make_node("Reshape", [h, f"target_{i}"], [f"r_{i}"]),
            helper.make_node("Add", [f"r_{i}", f"w_{i}"], [f"a_{i}"]),
            helper.make_node("Concat", [f"b_{i}", f"/layer_{i}/flat"], [f"back_{i}"], axis=0),
            helper.make_node("Reshape", [f"a_{i}", f"back_{i}"], [f"h_{i}"]),
        ]
        h = f"h_{i}"
    nodes += [
        helper.make_node("RandomUniformLike", [h], ["noise_a"], seed=1.0),
        helper.make_node("RandomUniformLike", [h], ["noise_b"], seed=1.0),
        helper.make_node("Identity", [h], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", 8]) for n in ("y", "noise_a", "noise_b")]
    graph = helper.make_graph(nodes, "layers", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_repeated_shape_arithmetic_runs_once_with_the_same_numbers() -> None:
    model = _layered(5)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})
    before = len(model.graph.node)
    merged = merge_common(model.graph)
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    # per layer 6 nodes → the first layer's 6, then 3 (Reshape, Add, Reshape) per further layer
    assert merged == {"nodes": 4 * 3, "initializers": 4 * 3}
    assert len(ops) == before - 12 and ops.count("Unsqueeze") == 1 and ops.count("Concat") == 2
    assert ops.count("Add") == 5 and ops.count("RandomUniformLike") == 2  # each its weight; random stays random
    assert {f"w_{i}" for i in range(5)} <= {t.name for t in model.graph.initializer}  # the model's own names stay
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})
    np.testing.assert_array_equal(got[0], want[0])


def test_a_node_that_makes_a_graph_output_is_kept() -> None:
    a = helper.make_node("Neg", ["x"], ["first"])
    b = helper.make_node("Neg", ["x"], ["second"])  # equal to a, but a graph output of its own
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("first", "second")]
    graph = helper.make_graph([a, b], "g", [x], outs)
    assert merge_common(graph) == {"nodes": 0, "initializers": 0}
    assert [n.output[0] for n in graph.node] == ["first", "second"]
