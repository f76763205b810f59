"""Block-quantized weights with fp32 arithmetic: the ``q4`` decoder recipe of the ONNX Runtime backend.

The layer weights are stored as llama.cpp's ``Q4_1`` stores them: blocks of 32 values along the input dimension,
each block ``scale * q + min`` with ``q`` in 0..15 (a scale and a minimum per block). The LM head is stored as
``Q8_0``: blocks of 32, ``scale * q`` with ``q`` in -127..127. Unlike llama.cpp, which also rounds the
*activations* to 8 bits before its dot products, every layer product here is computed in fp32 from the dequantized
weight: the only error is the weights' rounding. A model whose weights already lie on these grids (a GGUF
converted to fp32, as the shipped SmolLM2 is) is therefore reproduced up to fp32 summation order.

The head is the exception, and only below its top: every logit is first computed with int8 dot products (ORT's
fast 8-bit path, which rounds the activations as llama.cpp does), then the :data:`HEAD_EXACT_TOP` largest are
computed again in fp32 from the same blocks and written over the rounded ones (:func:`rescored_head`). The greedy
pick and the top log-probabilities are the fp32 head's; the logits below the top carry the activations' rounding.
On SmolLM2's 576 x 49,152 head that is 0.9 ms a step against 2.3 ms for the head in fp32 (two 4-bit halves).

ONNX Runtime's ``MatMulNBits`` takes integer zero points only, and a ``Q4_1`` minimum is not a multiple of its
block's scale. So each MatMul ``x @ W`` becomes ``MatMulNBits(x, q, scale)`` (implicit zero point 8) plus a small
correction ``(x @ E) @ M``: ``E`` sums ``x`` over each block of 32 (a K x K/32 matrix of ones) and ``M`` holds
each block's ``min + 8 * scale`` (K/32 x N, fp32; an eighth of the packed weights' bytes).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

BLOCK = 32
"""Values per block along the input dimension (llama.cpp's ``QK4_1`` / ``QK8_0``)."""
ACCURACY_FP32 = 1
"""``MatMulNBits`` ``accuracy_level`` 1: dequantize to fp32 and multiply in fp32 (4 would round activations)."""
ACCURACY_INT8 = 4
"""``MatMulNBits`` ``accuracy_level`` 4: activations rounded to 8 bits per block, int8 dot products."""
HEAD_EXACT_TOP = 256
"""Logits of each row that the head computes again in fp32 (the largest, by the int8 pass). The greedy pick, OpenAI's
``top_logprobs`` (at most 20) and, in practice, what temperature / top-p sampling draws from lie within them (the int8
pass moves SmolLM2's logits by up to ~0.4, so the fp32 winner is far inside its top 256). 256 instead of 64 costs
0.1 ms a step on SmolLM2; 1,024 would cost 0.7."""


def q4_affine(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w`` (K x N fp32) in ``Q4_1``'s layout: (``q`` N x K/32 x 32 uint8 in 0..15, ``scale`` N x K/32,
    ``offset`` N x K/32) with ``w[k, n] ≈ scale * (q - 8) + offset`` for ``k`` in its block."""
    k, n = w.shape
    blocks = w.T.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    lo, hi = blocks.min(-1), blocks.max(-1)
    scale = (hi - lo) / 15
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint((blocks - lo[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return q, safe, (lo + 8 * safe).astype(np.float32)


def q8_symmetric(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w`` (K x N) in ``Q8_0``'s layout: (``q`` N x K/32 x 32 uint8 holding ``q8 + 128``, ``scale`` N x K/32),
    ``w[k, n] ≈ scale * (q - 128)``."""
    k, n = w.shape
    blocks = w.T.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    scale = np.abs(blocks).max(-1) / 127
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int16) + 128
    return q.astype(np.uint8), safe


def pack_4bit(q: np.ndarray) -> np.ndarray:
    """N x blocks x 32 values in 0..15 → N x blocks x 16 bytes, the first value of a pair in the low nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def dequantized_q4(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The K x N fp32 weight :func:`q4_affine`'s parts stand for (the reference the tests compare with)."""
    n, nb, _ = q.shape
    w = scale[..., None] * (q.astype(np.float32) - 8) + offset[..., None]
    return np.ascontiguousarray(w.reshape(n, nb * BLOCK).T)


