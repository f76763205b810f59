"""The TensorRT / TensorRT-RTX runtime: plan headers read on CPU, engines deserialized and run on the current
GPU (:class:`TensorRTEngine`), one code path for both flavors (:mod:`miaohui.engines.tensorrt`)."""

from __future__ import annotations

import hashlib
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np

from miaohui.engines.base import Engine, Manifest
from miaohui.engines.tensorrt import DTYPES, MODULES, NAMES, Flavor, local_gpu, rtx_targets, trt_logger, trt_module
from miaohui.errors import ArtifactError, BackendUnavailableError, ShapeError

_RTX_MAGIC = b"vtrt"
# TensorRT-RTX plan header: magic, plan bytes, version major/minor/patch/build, magic again, cc bitmask.
_RTX_HEADER = struct.Struct("<4s12xQBBBB4sQ")


# ---------------------------------------------------------------------------------------------- artifacts


def _check_header(flavor: Flavor, blob: bytes, path: Path) -> dict[str, Any]:
    """Read what the plan header tells on CPU; ArtifactError for empty/truncated files.

    The TensorRT-RTX header layout (magic ``vtrt``, plan size at byte 16, version bytes 24-27, compute
    capability bitmask at byte 32 in ComputeCapability order) was read off engines built by 1.7.1; it is
    undocumented, so it is used only when the magic matches. Full TensorRT plans are only size-checked.
    """
    if len(blob) < 64:
        raise ArtifactError(
            f"engine file {path} is {len(blob)} bytes: corrupt or truncated",
            "rebuild it with `miaohui build`",
        )
    if flavor != "tensorrt-rtx" or blob[:4] != _RTX_MAGIC:
        return {"format": "unknown plan header", "magic": blob[:4].hex()}
    _magic, declared, major, minor, patch, build, _, mask = _RTX_HEADER.unpack_from(blob)
    if declared != len(blob):
        raise ArtifactError(
            f"engine file {path} is {len(blob)} bytes but its header says {declared}: corrupt or truncated engine file",
            "rebuild it with `miaohui build`",
        )
    order = ["sm75", "sm80", "sm86", "sm89", "sm120", "sm121"]  # bit i = i-th SM member of ComputeCapability
    ccs = [cc for bit, cc in enumerate(order) if mask >> bit & 1]
    ccs += [f"bit{bit}" for bit in range(len(order), 64) if mask >> bit & 1]
    return {
        "format": "TensorRT-RTX plan",
        "built_with": f"{major}.{minor}.{patch}.{build}",
        "compute_capabilities": ccs,
    }


def inspect_engine(engine_path: Path, flavor: Flavor) -> dict[str, Any]:
    """What can be learned about a serialized engine here.

    Always: size, sha256 and the header (TensorRT-RTX: version and compute capabilities; truncation check).
    With a CUDA GPU: deserializes and lists layers and I/O tensors with their profile shapes. Without one,
    deserialization is impossible (the runtime needs CUDA) and ``deserialized`` is False with a note.
    """
    trt = trt_module(flavor)
    engine_path = Path(engine_path)
    if not engine_path.is_file():
        raise ArtifactError(f"engine file {engine_path} does not exist", "build it with `miaohui build`")
    blob = engine_path.read_bytes()
    info: dict[str, Any] = {
        "path": str(engine_path),
        "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "runtime_version": str(trt.__version__),
        **_check_header(flavor, blob, engine_path),
    }
    if "built_with" in info:
        info["matches_runtime_version"] = info["built_with"] == info["runtime_version"]
    if local_gpu() is None:
        info.update(deserialized=False, note="no CUDA GPU here: deserialization needs one; checked header and size")
        return info
    _runtime, engine = _deserialize(trt, blob, engine_path)
    info.update(
        deserialized=True,
        layers=int(engine.num_layers),
        io=[_tensor_info(trt, engine, i) for i in range(engine.num_io_tensors)],
    )
    return info


def _tensor_info(trt: Any, engine: Any, index: int) -> dict[str, Any]:
    name = engine.get_tensor_name(index)
    out: dict[str, Any] = {
        "name": name,
        "mode": engine.get_tensor_mode(name).name,
        "dtype": DTYPES.get(engine.get_tensor_dtype(name).name, "?"),
        "shape": list(engine.get_tensor_shape(name)),
    }
    if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
        out["profile"] = [list(s) for s in engine.get_tensor_profile_shape(name, 0)]
    return out


def _deserialize(trt: Any, blob: bytes, path: Path) -> tuple[Any, Any]:
    """Deserialize on the current GPU → (runtime, engine); ArtifactError naming the file when refused."""
    logger = trt_logger(trt)
    logger.sink.begin()
    runtime = trt.Runtime(logger)
    validity = getattr(runtime, "get_engine_validity", None)  # TensorRT-RTX only: header check with reasons
    if validity is not None:
        state, diag = validity(blob[: runtime.engine_header_size])
        if state == trt.EngineValidity.INVALID:
            reasons = [n for n, m in trt.EngineInvalidityDiagnostics.__members__.items() if int(diag) & int(m)]
            raise ArtifactError(
                f"engine file {path} cannot run on this GPU: {', '.join(reasons) or 'invalid'}",
                "rebuild it for this GPU with `miaohui build … --target <this GPU's smXY>`",
            )
    engine = runtime.deserialize_cuda_engine(blob)
    if engine is None:
        raise ArtifactError(
            f"corrupt or truncated engine file {path} ({logger.sink.tail()})",
            "rebuild it with `miaohui build`",
        )
    return runtime, engine  # the runtime must outlive the engine


