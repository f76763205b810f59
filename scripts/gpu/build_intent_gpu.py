"""On the GPU: build the e5 intent engine (inductor fp16) into a repository with the serving config the GPU
server runs use (batch up to 256, 1 ms queue delay, length buckets 16/32/64, every bucket warmed up).

    python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo [MAX_QUEUE_DELAY_MS] [INSTANCES]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from miaohui.config import BuildConfig, parse_shapes
from miaohui.engines.store import build_artifact
from miaohui.serving.batcher import BatcherConfig
from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config

repo = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpurepo")
cfg = BuildConfig(
    backend="inductor",
    precision="fp16",
    autotune=False,
    shapes=parse_shapes("input_ids:1x1,32x32,256x64"),
    inductor_format=os.environ.get("INDUCTOR_FORMAT", "auto"),  # exported-program: skip a package known to crash
    gpu_kernels=os.environ.get("GPU_KERNELS", "tuned"),  # type: ignore[arg-type]  # library: the A/B's other half
)
if not (repo / "intent" / "1").is_dir():  # a rerun (another delay) only rewrites config.yaml
    model = Path(
        os.environ.get("MODEL", "var/models/intent-e5-small")
    )  # scripts/gpu/e5_shape_model.py: random e5 shape
    build_artifact(model, "intent", cfg, repo, log=print)
delay_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0  # max_queue_delay_ms (a sweep passes others)
instances = int(sys.argv[3]) if len(sys.argv) > 3 else 1  # engine instances (each its own CUDA stream)
tokens_cap = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # max_batch_tokens (0: no cap, the default so far)
batching = BatcherConfig(
    max_batch_size=256,
    max_queue_delay_ms=delay_ms,
    max_queue_size=8192,
    length_buckets=[16, 32, 64],
    instances=instances,
    max_batch_tokens=tokens_cap or None,
)
warmup = [WarmupShape(batch=b, sequence=s) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for s in (16, 32, 64)]
write_model_config(repo / "intent" / "config.yaml", ModelConfig(backend="inductor", batching=batching, warmup=warmup))
