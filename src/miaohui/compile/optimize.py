"""Graph-level fusion for ONNX Runtime (attention, layer norm, GELU, embedding) — the ORT transformer optimizer."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx


def fuse_bert(onnx_path: Path, out_path: Path, num_heads: int, hidden_size: int, attention: bool = True) -> Path:
    """Fuse a BERT-style graph into ORT's contrib ops.

    ``attention=False`` keeps attention as plain MatMul/Softmax so that the Q/K/V projections stay
    ordinary MatMuls that the int8 QDQ pass can quantize. The result only runs on ONNX Runtime.
    """
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("bert")
    options.enable_attention = attention
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    model = optimize_model(
        str(onnx_path),
        model_type="bert",
        num_heads=num_heads,
        hidden_size=hidden_size,
        optimization_options=options,
        opt_level=0,
    )
    model.save_model_to_file(str(out_path))
    return out_path


def op_counts(onnx_path: Path) -> dict[str, int]:
    """How many nodes of each op type the graph holds (for manifests and reports)."""
    counts: dict[str, int] = {}
    for node in onnx.load(str(onnx_path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
