"""Artifact store and loader on a tiny real model: caching by build key, versions, atomic failure,
manifest contents, and clear errors for corrupt, truncated or mismatched artifacts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from miaohui.config import BuildConfig, parse_shapes
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact, read_manifest, versions
from miaohui.errors import ArtifactError, BuildError, ConfigError, ShapeError
from miaohui.serving.model_config import default_model_config, ensure_model_config, load_model_config


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("repo")


@pytest.fixture(scope="module")
def fp32(tiny_model: Path, repo: Path) -> Path:
    return build_artifact(tiny_model, "tiny", BuildConfig(), repo, log=lambda m: None).path


def test_manifest_holds_the_contract(fp32: Path, tiny_model: Path) -> None:
    m = read_manifest(fp32)
    assert (m.name, m.version, m.task, m.backend, m.precision) == ("tiny", 1, "intent", "onnxruntime", "fp32")
    assert [s.name for s in m.inputs] == ["input_ids", "attention_mask"]
    assert m.inputs[0].profile is not None and m.inputs[0].profile.max == (64, 64)
    assert m.outputs[0].name == "logits" and m.outputs[0].dims == ["batch", 4]
    assert m.target.device == "cpu" and m.labels == ["greeting", "goodbye", "human_agent", "out_of_scope"]
    assert set(m.files) == {"model.onnx", "tokenizer.json"}
    assert m.files["model.onnx"].size == (fp32 / "model.onnx").stat().st_size
    assert len(m.build_key) == 64 and m.build.seconds > 0
    # a new ONNX Runtime model serves from up to two instances, does not wait for batches to fill, and
    # caps a batch at 128 padded tokens: what the repository serves it with while it has no config.yaml, and
    # what `miaohui build` writes there
    assert load_model_config(fp32.parent / "config.yaml", m.backend) == default_model_config("onnxruntime")
    ensure_model_config(fp32.parent, m.backend)
    served = load_model_config(fp32.parent / "config.yaml")
    assert served.backend == "onnxruntime" and served.dynamic_batching
    assert served.batching.instances == min(2, len(os.sched_getaffinity(0)))
    assert served.batching.max_queue_delay_ms == 0 and served.batching.max_batch_tokens == 128
    assert served.batching.length_buckets == [16, 32, 64, 128]


def test_same_key_is_reused_and_options_make_a_new_version(tiny_model: Path, repo: Path, fp32: Path) -> None:
    messages: list[str] = []
    again = build_artifact(tiny_model, "tiny", BuildConfig(), repo, log=messages.append)
    assert again.reused and again.path == fp32
    assert any("reusing" in m for m in messages)
    other = build_artifact(
        tiny_model,
        "tiny",
        BuildConfig(shapes=parse_shapes("input_ids:1x1,4x16,16x32")),
        repo,
        log=lambda m: None,
    )
    assert not other.reused and other.manifest.version == 2
    assert versions(repo / "tiny") == [1, 2]


def test_engine_infers_and_rejects_out_of_profile(fp32: Path) -> None:
    with load_engine(fp32) as engine:
        ids = np.full((2, 10), 7, dtype=np.int64)
        out = engine.infer({"input_ids": ids, "attention_mask": np.ones_like(ids)})["logits"]
        assert out.shape == (2, 4) and np.isfinite(out).all()
        with pytest.raises(
            ShapeError, match="input 'input_ids' has shape 2x65, outside the profile min 1x1 .. max 64x64"
        ):
            big = np.ones((2, 65), dtype=np.int64)
            engine.infer({"input_ids": big, "attention_mask": big})
        with pytest.raises(ShapeError, match="has dtype int32, engine expects int64"):
            engine.infer({"input_ids": ids.astype(np.int32), "attention_mask": np.ones_like(ids)})
        with pytest.raises(ShapeError, match="missing \\['attention_mask'\\]"):
            engine.infer({"input_ids": ids})


def test_failed_build_leaves_nothing(tiny_model: Path, repo: Path) -> None:
    before = sorted(p.name for p in (repo / "tiny").iterdir())
    with pytest.raises(ConfigError, match="int8 needs calibration text"):
        build_artifact(tiny_model, "tiny", BuildConfig(precision="int8"), repo, log=lambda m: None)
    with pytest.raises(ConfigError, match="exceeds the model's max_length 64"):
        build_artifact(tiny_model, "tiny", BuildConfig(shapes=parse_shapes("input_ids:1x1,8x64,8x128")), repo)
    assert sorted(p.name for p in (repo / "tiny").iterdir()) == before


def test_backend_failure_mid_build_leaves_nothing(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(BuildError):
        # torch backend refuses int8: the failure happens inside the backend, after the temp dir exists
        build_artifact(
            tiny_model,
            "t",
            BuildConfig(backend="torch", precision="int8"),
            tmp_path,
            calib_texts=["a"],
            log=lambda m: None,
        )
    assert not any((tmp_path / "t").iterdir())


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(src, dst)
    return dst


def test_truncated_engine_file(fp32: Path, tmp_path: Path) -> None:
    art = _copy(fp32, tmp_path)
    data = (art / "model.onnx").read_bytes()
    (art / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ArtifactError, match=r"model.onnx is \d+ bytes, the manifest says \d+ \(truncated or replaced\)"
    ):
        load_engine(art)


def test_corrupt_engine_file(fp32: Path, tmp_path: Path) -> None:
    art = _copy(fp32, tmp_path)
    data = bytearray((art / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (art / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match its sha256 in the manifest \\(corrupt\\)"):
        load_engine(art)
    # without checksum verification ONNX Runtime itself may or may not notice; either way no crash
    try:
        load_engine(art, verify_checksums=False).close()
    except ArtifactError as exc:
        assert "rebuild" in str(exc)


def test_mismatched_backend_version_and_cpu(fp32: Path, tmp_path: Path) -> None:
    art = _copy(fp32, tmp_path)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["backend_version"] = "0.9.0"
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="was built with onnxruntime 0.9.0; this machine has .* rebuild it here"):
        load_engine(art)
    manifest = json.loads((fp32 / "manifest.json").read_text())
    manifest["target"]["cpu_flags"] = ["amx_int8"]
    (art / "manifest.json").write_text(json.dumps(manifest))
    from miaohui.engines.target import cpu_flags

    if "amx_int8" not in cpu_flags():
        with pytest.raises(ArtifactError, match="was built for a CPU with amx_int8, which this CPU lacks"):
            load_engine(art)


def test_damaged_manifest(fp32: Path, tmp_path: Path) -> None:
    art = _copy(fp32, tmp_path)
    (art / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="manifest.json is damaged"):
        load_engine(art)
    (art / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="has no manifest.json"):
        load_engine(art)
