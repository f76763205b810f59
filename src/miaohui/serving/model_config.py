"""Per-model serving configuration (``<repository>/<model>/config.yaml``), Triton-style."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miaohui.errors import ConfigError
from miaohui.serving.batcher import BatcherConfig


class VersionPolicy(BaseModel):
    """Which versions are served: the ``latest`` N, ``all``, or ``specific`` ones."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["latest", "all", "specific"] = "latest"
    latest: int = Field(default=1, ge=1)
    """How many of the newest versions to serve when policy is ``latest``."""
    versions: list[int] = Field(default_factory=list)
    """The versions to serve when policy is ``specific``."""

    @model_validator(mode="after")
    def _specific(self) -> VersionPolicy:
        if self.policy == "specific" and not self.versions:
            raise ConfigError("version_policy 'specific' lists no versions", "add versions: [1, 2] or use latest")
        return self

    def select(self, available: list[int]) -> list[int]:
        if self.policy == "all":
            return sorted(available)
        if self.policy == "specific":
            return sorted(v for v in available if v in self.versions)
        return sorted(available)[-self.latest :]


class WarmupShape(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: int = Field(ge=1)
    sequence: int = Field(ge=1)


class ModelConfig(BaseModel):
    """How one model is served. Unknown keys are errors (typos must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid")

    backend: str = "onnxruntime"
    """Backend of the artifacts (checked against each version's manifest)."""
    batching: BatcherConfig = Field(default_factory=BatcherConfig)
    """Dynamic batching: max_batch_size, max_queue_delay_ms, preferred sizes, queue size, instances…"""
    dynamic_batching: bool = True
    """False: every request runs alone (batch of 1) — the baseline the batcher is measured against."""
    warmup: list[WarmupShape] = Field(
        default_factory=lambda: [WarmupShape(batch=1, sequence=16), WarmupShape(batch=8, sequence=32)]
    )
    """Shapes run before the model reports ready."""
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    threads: int | None = Field(default=None, ge=1)
    """Intra-op threads per instance (CPU engines); default: cores / instances."""
    truncate: bool = False
    """Truncate over-long text instead of rejecting it with 400."""


def load_model_config(path: Path) -> ModelConfig:
    if not path.is_file():
        return ModelConfig()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return ModelConfig.model_validate(data)
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"{path} is invalid: {exc}", "fix the file (see README, 'Model repository')") from exc


def write_model_config(path: Path, cfg: ModelConfig) -> None:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True), encoding="utf-8")
