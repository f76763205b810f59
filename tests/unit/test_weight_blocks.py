"""The ``int4`` decoder recipe's weight blocks: exact on weights that lie on Q4_1 / Q8_0 grids, and the rewritten
ONNX graph (``MatMulNBits`` plus the correction term) computing ``x @ W`` on a real ONNX Runtime session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from miaohui.generation.build.weight_blocks import (
    BLOCK,
    HEAD_EXACT_TOP,
    dequantized_q4,
    initializer_bytes,
    one_row_switch,
    pack_4bit,
    q4_affine,
    q8_symmetric,
    quantize_blocks_model,
    save_graph,
)

RNG = np.random.default_rng(7)


def _q4_grid(k: int, n: int) -> np.ndarray:
    """A K x N weight whose every block of 32 along K is ``d * q + m`` with q in 0..15, 0 and 15 both used (what
    llama.cpp's Q4_1 dequantizes to)."""
    q = RNG.integers(0, 16, size=(n, k // BLOCK, BLOCK))
    q[..., 0], q[..., 1] = 0, 15
    d = RNG.uniform(0.001, 0.05, size=(n, k // BLOCK, 1)).astype(np.float32)
    m = RNG.uniform(-0.4, 0.0, size=(n, k // BLOCK, 1)).astype(np.float32)
    return np.ascontiguousarray((d * q + m).astype(np.float32).reshape(n, k).T)


def test_q4_affine_reproduces_weights_on_a_q4_1_grid() -> None:
    w = _q4_grid(96, 40)
    q, scale, offset = q4_affine(w)
    assert q.shape == (40, 3, BLOCK) and q.max() == 15 and q.min() == 0
    np.testing.assert_allclose(dequantized_q4(q, scale, offset), w, rtol=0, atol=1e-6)


def test_q4_affine_error_on_arbitrary_weights_is_half_a_step() -> None:
    w = RNG.standard_normal((64, 16)).astype(np.float32)
    q, scale, offset = q4_affine(w)
    err = np.abs(dequantized_q4(q, scale, offset) - w)
    step = np.repeat(scale, BLOCK, axis=1).T  # K x N, each value's block scale
    assert (err <= step / 2 + 1e-6).all()
    assert err.max() > 0  # not on a grid: the rounding is real


def test_pack_4bit_puts_the_first_value_in_the_low_nibble() -> None:
    q = np.array([[[1, 2, 15, 0] * 8]], dtype=np.uint8)
    packed = pack_4bit(q)
    assert packed.shape == (1, 1, 16)
    assert list(packed[0, 0, :2]) == [0x21, 0x0F]


def _graph(weights: dict[str, np.ndarray], k: int) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", name], [f"y_{name}"], name=f"mm_{name}") for name in weights]
    outs = [helper.make_tensor_value_info(f"y_{n}", TensorProto.FLOAT, None) for n in weights]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])], outs,
        [numpy_helper.from_array(w, name) for name, w in weights.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.mark.parametrize("rows", [1, 5])
def test_rewritten_graph_computes_the_layers_in_fp32_and_the_heads_top_in_fp32(rows: int) -> None:
    k, vocab = 96, 300
    layer = _q4_grid(k, 48)
    q8 = RNG.integers(-127, 128, size=(vocab, k // BLOCK, BLOCK))
    q8[..., 0] = 127  # the block's largest magnitude sets its scale, as Q8_0 does
    s8 = RNG.uniform(0.001, 0.02, size=(vocab, k // BLOCK, 1)).astype(np.float32)
    head = np.ascontiguousarray((s8 * q8).astype(np.float32).reshape(vocab, k).T)
    odd = RNG.standard_normal((20, 8)).astype(np.float32)  # K not a multiple of 32: kept as it is
    model = _graph({"layer": layer, "head": head}, k)
    counts = quantize_blocks_model(model)
    assert counts == {"q4": 1, "q8": 1, "kept": 0}
    assert "MatMulNBits" in {n.op_type for n in model.graph.node}
    assert not {"layer", "head"} & {i.name for i in model.graph.initializer}  # the fp32 copies are gone
    x = RNG.standard_normal((rows, 3, k)).astype(np.float32)
    got_layer, got_head = _run(model, x)
    np.testing.assert_allclose(got_layer, x @ layer, rtol=1e-4, atol=1e-4)
    want = x @ head
    # the largest logits are fp32 (the int8 pass ranks the fp32 top 32 within its top 64; near its 64th, not always)
    top = np.argsort(-want, axis=-1)[..., : HEAD_EXACT_TOP // 2]
    np.testing.assert_allclose(
        np.take_along_axis(got_head, top, -1), np.take_along_axis(want, top, -1), rtol=1e-4, atol=1e-4
    )
    tail = np.abs(got_head - want).max()  # the rest: int8-rounded activations, not fp32
    assert 1e-4 < tail < 0.05 * np.abs(want).max()
    assert (got_head.argmax(-1) == want.argmax(-1)).all()
    assert quantize_blocks_model(kept := _graph({"odd": odd}, 20)) == {"q4": 0, "q8": 0, "kept": 1}
    assert [n.op_type for n in kept.graph.node] == ["MatMul"]


def test_q8_symmetric_round_trips_a_q8_0_grid() -> None:
    q = RNG.integers(-127, 128, size=(4, 2, BLOCK))
    q[..., 3] = -127
    s = RNG.uniform(0.01, 0.1, size=(4, 2, 1)).astype(np.float32)
    w = np.ascontiguousarray((s * q).astype(np.float32).reshape(4, 64).T)
    stored, scale = q8_symmetric(w)
    back = (scale[..., None] * (stored.astype(np.float32) - 128)).reshape(4, 64).T
    np.testing.assert_allclose(back, w, rtol=0, atol=1e-6)


def _scaled_ids(factor: float) -> onnx.ModelProto:
    """input_ids → (logits = ids * factor, present = logits + 1): a stand-in decoder whose outputs feed each other."""
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["ids_f", "k"], ["logits"]),
        helper.make_node("Add", ["logits", "k"], ["present"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s"]) for n in ("logits", "present")],
        [numpy_helper.from_array(np.array(factor, np.float32), "k")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_one_row_switch_runs_the_one_row_graph_only_for_a_single_token() -> None:
    model = one_row_switch(_scaled_ids(2.0), _scaled_ids(3.0))
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    logits, present = session.run(None, {"input_ids": np.array([[5]])})
    assert logits.tolist() == [[10.0]] and present.tolist() == [[12.0]]
    for ids in (np.array([[5, 6]]), np.array([[5], [6]])):  # a prefill, a batched decode
        logits, _ = session.run(None, {"input_ids": ids})
        assert logits.ravel().tolist() == [15.0, 18.0]


def test_one_row_switch_stores_a_weight_both_graphs_hold_once() -> None:
    model = one_row_switch(_scaled_ids(2.0), _scaled_ids(2.0))  # the same "k" in both: the outer graph holds it
    onnx.checker.check_model(model)
    assert [t.name for t in model.graph.initializer] == ["k"]
    branches = [a.g for a in model.graph.node[-1].attribute]
    assert [len(g.initializer) for g in branches] == [0, 0]
    assert initializer_bytes(model.graph) == 4
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, {"input_ids": np.array([[5]])})[0].tolist() == [[10.0]]
    assert session.run(None, {"input_ids": np.array([[5, 6]])})[0].ravel().tolist() == [10.0, 12.0]


def test_a_graph_over_the_limit_is_saved_with_its_weights_beside_it(tmp_path: Path) -> None:
    model = one_row_switch(_scaled_ids(2.0), _scaled_ids(3.0))
    assert initializer_bytes(model.graph) == 8  # one fp32 scalar in each branch
    save_graph(model, tmp_path / "small.onnx")
    assert [p.name for p in tmp_path.iterdir()] == ["small.onnx"]
    (tmp_path / "big").mkdir()
    save_graph(model, tmp_path / "big" / "model.onnx", limit=4)
    assert sorted(p.name for p in (tmp_path / "big").iterdir()) == ["model.onnx", "model.onnx.data"]
    session = ort.InferenceSession(str(tmp_path / "big" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.run(None, {"input_ids": np.array([[5]])})[0].tolist() == [[10.0]]
