"""Before building: which nodes of a graph has the installed ONNX Runtime no CPU kernel for? Reported by node name.

The check per backend, and the error a build raises, are :mod:`miaohui.engines.support`'s."""

from __future__ import annotations

import functools
from pathlib import Path

import onnx

_NO_KERNEL_NEEDED = {"Constant"}  # folded into initializers when the session is created


@functools.lru_cache(maxsize=1)
def _ort_cpu_kernels() -> dict[tuple[str, str], list[tuple[int, int]]]:
    """(domain, op) → opset version ranges with a CPU kernel in the installed ONNX Runtime."""
    from onnxruntime.capi import _pybind_state as C

    kernels: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for k in C.get_all_opkernel_def():
        if k.provider != "CPUExecutionProvider":
            continue
        domain = "" if k.domain in ("", "ai.onnx") else k.domain
        kernels.setdefault((domain, k.op_name), []).append(k.version_range)
    return kernels


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain in ("", "ai.onnx") else o.domain): o.version for o in model.opset_import}


def ort_unsupported_nodes(onnx_path: Path) -> list[tuple[str, str]]:
    """(node name, domain:op) of nodes without an ONNX Runtime CPU kernel for the model's opset."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    opsets = _opsets(model)
    kernels = _ort_cpu_kernels()
    bad = []
    for node in model.graph.node:
        if node.op_type in _NO_KERNEL_NEEDED and node.domain in ("", "ai.onnx"):
            continue
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        version = opsets.get(domain, 1)
        ranges = kernels.get((domain, node.op_type), [])
        if not any(lo <= version <= hi for lo, hi in ranges):
            bad.append((node.name or "(unnamed)", f"{domain + ':' if domain else ''}{node.op_type}"))
    return bad
