"""Common-subexpression elimination on an exported ONNX graph: each distinct computation once.

``torch.onnx.export`` traces every decoder layer separately, so each layer rebuilds the same reshape targets from the
batch and length scalars (``Unsqueeze`` → ``Concat`` → ``Reshape``), each with its own copy of the same small
constants (``onnx::Unsqueeze_655`` and ``onnx::Unsqueeze_653`` both hold ``[0]``). ONNX Runtime's own
common-subexpression pass compares inputs by name, so it keeps them all: on SmolLM2 (30 layers) the one-row decode
graph ran 398 ``Unsqueeze`` and 286 ``Concat`` nodes a step, a third of its 2,215, where a step on 2 CPU cores costs
about 10 ms and most of what is not a matrix product is per-node overhead.

:func:`merge_common` first gives equal small constants (initializers and ``Constant`` nodes of at most
:data:`SMALL` elements) one name, then drops every node whose operator, attributes and (renamed) inputs equal an
earlier node's, pointing its consumers at the earlier outputs. Nodes with subgraphs or random outputs, and nodes
producing a graph output, are kept. The numbers the graph computes do not change.
"""

from __future__ import annotations

import math
from typing import Any

SMALL = 64
"""Constants of at most this many elements are compared by value (shape constants, axes, scalars); larger ones
(weights) are never duplicated by the exporter and are not read."""

EXPORTER_NAMES = ("onnx::", "/")
"""Initializers named by the exporter (its folded constants) are merged by value; the model's own parameters (a
64-wide norm of ones, say) keep their names, which later passes look up (:mod:`~miaohui.generation.build.
one_row_graph`)."""

_NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Dropout"}


def _value_key(tensor: Any) -> tuple[Any, ...] | None:
    """(type, dims, bytes) of a small tensor, None for a large or externally stored one."""
    from onnx import numpy_helper

    if tensor.data_location == 1 or math.prod(tensor.dims) > SMALL:  # 1: EXTERNAL
        return None
    array = numpy_helper.to_array(tensor)
    return (tensor.data_type, tuple(tensor.dims), array.tobytes())


def merge_common(graph: Any) -> dict[str, int]:
    """Merge ``graph``'s (a GraphProto, changed in place) equal small constants (the exporter's: :data:`EXPORTER_NAMES`)
    and repeated nodes; how many of each were removed. Outer-scope names (in an ``If`` branch) are left as they are."""
    keep = {o.name for o in graph.output}
    alias: dict[str, str] = {}
    by_value: dict[tuple[Any, ...], str] = {}
    initializers = []
    for tensor in graph.initializer:
        key = _value_key(tensor) if tensor.name.startswith(EXPORTER_NAMES) else None
        if key is not None and key in by_value and tensor.name not in keep:
            alias[tensor.name] = by_value[key]
            continue
        if key is not None:
            by_value.setdefault(key, tensor.name)
        initializers.append(tensor)
    removed_constants = len(graph.initializer) - len(initializers)

    seen: dict[tuple[Any, ...], list[str]] = {}
    nodes = []
    removed_nodes = 0
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = alias.get(name, name)
        if any(a.HasField("g") or len(a.graphs) for a in node.attribute) or node.op_type in _NONDETERMINISTIC:
            nodes.append(node)
            continue
        if node.op_type == "Constant" and len(node.output) == 1 and node.output[0] not in keep:
            value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
            vkey = _value_key(value) if value is not None else None
            if vkey is not None:
                if vkey in by_value:
                    alias[node.output[0]] = by_value[vkey]
                    removed_nodes += 1
                    continue
                by_value[vkey] = node.output[0]
        key = (
            node.domain,
            node.op_type,
            tuple(node.input),
            tuple(a.SerializeToString(deterministic=True) for a in sorted(node.attribute, key=lambda a: a.name)),
        )
        earlier = seen.get(key)
        if earlier is not None and len(earlier) == len(node.output) and not keep.intersection(node.output):
            alias.update({new: old for new, old in zip(node.output, earlier, strict=True) if new})
            removed_nodes += 1
            continue
        seen.setdefault(key, list(node.output))
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return {"nodes": removed_nodes, "initializers": removed_constants}
