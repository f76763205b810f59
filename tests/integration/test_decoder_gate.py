"""The decoder gate (``miaohui validate NAME`` on a causal-LM version) on a tiny random Llama directory: its fp32
build passes (100 % exact match against transformers), a version whose last block is zeroed fails with the reason
printed and exit code 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tests.tiny_decoders import save_tiny_decoder, smollm_tokenizer
from typer.testing import CliRunner

from miaohui.errors import ArtifactError
from miaohui.generation.build.artifact import build_causal_lm, read_info
from miaohui.validate.decoder_gate import DecoderGateConfig, load_prompts, resolve_causal_lm, run_decoder_gate


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gate")
    source = save_tiny_decoder("llama", root / "tiny-llama", smollm_tokenizer())
    build_causal_lm(root / "repo", "tiny", "fp32", source=source)
    return root / "repo"


def _damaged_copy(version: Path) -> Path:
    """The next version of the same model: the same graph with the last block's attention output and MLP down
    projections zeroed (a real, served ONNX model, just wrong)."""
    import onnx
    from onnx import numpy_helper

    target = version.parent / str(int(version.name) + 1)
    shutil.copytree(version, target)
    model = onnx.load(str(target / "model.onnx"))
    for init in model.graph.initializer:
        if init.name in ("layers.1.o", "layers.1.down"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 0.0, init.name))
    onnx.save(model, str(target / "model.onnx"))
    info = json.loads((target / "causal_lm.json").read_text())
    (target / "causal_lm.json").write_text(json.dumps(info | {"version": int(target.name)}))
    return target


def test_prompt_set_and_thresholds() -> None:
    prompts = load_prompts()
    assert 12 <= len(prompts) <= 20 and {p.lang for p in prompts} == {"en", "zh"}
    assert any(p.expect == "Paris" for p in prompts)
    fp32, int8 = DecoderGateConfig.for_precision("fp32"), DecoderGateConfig.for_precision("int8")
    assert (fp32.min_exact_match, fp32.min_teacher_forced, fp32.min_factual) == (1.0, 1.0, 1.0)
    assert int8.min_exact_match < 1.0 and int8.min_teacher_forced < 1.0 and int8.min_factual == 1.0


def test_fp32_build_passes_through_the_cli(repo: Path, tmp_path: Path) -> None:
    from miaohui.cli import app

    out = tmp_path / "gate.json"
    result = CliRunner().invoke(app, ["validate", "tiny", "--repository", str(repo), "--json", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps long lines
    assert "gate passed" in text and "greedy exact match 100.0% (min 100%)" in text
    report = json.loads(out.read_text())
    assert report["exact_match"] == 1.0 and report["teacher_forced"] == 1.0 and report["failures"] == []
    assert report["factual"] is None  # a random model states no facts: nothing to count
    assert read_info(repo / "tiny" / "1").validation == report  # stored with the version


def test_damaged_version_fails_with_the_reason(repo: Path) -> None:
    from miaohui.cli import app

    damaged = _damaged_copy(repo / "tiny" / "1")
    try:
        assert resolve_causal_lm("tiny", repo) == damaged  # the newest version
        result = CliRunner().invoke(app, ["validate", "tiny", "--repository", str(repo)])
        assert result.exit_code == 1, result.output
        text = " ".join(result.output.split())  # rich wraps long lines
        assert "gate failed: greedy exact match" in text and "< 100% (differs on en-deposit" in text
        assert "gate failed: teacher-forced top-1 agreement" in text
        assert read_info(damaged).validation["teacher_forced"] < 0.5  # type: ignore[index]  # set by the gate
    finally:
        shutil.rmtree(damaged)


def test_missing_source_is_a_clear_error(repo: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m" / "1"
    shutil.copytree(repo / "tiny" / "1", copy)
    info = read_info(copy)
    (copy / "causal_lm.json").write_text(
        info.model_copy(update={"source_path": str(tmp_path / "gone")}).model_dump_json()
    )
    with pytest.raises(ArtifactError, match=r"the fp32 source of tiny v1, .*gone, is gone"):
        run_decoder_gate(copy)
    assert resolve_causal_lm("nothing-here", repo) is None  # not a causal LM: `validate` takes the encoder path
