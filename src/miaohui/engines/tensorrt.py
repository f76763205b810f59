"""TensorRT and TensorRT-RTX: one builder/runtime code path for both libraries.

``tensorrt`` (full TensorRT 10+) and ``tensorrt_rtx`` (TensorRT for RTX) share the Python API used here:
``Builder`` / ``OnnxParser`` / ``IBuilderConfig`` / ``IOptimizationProfile`` / ``Runtime`` /
``IExecutionContext.execute_async_v3``. The code branches on the flavor in few, marked places:

* :func:`trt_module` — the module name (``tensorrt`` vs ``tensorrt_rtx``) and install hint.
* the builder's ``_resolve_target`` — TensorRT-RTX builds ahead of time on CPU for a chosen compute
  capability (``IBuilderConfig.set_compute_capability``, an RTX-only API); full TensorRT has no such API and
  builds for the GPU it runs on, so it needs that GPU at build time.
* the runtime's ``_check_header`` / ``inspect_engine`` — the RTX plan header (magic ``vtrt``) is decoded on
  CPU; full TensorRT plans are only size-checked.
* ``Runtime.get_engine_validity`` (RTX-only) is used when present (feature-detected, not flavor-checked).

Precision is a property of the graph (ARCHITECTURE.md): networks are always created STRONGLY_TYPED —
TensorRT-RTX only has strongly typed networks, and TensorRT 11 removed the FP16/BF16/INT8 builder flags —
so fp16 comes from casting the ONNX graph (done here when the graph is still fp32), bf16 from a graph that
is already cast, and int8 from explicit QuantizeLinear/DequantizeLinear nodes.

The code is in three modules, as Polygraphy separates loader from runner: this one holds what builder and
runtime share (the module, its logger, GPU facts); :mod:`miaohui.engines.tensorrt_builder` parses ONNX and
builds a serialized engine (the ``tensorrt`` / ``tensorrt-rtx`` backend's build step);
:mod:`miaohui.engines.tensorrt_runtime` reads plan headers, deserializes and runs an engine
(``TensorRTEngine``).

``tensorrt`` / ``tensorrt_rtx`` / ``torch`` / ``rich`` are imported lazily, never at module import time.
"""

from __future__ import annotations

import importlib
import logging
import threading
from pathlib import Path
from typing import Any, Literal

from miaohui.engines.target import cuda_target
from miaohui.errors import BackendUnavailableError, BuildError, ConfigError

Flavor = Literal["tensorrt", "tensorrt-rtx"]

MODULES: dict[str, str] = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}
NAMES: dict[str, str] = {"tensorrt": "TensorRT", "tensorrt-rtx": "TensorRT-RTX"}
_INSTALL: dict[str, str] = {
    "tensorrt-rtx": "install it with `pip install tensorrt-rtx-cu13` (tensorrt-rtx-cu12 for CUDA 12)",
    "tensorrt": "full TensorRT 10+ is not on this project's package index; install NVIDIA TensorRT on a GPU "
    "machine (`pip install tensorrt` from pypi.nvidia.com, or the NVIDIA tarball), or use "
    "--backend tensorrt-rtx, which is installed here and builds ahead of time on CPU",
}
DTYPES: dict[str, str] = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "UINT8": "uint8",
    "FP8": "float8",
    "INT4": "int4",
    "FP4": "float4",
}

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- module


def trt_module(flavor: Flavor) -> Any:
    """Import and return ``tensorrt`` or ``tensorrt_rtx``; :class:`BackendUnavailableError` if missing."""
    if flavor not in MODULES:
        raise ConfigError(f"unknown TensorRT flavor {flavor!r}", "use 'tensorrt' or 'tensorrt-rtx'")
    try:
        trt = importlib.import_module(MODULES[flavor])
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend {flavor} needs the Python module {MODULES[flavor]!r}, which is not importable ({exc})",
            _INSTALL[flavor],
        ) from None
    # Branch: full TensorRT must be 10+ (strongly typed networks, execute_async_v3, IProgressMonitor).
    if flavor == "tensorrt" and int(str(trt.__version__).split(".")[0]) < 10:
        raise BackendUnavailableError(f"TensorRT {trt.__version__} is too old for miaohui", "install TensorRT 10+")
    return trt


def backend_version(flavor: Flavor) -> str:
    """Version string of the installed library, e.g. ``1.7.1.116`` for TensorRT-RTX."""
    return str(trt_module(flavor).__version__)


class _Log:
    """Collects TensorRT log messages so errors can be quoted in miaohui's exceptions."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def begin(self) -> None:
        self.errors.clear()

    def tail(self, n: int = 6) -> str:
        return " | ".join(m.strip() for m in self.errors[-n:]) or "no error message from the library"


_LOGGERS: dict[str, Any] = {}
_LOGGER_LOCK = threading.Lock()


def trt_logger(trt: Any) -> Any:
    """One logger per module for the whole process (TensorRT keeps the first logger it is given)."""
    with _LOGGER_LOCK:
        if trt.__name__ not in _LOGGERS:

            class _Collector(trt.ILogger):
                def __init__(self) -> None:
                    trt.ILogger.__init__(self)
                    self.sink = _Log()

                def log(self, severity: Any, msg: str) -> None:
                    if int(severity) <= int(trt.ILogger.Severity.ERROR):
                        self.sink.errors.append(msg)
                    log.debug("%s [%s] %s", trt.__name__, severity, msg)

            _LOGGERS[trt.__name__] = _Collector()
        return _LOGGERS[trt.__name__]


def require_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise BuildError(f"{what} {path} does not exist", "export the model to ONNX first (miaohui export)")


def local_gpu() -> tuple[str, str] | None:
    """(compute capability ``smXY``, name) of the current CUDA GPU, or None where there is none."""
    gpu = cuda_target()
    return (gpu.compute_capability or "", gpu.gpu_name or "") if gpu else None


def rtx_targets(trt: Any) -> dict[str, Any]:
    """TensorRT-RTX's buildable compute capabilities (``sm75`` …) → ``ComputeCapability`` member."""
    members = trt.ComputeCapability.__members__
    return {f"sm{name[2:].lower()}": m for name, m in members.items() if name.startswith("SM")}
