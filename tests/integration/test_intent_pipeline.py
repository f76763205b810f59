"""The compile pipeline on the real e5-small intent model: train → export → ORT fp32/int8 → TensorRT-RTX
(sm86, built on this CPU) → validate gate. Slow: the model is trained once per session."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tests.artifacts import install_version, scratch_dir
from typer.testing import CliRunner

from miaohui.cli import app
from miaohui.config import BuildConfig, CalibrationConfig
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact, read_manifest
from miaohui.nlp.tokenizer import TextTokenizer
from miaohui.prepare import BERT_FFN_DOWN
from miaohui.validate.run import run_validation

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with scratch_dir(tmp_path_factory, "repo") as path:
        yield path


@pytest.fixture(scope="module")
def engines(intent_model: Path, intent_engines: dict[str, Path], repo: Path, calib_texts: list[str]) -> dict[str, Path]:
    """fp32 and the default int8 as built once per session (``intent_engines``), and static int8 built here."""
    fp32 = install_version(intent_engines["fp32"], repo, "intent-fp32")
    int8 = install_version(intent_engines["int8"], repo, "intent")
    static = build_artifact(
        intent_model,
        "intent-static",
        BuildConfig(precision="int8", calibration=CalibrationConfig(keep_fp32=BERT_FFN_DOWN)),
        repo,
        calib_texts=calib_texts,
        log=lambda m: None,
    )
    return {"fp32": fp32, "int8": int8, "static": static.path}


def test_trained_model_meets_accuracy(intent_model: Path) -> None:
    meta = json.loads((intent_model / "miaohui-model.json").read_text())
    assert meta["train"]["dev_accuracy"] >= 0.92
    assert len(meta["labels"]) == 24


def test_fp32_and_int8_pass_the_gate(engines: dict[str, Path], repo: Path) -> None:
    fp32, _ = run_validation(str(engines["fp32"]), repo, "dev", "torch", 1.0, 0.98, None)
    int8, drift = run_validation(str(engines["int8"]), repo, "dev", "torch", 1.0, 0.98, str(engines["fp32"]))
    assert fp32.passed and fp32.accuracy >= 0.92 and fp32.agreement >= 0.999 and fp32.max_logit_error < 1e-3
    assert int8.passed, int8.failures
    assert int8.accuracy >= fp32.accuracy - 0.01
    assert drift is not None and drift["agreement"] >= 0.98
    # results and golden outputs were written into the artifact
    assert read_manifest(engines["int8"]).validation is not None
    assert (engines["int8"] / "golden.npz").is_file()


def test_default_int8_is_dynamic_with_the_most_sensitive_matmuls_smoothed(engines: dict[str, Path]) -> None:
    m = read_manifest(engines["int8"])
    ops = m.extra["op_counts"]
    assert ops.get("QAttention") == 12 and ops.get("MatMulInteger") == 37 and "MatMul" not in ops  # all int8
    # ORT's slow SkipLayerNormalization / BiasGelu kernels are replaced, and kept from being re-fused at load
    assert "SkipLayerNormalization" not in ops and "BiasGelu" not in ops
    assert ops.get("LayerNormalization") == 24 and ops.get("Gelu") == 12
    assert m.extra["ort_disabled_optimizers"] == ["SkipLayerNormFusion", "BiasGeluFusion"]
    int8 = m.extra["int8"]
    assert int8["mode"] == "dynamic" and int8["num_samples"] == 256 and len(int8["data_digest"]) == 64
    ranked = list(int8["sensitivity"])
    assert len(ranked) == 36 and int8["kept_fp32"] == []  # 36 weight MatMuls ranked, none kept fp32
    assert list(int8["smoothed"]) == ranked[:2]  # the worst 2 get a SmoothQuant input scale (one Mul each)
    assert all("/output/dense/" in r for r in ranked[:2])  # FFN down-projections (long-tailed GELU inputs)
    assert not (engines["int8"] / "calibration.json").exists()


def test_static_int8_graph_is_explicit_qdq_with_saved_ranges(engines: dict[str, Path]) -> None:
    m = read_manifest(engines["static"])
    ops = m.extra["op_counts"]
    assert ops.get("QuantizeLinear", 0) > 0 and ops.get("DequantizeLinear", 0) > 0
    cal = json.loads((engines["static"] / "calibration.json").read_text())
    assert cal["method"] == "percentile" and cal["num_samples"] == 256 and len(cal["data_digest"]) == 64
    assert cal["quantized_nodes"] == 60 and len(cal["ranges"]) > 50  # 72 weight MatMuls, 12 FFN-down kept fp32
    assert all(lo <= hi for lo, hi in cal["ranges"].values())


def test_seed_examples_classified(engines: dict[str, Path]) -> None:
    seeds = {
        "我想买一只稳健型基金，年化收益5%左右": "fund_recommendation",
        "最近黄金涨得不错，现在入场合适吗？": "market_outlook",
        "帮我订明天上午九点的会议室": "book_meeting_room",
    }
    with load_engine(engines["int8"]) as engine:
        tok = TextTokenizer.from_file(engines["int8"] / "tokenizer.json", 128)
        ids, mask = tok.encode(list(seeds))
        pred = engine.infer({"input_ids": ids, "attention_mask": mask})["logits"].argmax(-1)
    assert [engine.manifest.labels[p] for p in pred] == list(seeds.values())


def test_validate_cli_gate_fails_with_reason(
    engines: dict[str, Path], repo: Path, tiny_model: Path, tmp_path: Path
) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["validate", str(engines["fp32"]), "--repository", str(repo)])
    assert ok.exit_code == 0, ok.output
    assert "gate passed" in ok.output
    # a random-weight model with other labels cannot agree with the trained one
    labels = tmp_path / "dev4.jsonl"
    labels.write_text(
        "\n".join(
            json.dumps({"text": t, "intent": i, "lang": "zh"}, ensure_ascii=False)
            for t, i in [("你好", "greeting"), ("再见", "goodbye"), ("转人工", "human_agent")] * 4
        )
    )
    tiny = build_artifact(tiny_model, "tiny", BuildConfig(), repo, log=lambda m: None).path
    bad = runner.invoke(
        app,
        [
            "validate",
            str(tiny),
            "--repository",
            str(repo),
            "--data",
            str(labels),
            "--reference",
            str(engines["fp32"]),
            "--min-agreement",
            "0.99",
            "--max-drop",
            "0",
        ],
    )
    assert bad.exit_code == 1
    assert "gate failed" in bad.output and "top-1 agreement with the reference is" in bad.output


def test_calibration_methods_differ(
    intent_model: Path, repo: Path, calib_texts: list[str], engines: dict[str, Path]
) -> None:
    cfg = BuildConfig(precision="int8", calibration=CalibrationConfig(method="minmax", keep_fp32=BERT_FFN_DOWN))
    out = build_artifact(intent_model, "intent-minmax", cfg, repo, calib_texts=calib_texts, log=lambda m: None)
    pct = json.loads((engines["static"] / "calibration.json").read_text())["ranges"]
    mm = json.loads((out.path / "calibration.json").read_text())["ranges"]
    shared = sorted(set(pct) & set(mm))
    assert shared and any(mm[k] != pct[k] for k in shared)
    # minmax covers at least the range percentile keeps (it never clips)
    widths = np.array([(mm[k][1] - mm[k][0]) - (pct[k][1] - pct[k][0]) for k in shared])
    assert (widths > -1e-3).mean() > 0.9


def test_tensorrt_rtx_engine_for_sm86(intent_model: Path, repo: Path) -> None:
    out = build_artifact(
        intent_model,
        "intent-rtx",
        BuildConfig(backend="tensorrt-rtx", target="sm86"),
        repo,
        log=lambda m: None,
    )
    m = read_manifest(out.path)
    assert m.backend == "tensorrt-rtx" and m.target.compute_capability == "sm86"
    engine = out.path / m.engine_file
    assert engine.is_file() and engine.stat().st_size == m.files[m.engine_file].size > 1_000_000
    assert engine.read_bytes()[:4] == b"vtrt"
    from miaohui.engines.tensorrt_runtime import inspect_engine

    facts = inspect_engine(engine, "tensorrt-rtx")
    assert "sm86" in json.dumps(facts)
