"""The one engine interface every backend implements, and the manifest that describes an artifact."""

from __future__ import annotations

import abc
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from miaohui.config import BuildConfig, InputRange
from miaohui.errors import ShapeError

Task = Literal["intent", "encoder", "causal-lm", "tensor"]
"""``tensor``: a user's ONNX file served as its own tensors over KServe v2 (no tokenizer)."""
MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = 1


class TensorSpec(BaseModel):
    """Name, dtype and allowed shapes of one engine input or output."""

    model_config = ConfigDict(extra="forbid")

    name: str
    dtype: str
    """numpy dtype name, e.g. ``int64`` or ``float32``."""
    dims: list[str | int]
    """Symbolic (``batch``) or fixed sizes, one per dimension."""
    profile: InputRange | None = None
    """min/opt/max for inputs with dynamic dimensions."""


class Target(BaseModel):
    """The hardware an artifact was built for."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["cpu", "cuda"]
    cpu_flags: list[str] = Field(default_factory=list)
    """ISA extensions the build relied on (cpu), e.g. avx2, avx512_vnni."""
    gpu_name: str | None = None
    compute_capability: str | None = None
    """e.g. ``sm86``."""
    cuda_version: str | None = None

    def describe(self) -> str:
        if self.device == "cpu":
            return "CPU (" + (", ".join(self.cpu_flags) or "baseline ISA") + ")"
        return f"{self.gpu_name or 'GPU'} {self.compute_capability or ''}".strip()


class FileInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int
    sha256: str


class BuildInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    created_at: str
    seconds: float
    host: str
    miaohui_version: str


class Manifest(BaseModel):
    """``manifest.json``: what an artifact is and how it was made (see ARCHITECTURE.md)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = MANIFEST_SCHEMA
    name: str
    version: int
    task: Task
    backend: str
    backend_version: str
    precision: str
    engine_file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    source_digest: str
    options_digest: str
    build_key: str
    build_config: BuildConfig
    target: Target
    build: BuildInfo
    files: dict[str, FileInfo]
    labels: list[str] = Field(default_factory=list)
    """Class names for ``intent`` models, index = logit column."""
    tokenizer_file: str | None = None
    """HF ``tokenizers`` JSON shipped inside the artifact (text models)."""
    max_length: int | None = None
    """Longest token sequence the engine accepts (text models)."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Backend-specific facts (e.g. unsupported ops reported, calibration summary)."""
    validation: dict[str, Any] | None = None
    """Results of ``miaohui validate``, written back into the manifest."""

    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)


class Engine(abc.ABC):
    """A loaded, ready engine. ``infer`` validates; ``_infer_impl`` computes.

    Engines are context managers; ``close`` releases native resources. Hooks only GPU engines have (CUDA-graph
    buckets, stage timings, polled launches, a background compile) are :class:`~miaohui.engines.gpu_base.GpuEngine`'s.
    """

    def __init__(self, manifest: Manifest, path: Path) -> None:
        self.manifest = manifest
        self.path = path

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.manifest.inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.manifest.outputs]

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch. Raises :class:`ShapeError` naming the input, value and allowed range."""
        self.check_feeds(feeds)
        return self._infer_impl(feeds)

    def check_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        expected = set(self.input_names)
        given = set(feeds)
        if given != expected:
            missing, unknown = sorted(expected - given), sorted(given - expected)
            raise ShapeError(
                f"engine {self.manifest.name!r} got inputs {sorted(given)}"
                + (f", missing {missing}" if missing else "")
                + (f", unknown {unknown}" if unknown else ""),
                f"feed exactly {sorted(expected)}",
            )
        for spec in self.manifest.inputs:
            arr = feeds[spec.name]
            if str(arr.dtype) != spec.dtype:
                raise ShapeError(
                    f"input {spec.name!r} has dtype {arr.dtype}, engine expects {spec.dtype}",
                    f"cast it with .astype(np.{spec.dtype})",
                )
            if spec.profile is not None and not spec.profile.contains(tuple(arr.shape)):
                shape = "x".join(map(str, arr.shape))
                lo, hi = ("x".join(map(str, s)) for s in (spec.profile.min, spec.profile.max))
                raise ShapeError(
                    f"input {spec.name!r} has shape {shape}, outside the profile min {lo} .. max {hi}",
                    "split the batch, truncate the sequence, or rebuild with a larger --shapes max",
                )

    @abc.abstractmethod
    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None:  # noqa: B027 — optional hook
        """Release native resources. Idempotent."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
