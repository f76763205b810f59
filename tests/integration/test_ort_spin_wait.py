"""Served ONNX Runtime sessions sleep between runs (spin-wait off, ModelConfig.spin_wait); bare engines spin."""

from __future__ import annotations

from pathlib import Path

from miaohui.config import BuildConfig
from miaohui.engines.loader import load_engine
from miaohui.engines.onnxruntime import OnnxRuntimeEngine
from miaohui.engines.store import build_artifact
from miaohui.serving.model_config import ModelConfig
from miaohui.serving.served import ServedVersion


def _spinning(engine: object) -> str:
    assert isinstance(engine, OnnxRuntimeEngine)
    opts = engine._session.get_session_options()
    try:
        return str(opts.get_session_config_entry("session.intra_op.allow_spinning"))
    except RuntimeError:  # not set: ONNX Runtime's default, spinning on
        return "default"


def test_server_turns_spin_wait_off_bare_engine_keeps_it(tiny_model: Path, tmp_path: Path) -> None:
    art = build_artifact(tiny_model, "tiny", BuildConfig(precision="fp32"), tmp_path / "repo", log=lambda m: None)
    assert _spinning(load_engine(art.path, threads=1)) != "0"
    assert _spinning(load_engine(art.path, threads=1, spin_wait=False)) == "0"
    served = ServedVersion(art.path, ModelConfig(threads=1))
    assert all(_spinning(e) == "0" for e in served.engines)
    assert all(_spinning(e) == "default" for e in ServedVersion(art.path, ModelConfig(spin_wait=True)).engines)
