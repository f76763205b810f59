"""The decode step of one stream as a fused ONNX graph: ONNX Runtime's ``GroupQueryAttention`` per layer.

The exported decoder (:mod:`miaohui.generation.build.export`) spells attention out in primitive operators: for each
layer the Q/K/V split, reshapes and transposes into heads, RoPE on Q and K, the concatenation of the cache with the new
key and value, the grouped score product, the mask, softmax and the value product. On SmolLM2 (30 layers) that is
1,583 nodes a step after ONNX Runtime's optimizer, where the 4-bit weight products themselves take about half of an
8 ms step on 2 CPU cores: the rest is mostly per-node overhead.

:func:`fused_one_row` writes the same decoder from the exported graph's weights with one
``com.microsoft::GroupQueryAttention`` per layer (packed Q/K/V in, RoPE from cached cos/sin tables, past and present
key/value in the exported layout ``[batch, kv_heads, length, head_dim]``): 13 nodes a layer. It computes what the
exported graph computes, within fp32 summation order, for a batch whose rows have no padding: the kernel takes each
row's positions from its length, so :func:`~miaohui.generation.build.weight_blocks.one_row_switch` runs it only for
one row with an all-ones mask (a stream's decode step) and the exported graph otherwise.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from miaohui.generation.models.dims import DecoderDims

LAYER_WEIGHTS = ("in_norm", "post_norm", "qkv", "o", "gate_up", "down")
"""The exported graph's per-layer initializers (``layers.{i}.{name}``; ``qkv_bias`` too for Qwen2)."""


def fused_one_row(exported: Any, dims: DecoderDims, inv_freq: list[float]) -> Any | None:
    """A ``ModelProto`` of the fused decode graph for ``exported`` (the fp32 export of a Llama-family decoder: its
    inputs, outputs and initializer names), or None where ``exported`` is not one (another architecture's names)."""
    from onnx import TensorProto, helper, numpy_helper

    inits = {t.name: t for t in exported.graph.initializer}
    for node in exported.graph.node:  # the exporter's aliases of a parameter equal to another (Identity of it)
        if node.op_type == "Identity" and node.input[0] in inits:
            inits.setdefault(node.output[0], inits[node.input[0]])
    needed = ["embed", "norm", "head"] + [f"layers.{i}.{w}" for i in range(dims.num_layers) for w in LAYER_WEIGHTS]
    if any(name not in inits for name in needed):
        return None
    positions = np.arange(dims.max_positions, dtype=np.float32)
    angles = np.outer(positions, np.asarray(inv_freq, dtype=np.float32)).astype(np.float32)
    tables = [
        numpy_helper.from_array(np.cos(angles), "fused/rope.cos"),
        numpy_helper.from_array(np.sin(angles), "fused/rope.sin"),
    ]
    const = [
        numpy_helper.from_array(np.array([1], np.int64), "fused/axis_1"),
        numpy_helper.from_array(np.array(-1, np.int64), "fused/last"),
        numpy_helper.from_array(np.array(1, np.int64), "fused/one"),
    ]
    nodes = [
        # each row's length less one (the kernel's seqlens_k) and the longest (total_sequence_length)
        helper.make_node("ReduceSum", ["attention_mask", "fused/axis_1"], ["fused/row_len"], keepdims=0),
        helper.make_node("Sub", ["fused/row_len", "fused/one"], ["fused/row_last"]),
        helper.make_node("Cast", ["fused/row_last"], ["fused/seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["fused/mask_shape"], start=1, end=2),
        helper.make_node("Squeeze", ["fused/mask_shape"], ["fused/total_len64"]),
        helper.make_node("Cast", ["fused/total_len64"], ["fused/total_len"], to=TensorProto.INT32),
        helper.make_node("Gather", ["embed", "input_ids"], ["fused/x0"]),
    ]
    eps, x = float(dims.rms_eps), "fused/x0"
    half = [dims.intermediate, dims.intermediate]
    const.append(numpy_helper.from_array(np.array(half, np.int64), "fused/gate_up_split"))
    for i in range(dims.num_layers):
        w, p = f"layers.{i}.", f"fused/layers.{i}."
        qkv = f"{p}qkv.out"
        nodes += [
            helper.make_node("SimplifiedLayerNormalization", [x, f"{w}in_norm"], [f"{p}h"], axis=-1, epsilon=eps),
            helper.make_node("MatMul", [f"{p}h", f"{w}qkv"], [qkv if f"{w}qkv_bias" not in inits else f"{p}qkv.mm"]),
        ]
        if f"{w}qkv_bias" in inits:  # Qwen2
            nodes.append(helper.make_node("Add", [f"{p}qkv.mm", f"{w}qkv_bias"], [qkv]))
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        nodes += [
            helper.make_node(
                "GroupQueryAttention",
                [qkv, "", "", past_k, past_v, "fused/seqlens_k", "fused/total_len", "fused/rope.cos", "fused/rope.sin"],
                [f"{p}attn", f"present.{i}.key", f"present.{i}.value"],
                domain="com.microsoft",
                num_heads=dims.num_heads,
                kv_num_heads=dims.num_kv_heads,
                scale=float(dims.head_dim**-0.5),
                do_rotary=1,
            ),
            helper.make_node("MatMul", [f"{p}attn", f"{w}o"], [f"{p}o.out"]),
            helper.make_node("Add", [x, f"{p}o.out"], [f"{p}mid"]),
            helper.make_node(
                "SimplifiedLayerNormalization", [f"{p}mid", f"{w}post_norm"], [f"{p}h2"], axis=-1, epsilon=eps
            ),
            helper.make_node("MatMul", [f"{p}h2", f"{w}gate_up"], [f"{p}gu"]),
            helper.make_node("Split", [f"{p}gu", "fused/gate_up_split"], [f"{p}gate", f"{p}up"], axis=-1),
            helper.make_node("Sigmoid", [f"{p}gate"], [f"{p}sig"]),
            helper.make_node("Mul", [f"{p}gate", f"{p}sig"], [f"{p}silu"]),
            helper.make_node("Mul", [f"{p}silu", f"{p}up"], [f"{p}act"]),
            helper.make_node("MatMul", [f"{p}act", f"{w}down"], [f"{p}down.out"]),
            helper.make_node("Add", [f"{p}mid", f"{p}down.out"], [f"{p}x"]),
        ]
        x = f"{p}x"
    nodes += [
        helper.make_node("Gather", [x, "fused/last"], ["fused/x_last"], axis=1),  # [batch, hidden]: the last position's
        helper.make_node(
            "SimplifiedLayerNormalization", ["fused/x_last", "norm"], ["fused/x_normed"], axis=-1, epsilon=eps
        ),
        helper.make_node("MatMul", ["fused/x_normed", "head"], ["logits"]),
    ]
    biases = [f"layers.{i}.qkv_bias" for i in range(dims.num_layers) if f"layers.{i}.qkv_bias" in inits]
    weights = []
    for name in [*needed, *biases]:  # each under the name the nodes use (an alias's tensor copied under its own)
        tensor = inits[name]
        if tensor.name != name:
            tensor = copy.deepcopy(tensor)
            tensor.name = name
        weights.append(tensor)
    for index, node in enumerate(nodes):  # unique names: the 4-bit rewrite names its nodes after them
        node.name = f"fused/{node.op_type}_{index}"
    graph = helper.make_graph(
        nodes, "one_row", list(exported.graph.input), list(exported.graph.output), [*weights, *tables, *const]
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = exported.ir_version
    return model
