"""``serve`` starts CUDA beside its own start only where the repository holds a GPU model."""

from __future__ import annotations

import ctypes.util
import json
import sys
from pathlib import Path

import pytest

from miaohui.engines.gpu_start import driver_context, runs_on_gpu, start_cuda_early


def _version(repo: Path, model: str, file: str, body: dict[str, object]) -> Path:
    v = repo / model / "1"
    v.mkdir(parents=True)
    (v / file).write_text(json.dumps(body))
    return v


def test_which_versions_run_on_a_gpu(tmp_path: Path) -> None:
    gpu_encoder = _version(tmp_path, "bert", "manifest.json", {"target": {"device": "cuda"}})
    cpu_encoder = _version(tmp_path, "intent", "manifest.json", {"target": {"device": "cpu"}})
    gpu_decoder = _version(tmp_path, "own", "causal_lm.json", {"backend": "inductor"})
    cpu_decoder = _version(tmp_path, "smollm2", "causal_lm.json", {"backend": "onnxruntime"})
    gguf = _version(tmp_path, "q4", "causal_lm.json", {"backend": "llamacpp"})
    broken = _version(tmp_path, "broken", "manifest.json", {})
    (broken / "manifest.json").write_text("{not json")
    assert [runs_on_gpu(v) for v in (gpu_encoder, cpu_encoder, gpu_decoder, cpu_decoder, gguf, broken)] == [
        True, False, True, False, False, False,
    ]  # fmt: skip


def test_a_cpu_repository_starts_nothing(tmp_path: Path) -> None:
    _version(tmp_path, "intent", "manifest.json", {"target": {"device": "cpu"}})
    _version(tmp_path, "own", "causal_lm.json", {"backend": "inductor"})
    assert start_cuda_early(tmp_path / "missing") is None
    assert start_cuda_early(tmp_path, ["intent"]) is None  # the GPU model is not among those served


def test_a_gpu_model_imports_torch_on_a_thread(tmp_path: Path) -> None:
    _version(tmp_path, "own", "causal_lm.json", {"backend": "inductor"})
    thread = start_cuda_early(tmp_path)
    assert thread is not None and thread.daemon
    thread.join(120)
    assert not thread.is_alive()
    assert "torch" in sys.modules


def test_without_a_driver_the_context_is_left_to_the_load() -> None:
    """This machine has no ``libcuda``: nothing is made, nothing raises (on a GPU the probe times it)."""
    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed here")
    assert driver_context() is None
