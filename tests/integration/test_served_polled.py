"""``gpu_wait: poll``: the event loop launches a batch itself and awaits the engine's ``infer_polled`` instead of
handing the batch to a worker thread. No CUDA here: the engine is the real tiny ONNX Runtime engine whose
``infer_polled`` is wrapped to yield to the loop a few times before it answers, standing in for a replay whose done
event is polled (the GPU twin is ``tests/gpu/test_inductor_gpu.py::test_polled_batches_match_threaded``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from miaohui.config import BuildConfig
from miaohui.engines.gpu_base import GpuEngine
from miaohui.engines.store import build_artifact
from miaohui.serving.model_config import ModelConfig, WarmupShape
from miaohui.serving.served import ServedVersion


class _NoThreads:
    """An executor that must not be used: polled batches never leave the event loop thread."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a polled batch went to the worker thread")

    def shutdown(self, wait: bool = True) -> None:
        return None


@pytest.fixture(scope="module")
def artifact(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("polled")
    return build_artifact(tiny_model, "tiny", BuildConfig(precision="fp32"), repo, log=lambda m: None).path


def _rows(n: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(5, 200, int(k)).tolist() for k in rng.integers(3, 30, n)]


async def _serve(served: ServedVersion, rows: list[list[int]]) -> list[np.ndarray]:
    await served.start()
    try:
        return await asyncio.gather(*(served.run_rows([r], None) for r in rows))
    finally:
        await served.stop()


def test_polled_batches_stay_on_the_loop_and_equal_threaded_ones(artifact: Path) -> None:
    warmup = [WarmupShape(batch=1, sequence=8)]
    threaded = ServedVersion(artifact, ModelConfig(threads=1, warmup=warmup))
    want = asyncio.run(_serve(threaded, _rows(40)))

    polled = ServedVersion(artifact, ModelConfig(threads=1, warmup=warmup, gpu_wait="poll"))
    engine = polled.engines[0]
    engine.__class__ = type("PolledOrt", (type(engine), GpuEngine), {})  # the ORT engine with a GPU engine's hooks
    engine.last_stages, engine.start_phases = {}, {}
    ticks = {"loop": 0, "waits": 0}
    real = engine._infer_polled_impl

    async def slow_device(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for _ in range(3):  # the "device" computes: the loop runs other callbacks meanwhile
            ticks["waits"] += 1
            await asyncio.sleep(0)
        return await real(feeds)

    engine.polls = True
    engine._infer_polled_impl = slow_device  # type: ignore[method-assign]

    async def run() -> list[np.ndarray]:
        async def count() -> None:
            while True:
                ticks["loop"] += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count())
        await polled.start()  # warm-up still runs in the worker thread
        polled._pool = _NoThreads()  # type: ignore[assignment]
        try:
            return await asyncio.gather(*(polled.run_rows([r], None) for r in _rows(40)))
        finally:
            counter.cancel()
            await polled.stop()

    got = asyncio.run(run())
    assert ticks["waits"] > 0 and ticks["loop"] > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_engines_without_polling_keep_the_thread(artifact: Path) -> None:
    """ONNX Runtime cannot launch without blocking: ``gpu_wait: poll`` leaves its batches on the worker thread."""
    served = ServedVersion(artifact, ModelConfig(threads=1, gpu_wait="poll"))
    assert not isinstance(served.engines[0], GpuEngine)
    out = asyncio.run(_serve(served, _rows(5)))
    assert len(out) == 5 and all(o.shape[0] == 1 for o in out)