# ---------------------------------------------------------------------------------------------- runtime


def _check_compatibility(
    flavor: Flavor,
    built_cc: str | None,
    built_version: str,
    gpu_cc: str,
    gpu_name: str,
    runtime_version: str,
    runnable: list[str] | None,
) -> None:
    """Refuse, before deserializing, an engine made for another GPU or library version (pure)."""
    name = NAMES[flavor]
    if runnable is not None and gpu_cc not in runnable:
        raise BackendUnavailableError(
            f"this GPU is {gpu_cc} ({gpu_name}), which {name} {runtime_version} cannot run on "
            f"(it runs on {', '.join(runnable)})",
            "serve this model with --backend tensorrt (full TensorRT) or --backend inductor on this GPU",
        )
    if built_cc != gpu_cc or built_version != runtime_version:
        raise ArtifactError(
            f"engine was built for {built_cc} with {name} {built_version}; this GPU is {gpu_cc} ({gpu_name}) "
            f"with {name} {runtime_version}",
            f"rebuild with `miaohui build … --backend {flavor} --target {gpu_cc}` ({name} {runtime_version})",
        )


class TensorRTEngine(Engine):
    """A serialized TensorRT / TensorRT-RTX engine loaded on the current CUDA GPU.

    ``path`` is the artifact directory (the engine is ``manifest.engine_file`` inside it) or the engine file.
    Buffers are torch CUDA tensors bound with ``set_tensor_address``; one stream, one context, one lock.
    """

    def __init__(self, manifest: Manifest, path: Path) -> None:
        super().__init__(manifest, path)
        if manifest.backend not in MODULES:
            raise ArtifactError(
                f"manifest backend {manifest.backend!r} is not a TensorRT engine",
                "load it with the engine class of its backend",
            )
        self.flavor: Flavor = "tensorrt-rtx" if manifest.backend == "tensorrt-rtx" else "tensorrt"
        trt = trt_module(self.flavor)
        gpu = local_gpu()
        if gpu is None:
            raise BackendUnavailableError(
                f"no CUDA GPU found; {NAMES[self.flavor]} engines run on NVIDIA GPUs of compute capability "
                f"{self._runnable_text(trt)} (this one was built for {manifest.target.compute_capability})",
                "serve it on such a GPU, or use --backend onnxruntime (CPU) here",
            )
        runnable = list(rtx_targets(trt)) if self.flavor == "tensorrt-rtx" else None
        _check_compatibility(
            self.flavor,
            manifest.target.compute_capability,
            manifest.backend_version,
            gpu[0],
            gpu[1],
            str(trt.__version__),
            runnable,
        )
        file = path / manifest.engine_file if path.is_dir() else path
        if not file.is_file():
            raise ArtifactError(f"engine file {file} does not exist", "rebuild it with `miaohui build`")
        blob = file.read_bytes()
        _check_header(self.flavor, blob, file)
        self._trt = trt
        self._runtime, self._engine = _deserialize(trt, blob, file)
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise ArtifactError(
                f"could not create an execution context for {file} ({trt_logger(trt).sink.tail()})",
                "free GPU memory or rebuild the engine",
            )
        import torch

        self._torch = torch
        self._stream = torch.cuda.Stream()
        self._lock = threading.Lock()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        self._inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if n not in self._inputs]

    def _runnable_text(self, trt: Any) -> str:
        if self.flavor == "tensorrt-rtx":
            return "/".join(f"{cc[2:-1]}.{cc[-1]}" for cc in rtx_targets(trt))
        return "7.5 and newer"

    def _torch_dtype(self, name: str) -> Any:
        np_name = DTYPES.get(self._engine.get_tensor_dtype(name).name)
        if np_name is None or not hasattr(self._torch, np_name):
            raise ArtifactError(
                f"tensor {name!r} has unsupported dtype {self._engine.get_tensor_dtype(name)}",
                "export the model with float/int tensors at its inputs and outputs",
            )
        return getattr(self._torch, np_name)

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch, ctx = self._torch, self._context
        with self._lock, torch.cuda.stream(self._stream):
            bound = []  # keep inputs alive until the stream is synchronized
            for name in self._inputs:
                host = torch.from_numpy(np.ascontiguousarray(feeds[name]))
                dev = host.to("cuda").to(self._torch_dtype(name)).contiguous()
                if not ctx.set_input_shape(name, tuple(dev.shape)):
                    raise ShapeError(
                        f"input {name!r} shape {tuple(dev.shape)} rejected by the engine",
                        "stay within the engine's shape profile",
                    )
                ctx.set_tensor_address(name, dev.data_ptr())
                bound.append(dev)
            outputs = {}
            for name in self._outputs:
                shape = tuple(ctx.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise ArtifactError(
                        f"output {name!r} has a data-dependent shape {shape}",
                        "export the model with outputs whose shape follows from the inputs",
                    )
                out = torch.empty(shape, dtype=self._torch_dtype(name), device="cuda")
                ctx.set_tensor_address(name, out.data_ptr())
                outputs[name] = out
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise ArtifactError(
                    f"{NAMES[self.flavor]} execution failed: {trt_logger(self._trt).sink.tail()}",
                    "check the inputs against the manifest; rebuild the engine if it persists",
                )
            self._stream.synchronize()
        return {n: (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy() for n, t in outputs.items()}

    def close(self) -> None:
        """Release the context and engine (idempotent)."""
        self._context = self._engine = self._runtime = None