def quantize_blocks_model(model: Any, is_head: Callable[[str], bool] = lambda name: name == "head") -> dict[str, int]:
    """Rewrite ``model`` (an ``onnx.ModelProto`` of an exported decoder) in place: every ``MatMul`` whose second
    input is a K x N initializer with K a multiple of 32 becomes 4-bit affine blocks, or 8-bit symmetric blocks
    where ``is_head(name)`` (computed by :func:`rescored_head`). Counts of rewritten MatMuls by kind (``q4``,
    ``q8``) and of MatMuls ``kept``."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    counts = {"q4": 0, "q8": 0, "kept": 0}
    nodes: list[Any] = []
    dropped: set[str] = set()
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2 or weight.dims[0] % BLOCK:
            counts["kept"] += weight is not None
            nodes.append(node)
            continue
        w = numpy_helper.to_array(weight)
        k, n = w.shape
        name, x = weight.name, node.input[0]
        dropped.add(name)
        if is_head(name):
            q8, scale = q8_symmetric(w)
            graph.initializer.extend([
                numpy_helper.from_array(q8, f"{name}.q8"), numpy_helper.from_array(scale, f"{name}.q8.scale"),
            ])  # fmt: skip
            nodes += rescored_head(x, f"{name}.q8", f"{name}.q8.scale", node.output[0], k, n, graph.initializer)
            counts["q8"] += 1
            continue
        q, scale, offset = q4_affine(w)
        counts["q4"] += 1
        blocks, sums, corr = f"{node.name}.q4", f"{node.name}.sums", f"{node.name}.corr"
        ones = np.repeat(np.eye(k // BLOCK, dtype=np.float32), BLOCK, axis=0)  # K x K/32: sums each block
        graph.initializer.extend([
            numpy_helper.from_array(pack_4bit(q), f"{name}.q4"),
            numpy_helper.from_array(scale.reshape(-1).astype(np.float32), f"{name}.q4.scale"),
            numpy_helper.from_array(ones, f"{name}.block_sum"),
            numpy_helper.from_array(np.ascontiguousarray(offset.T), f"{name}.offset"),
        ])  # fmt: skip
        nodes += [
            helper.make_node("MatMulNBits", [x, f"{name}.q4", f"{name}.q4.scale"], [blocks], name=blocks,
                             domain="com.microsoft", K=k, N=n, bits=4, block_size=BLOCK, accuracy_level=ACCURACY_FP32),
            helper.make_node("MatMul", [x, f"{name}.block_sum"], [sums], name=sums),
            helper.make_node("MatMul", [sums, f"{name}.offset"], [corr], name=corr),
            helper.make_node("Add", [blocks, corr], [node.output[0]], name=f"{node.output[0]}.add"),
        ]  # fmt: skip
    still_used = {i for nd in nodes for i in nd.input}
    kept = [i for i in graph.initializer if i.name not in dropped or i.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return counts


def rescored_head(x: str, q8: str, scale: str, out: str, k: int, n: int, initializers: Any) -> list[Any]:
    """Nodes computing ``out = x @ W`` for an 8-bit head ``W`` (``q8``: N x K/32 x 32 uint8 holding ``q + 128``,
    ``scale``: N x K/32) over ``x`` [..., K]: every logit with int8 dot products (``MatMulNBits``, accuracy level 4,
    implicit zero point 128), then the :data:`HEAD_EXACT_TOP` largest of each row again in fp32 from the gathered
    blocks, scattered over the first. Adds its constants to ``initializers``."""
    from onnx import TensorProto, helper, numpy_helper

    top = min(HEAD_EXACT_TOP, n)

    def name(part: str) -> str:
        return f"{out}.{part}"

    initializers.extend([
        numpy_helper.from_array(np.array([top], np.int64), name("top")),
        numpy_helper.from_array(np.array(128, np.float32), name("zero")),
        numpy_helper.from_array(np.array([-1], np.int64), name("last")),
        numpy_helper.from_array(np.array([k], np.int64), name("k")),
    ])  # fmt: skip
    return [
        helper.make_node("MatMulNBits", [x, q8, scale], [name("int8")], name=name("int8"), domain="com.microsoft",
                         K=k, N=n, bits=8, block_size=BLOCK, accuracy_level=ACCURACY_INT8),
        helper.make_node("TopK", [name("int8"), name("top")], [name("top_values"), name("top_ids")], axis=-1),
        helper.make_node("Gather", [q8, name("top_ids")], [name("blocks")], axis=0),  # [..., top, K/32, 32]
        helper.make_node("Gather", [scale, name("top_ids")], [name("scales")], axis=0),  # [..., top, K/32]
        helper.make_node("Cast", [name("blocks")], [name("blocks_f")], to=TensorProto.FLOAT),
        helper.make_node("Sub", [name("blocks_f"), name("zero")], [name("centred")]),
        helper.make_node("Unsqueeze", [name("scales"), name("last")], [name("scales_1")]),
        helper.make_node("Mul", [name("centred"), name("scales_1")], [name("rows_blocks")]),
        helper.make_node("Shape", [name("top_ids")], [name("lead")]),
        helper.make_node("Concat", [name("lead"), name("k")], [name("rows_shape")], axis=0),
        helper.make_node("Reshape", [name("rows_blocks"), name("rows_shape")], [name("rows")]),  # [..., top, K]
        helper.make_node("Unsqueeze", [x, name("last")], [name("x_col")]),  # [..., K, 1]
        helper.make_node("MatMul", [name("rows"), name("x_col")], [name("exact_col")]),
        helper.make_node("Squeeze", [name("exact_col"), name("last")], [name("exact")]),
        helper.make_node("ScatterElements", [name("int8"), name("top_ids"), name("exact")], [out], axis=-1),
    ]  # fmt: skip


def one_row_switch(one_row: Any, batched: Any, *, unpadded_only: bool = False) -> Any:
    """One decoder graph of the two: ``If(Size(input_ids) == 1)`` runs ``one_row`` (a stream's decode step), else
    ``batched`` (prefills, batched decodes); with ``unpadded_only`` also only where ``attention_mask`` is all ones (the
    fused graph takes positions from lengths: a row whose cache holds padding runs ``batched``). Both take the same
    inputs and give the same outputs. One session, so one thread pool: two sessions' pools, each spinning after its own
    steps, slowed a prefill that followed decode steps from 69 to 102–110 ms on a 2-core CPU. An initializer both graphs
    hold (same name, same bytes: the token embedding, norms, the KV-head constants) is stored once, in the outer graph,
    where both branches read it: on SmolLM2 the embedding alone is 113 MB, on disk and in the session's memory."""
    from onnx import TensorProto, helper

    outputs = [o.name for o in one_row.graph.output]

    theirs = {t.name: t for t in batched.graph.initializer}
    shared = [t for t in one_row.graph.initializer if t.name in theirs and t == theirs[t.name]]
    shared_names = {t.name for t in shared}

    def branch(model: Any, tag: str) -> Any:
        rename = {name: f"{tag}/{name}" for name in outputs}  # a branch may not redefine the outer graph's names
        for node in model.graph.node:
            for i, name in enumerate(node.output):
                node.output[i] = rename.get(name, name)
            for i, name in enumerate(node.input):
                node.input[i] = rename.get(name, name)
        outs = []
        for value in model.graph.output:
            out = copy.deepcopy(value)
            out.name = rename[value.name]
            outs.append(out)
        own = [t for t in model.graph.initializer if t.name not in shared_names]
        return helper.make_graph(list(model.graph.node), tag, [], outs, own)

    nodes = [
        helper.make_node("Size", ["input_ids"], ["ids_count"]),
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.INT64, [], [1])),
        helper.make_node("Equal", ["ids_count", "one"], ["one_token" if unpadded_only else "one_row"]),
    ]
    if unpadded_only:
        nodes += [
            helper.make_node("ReduceMin", ["attention_mask"], ["mask_min"], keepdims=0),  # int64, as "one"
            helper.make_node("Equal", ["mask_min", "one"], ["unpadded"]),
            helper.make_node("And", ["one_token", "unpadded"], ["one_row"]),
        ]
    nodes += [
        helper.make_node(
            "If", ["one_row"], outputs, then_branch=branch(one_row, "one_row"), else_branch=branch(batched, "batched")
        ),
    ]
    graph = helper.make_graph(nodes, "decoder", list(one_row.graph.input), list(one_row.graph.output), shared)
    opsets = {(o.domain, o.version) for o in [*one_row.opset_import, *batched.opset_import]}
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets)])
    model.ir_version = one_row.ir_version
    return model


PROTOBUF_LIMIT = 1_800_000_000
"""Initializer bytes above which a graph is saved with its weights in a ``.data`` file beside it (protobuf refuses
messages over 2 GiB; the margin leaves room for the graph itself)."""


def initializer_bytes(graph: Any) -> int:
    """Bytes of ``graph``'s initializers, those of its subgraphs (an ``If``'s branches) included."""
    total = sum(len(t.raw_data) or t.ByteSize() for t in graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                total += initializer_bytes(attr.g)
    return total


def save_graph(model: Any, path: Any, limit: int = PROTOBUF_LIMIT) -> None:
    """Save ``model`` to ``path``; over ``limit`` initializer bytes, its weights go to ``<name>.data`` next to it."""
    import onnx

    if initializer_bytes(model.graph) <= limit:
        onnx.save(model, str(path))
        return
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=f"{path.name}.data", size_threshold=0)  # fmt: skip
