"""Per-model serving configuration (``<repository>/<model>/config.yaml``), Triton-style."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miaohui.config import ShadowConfig, VersionPolicy, check_shadow_served, primary_of
from miaohui.engines.target import usable_cores
from miaohui.errors import ConfigError
from miaohui.paths import write_text_atomic
from miaohui.serving.batcher import BatcherConfig


class WarmupShape(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: int = Field(ge=1)
    sequence: int = Field(ge=1)


class ModelConfig(BaseModel):
    """How one model is served. Unknown keys are errors (typos must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid")

    backend: str = "onnxruntime"
    """Backend of the artifacts (checked against each version's manifest)."""
    batching: BatcherConfig = Field(default_factory=lambda: BatcherConfig(length_buckets=[16, 32, 64, 128]))
    """Dynamic batching: max_batch_size, max_queue_delay_ms, preferred sizes, queue size, instances…
    By default rows are grouped by token length (≤16, ≤32, ≤64, ≤128, longer) so a batch pads little."""
    dynamic_batching: bool = True
    """False: every request runs alone (batch of 1) — the baseline the batcher is measured against."""
    warmup: list[WarmupShape] = Field(
        default_factory=lambda: [WarmupShape(batch=1, sequence=16), WarmupShape(batch=8, sequence=32)]
    )
    """Shapes run before the model reports ready."""
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    threads: int | None = Field(default=None, ge=1)
    """Intra-op threads per instance (CPU engines); default: cores / instances."""
    spin_wait: bool = False
    """ONNX Runtime's intra-op threads busy-wait for the next run (``session.intra_op.allow_spinning``). Off in
    the server: spinning threads steal the cores the event loop, tokenizer and clients need (measured on
    2 cores: +11–20 % served throughput with it off); a bare engine on an idle machine keeps it on."""
    gpu_wait: Literal["thread", "poll"] = "poll"
    """How a CUDA-graph engine's batch is waited for. ``poll``: the event loop launches the batch itself and polls
    its done event between its other callbacks — no thread hop and no GIL hand-back per batch, at the cost of a
    core spinning while a batch computes. ``thread``: a worker thread runs the batch and sleeps on its done event,
    then hands the result back to the event loop. Engines without CUDA graphs (every CPU engine) always use the
    thread. ``poll`` is the default: with ``graph_copies`` it halved the engine process's time per batch and raised
    the shared-engine server's requests/s on the H200."""
    graph_copies: bool = True
    """CUDA-graph engines (``inductor`` on a GPU): capture each batch's input and output copies inside the bucket's
    graph, so a batch is one replay and one wait (fewer GIL hand-backs in a busy process). On by default: it costs
    nothing and saves a few copies' launches per batch."""
    fast_start: bool = False
    """``inductor`` exported-program versions: answer at once with the fast model rebuilt from the artifact's
    ``eager.safetensors`` (no program load, no Dynamo trace, no Inductor; CUDA graphs of the eager kernels on a
    GPU), then load and compile the program in a background thread and capture its graph of every bucket. Before
    ready only the ``warmup`` shapes are captured (under a second instead of tens of seconds for an e5-sized model).
    A bucket met before the compile is done is captured eagerly on first use. Off by default: eager graphs replay
    slower than compiled ones, and the background compile competes with serving for the GIL for seconds."""
    truncate: bool = False
    """Truncate over-long text instead of rejecting it with 400."""
    shadow: ShadowConfig | None = None
    """Shadow a candidate version on live traffic (see :class:`ShadowConfig`); None = off."""

    def instance_threads(self) -> int:
        """Intra-op threads of one instance: ``threads``, else this process's cores / instances (at least 1)."""
        return self.threads or max(1, usable_cores() // self.batching.instances)

    def primary_of(self, served: Iterable[int]) -> int | None:
        """The version that answers requests naming none (:func:`miaohui.config.primary_of`)."""
        return primary_of(served, self.shadow)

    @model_validator(mode="after")
    def _shadow_served(self) -> ModelConfig:
        check_shadow_served(self.version_policy, self.shadow)
        return self


def default_model_config(backend: str) -> ModelConfig:
    """The serving config a newly built model gets. For ONNX Runtime (CPU) engines: up to two instances of
    cores/2 threads each, no queue delay, and batches of at most 128 padded tokens. Measured on 2 cores
    (``benchmarks/bench_server_cpu.py``): one request's own tokens already fill the int8 GEMMs (an engine does
    1.4× more rows/s in batches of 32 than singly), so waiting for a batch only added latency (+5.7 ms p50
    at c=1 with 5 ms, no throughput gained at c=8…64); a big batch makes each of its rows wait for all the
    others (c=32 p99 252 → 168 ms with the 128-token cap, same throughput); and two single-thread instances
    served 10–40 % more than one two-thread instance under load (no straggling intra-op thread). Rows
    still batch whenever requests queue behind busy instances."""
    cfg = ModelConfig(backend=backend)
    if backend == "onnxruntime":
        instances = min(2, usable_cores())
        update = {"instances": instances, "max_queue_delay_ms": 0.0, "max_batch_tokens": 128}
        cfg = cfg.model_copy(update={"batching": cfg.batching.model_copy(update=update)})
    return cfg


def load_model_config(path: Path, backend: str | None = None) -> ModelConfig:
    """The config in ``path``; where there is none, the default of ``backend`` (:func:`default_model_config`,
    what ``miaohui build`` writes), or plain :class:`ModelConfig` defaults when no backend is given."""
    if not path.is_file():
        return default_model_config(backend) if backend else ModelConfig()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return ModelConfig.model_validate(data)
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"{path} is invalid: {exc}", "fix the file (see docs/model-repository.md)") from exc


def write_model_config(path: Path, cfg: ModelConfig) -> None:
    write_text_atomic(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True))


def ensure_model_config(model_dir: Path, backend: str) -> None:
    """Write the default serving ``config.yaml`` of ``backend`` next to the versions if there is none
    (``miaohui build`` does, so that the file is there to edit)."""
    if not (model_dir / "config.yaml").is_file():
        write_model_config(model_dir / "config.yaml", default_model_config(backend))
