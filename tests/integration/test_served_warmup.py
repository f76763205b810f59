"""Warm-up runs on every engine instance before the version is ready (a GPU instance captures its CUDA graphs
then, not on its first requests)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from miaohui.config import BuildConfig
from miaohui.engines.gpu_base import GpuEngine
from miaohui.engines.store import build_artifact
from miaohui.serving.batcher import BatcherConfig
from miaohui.serving.model_config import ModelConfig, WarmupShape
from miaohui.serving.served import ServedVersion


def test_every_instance_runs_every_warmup_shape(tiny_model: Path, tmp_path: Path) -> None:
    art = build_artifact(tiny_model, "tiny", BuildConfig(precision="fp32"), tmp_path / "repo", log=lambda m: None)
    shapes = [WarmupShape(batch=1, sequence=8), WarmupShape(batch=4, sequence=16)]
    config = ModelConfig(threads=1, batching=BatcherConfig(instances=2), warmup=shapes)
    served = ServedVersion(art.path, config)
    seen: dict[int, list[tuple[int, ...]]] = {id(e): [] for e in served.engines}
    for engine in served.engines:  # record the shapes each real engine runs (the engines still compute)
        real = engine.infer

        def infer(feeds: dict[str, np.ndarray], real=real, key=id(engine)) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
            seen[key].append(feeds["input_ids"].shape)
            return real(feeds)

        engine.infer = infer  # type: ignore[method-assign]

    async def run() -> None:
        await served.start()
        try:
            assert served.ready and served.warmup_seconds > 0
        finally:
            await served.stop()

    asyncio.run(run())
    assert len(served.engines) == 2
    assert all(shapes_run == [(1, 8), (4, 16)] for shapes_run in seen.values()), seen


def test_warmup_covers_every_bucket_the_engine_specialises_on(tiny_model: Path, tmp_path: Path) -> None:
    """A GPU inductor engine reports its CUDA-graph buckets; warm-up runs each (clamped to the served limits), so
    no bucket is captured while serving. The CPU engine here has no buckets: it is given a GPU engine's hooks, with
    what an engine with batch buckets 1..8 and sequence buckets 8..48 reports (stand-in for a GPU)."""
    art = build_artifact(tiny_model, "tiny", BuildConfig(precision="fp32"), tmp_path / "repo", log=lambda m: None)
    config = ModelConfig(
        threads=1, batching=BatcherConfig(max_batch_size=6), warmup=[WarmupShape(batch=2, sequence=16)]
    )
    served = ServedVersion(art.path, config)
    engine = served.engines[0]
    assert not isinstance(engine, GpuEngine)  # ONNX Runtime: shape-generic, no buckets
    assert served.warmup_shapes(engine) == [(2, 16)]
    engine.__class__ = type("BucketedOrt", (type(engine), GpuEngine), {})  # the ORT engine with a GPU engine's hooks
    engine.warmup_buckets = lambda: [(b, s) for b in (1, 2, 4, 8) for s in (8, 48, 96)]  # type: ignore[method-assign]
    shapes = served.warmup_shapes(engine)
    limit = served.max_length
    assert shapes[0] == (2, 16) and len(shapes) == len(set(shapes))
    assert set(shapes[1:]) == {(b, s) for b in (1, 2, 4, 6) for s in (8, 48 if limit >= 48 else limit, min(96, limit))}
