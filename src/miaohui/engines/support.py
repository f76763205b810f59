"""Before building: which nodes of a graph can the chosen backend not run? Reported by node name.

ONNX Runtime's check reads its kernel registry (:func:`miaohui.compile.inspect.ort_unsupported_nodes`);
TensorRT's asks its ONNX parser (:func:`miaohui.engines.tensorrt_builder.unsupported_nodes`); other backends run
every exported node.
"""

from __future__ import annotations

from pathlib import Path

from miaohui.compile.inspect import ort_unsupported_nodes
from miaohui.errors import UnsupportedOperatorError


def unsupported_nodes(onnx_path: Path, backend: str) -> list[tuple[str, str]]:
    if backend == "onnxruntime":
        return ort_unsupported_nodes(onnx_path)
    if backend in ("tensorrt", "tensorrt-rtx"):
        from miaohui.engines.tensorrt_builder import unsupported_nodes as trt_unsupported

        return trt_unsupported(onnx_path, backend)  # type: ignore[arg-type]
    return []


def require_supported(onnx_path: Path, backend: str) -> None:
    """Raise :class:`UnsupportedOperatorError` naming every node the backend cannot run."""
    bad = unsupported_nodes(onnx_path, backend)
    if bad:
        listed = ", ".join(f"{name} ({op})" for name, op in bad[:20])
        more = f" and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise UnsupportedOperatorError(
            f"{len(bad)} node(s) of {onnx_path.name} are not supported by {backend}: {listed}{more}",
            "export with a different opset, replace those operators, or choose another --backend",
        )
