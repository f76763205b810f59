"""The comparator's decoder runners (validate/comparator.py) and ``miaohui compare`` on two causal-LM versions of a
model that is not SmolLM2: a tiny random Qwen2 with its own character-level tokenizer and chat template (300 ids, so
a prompt encoded with SmolLM2's tokenizer would hold ids far outside its vocabulary), built by ``build_causal_lm``.
Each side encodes the prompts with its own tokenizer: the ids are the model's own and its greedy replies are
transformers' ``generate`` on the source, token for token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from miaohui.dialogue.compare import compare_engines, negotiation_prompts
from miaohui.errors import ConfigError
from miaohui.generation.build.artifact import build_causal_lm
from miaohui.validate.comparator import OrtDecoder, TorchDecoder, decoder_outputs, open_decoder, source_decoder
from miaohui.validate.consistency import DriftThresholds

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]


def char_tokenizer() -> Any:
    """A fast tokenizer of one id per character (ASCII, and the Chinese characters of the negotiation prompts)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted({c for p in negotiation_prompts() for m in p for c in m["content"]} | set(map(chr, range(32, 127))))
    vocab = {t: i for i, t in enumerate([*SPECIALS, "\n", *chars[: 300 - len(SPECIALS) - 1]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.bos_token, fast.pad_token = "<|im_start|>", "<|im_end|>"
    fast.chat_template = TEMPLATE
    return fast


def hf_ids(hf: Any, messages: Any) -> list[int]:
    """The prompt as transformers renders and encodes it with the source's own tokenizer."""
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(hf(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tinyq`` v1 and v2: the same tiny Qwen2 (fp32 ONNX Runtime), and ``other`` v1: another random seed."""
    from tests.tiny_decoders import save_tiny_decoder

    root = tmp_path_factory.mktemp("comparator")
    tok = char_tokenizer()
    source = save_tiny_decoder("qwen2", root / "tiny-qwen2", tok)
    other = save_tiny_decoder("qwen2", root / "other-qwen2", tok, seed=1)
    for _ in range(2):
        build_causal_lm(root / "repo", "tinyq", "fp32", source=source, force=True)
    build_causal_lm(root / "repo", "other", "fp32", source=other)
    return root / "repo"


def test_each_side_encodes_with_its_own_tokenizer_and_matches_the_source(repo: Path) -> None:
    from transformers import AutoTokenizer

    prompts = negotiation_prompts()[:3]
    hf = AutoTokenizer.from_pretrained(
        str(repo.parent / "tiny-qwen2")
    )  # the source's tokenizer, as transformers loads it
    with open_decoder(repo / "tinyq" / "1") as ort:
        assert isinstance(ort, OrtDecoder) and ort.name.startswith("tinyq v1 (onnxruntime fp32")
        for messages in prompts:
            ids = ort.prompt_ids(messages)
            assert ids == hf_ids(hf, messages)
            assert max(ids) < 300
        source = source_decoder(repo / "tinyq" / "1", ort.eos)
        assert isinstance(source, TorchDecoder)
        ours, theirs = decoder_outputs([ort, source], prompts, 12)
    assert ours.texts == theirs.texts and all(ours.texts)
    ids = hf_ids(hf, prompts[0])
    with open_decoder(repo / "tinyq" / "2") as ort:
        assert ort.greedy(ids, 12) == source.greedy(ids, 12)  # generate() on the source
        assert ort.teacher_forced(ids, source.greedy(ids, 12)) == 12


def test_compare_two_versions_of_a_qwen2_passes_and_another_model_fails(repo: Path) -> None:
    from miaohui.cli import app

    result = CliRunner().invoke(app, ["compare", "tinyq:1", "tinyq:2", "--repository", str(repo)])
    assert result.exit_code == 0, result.output
    report = compare_engines("tinyq:1", "tinyq:2", repo, thresholds=DriftThresholds(max_drift=0.05))
    assert report.passed and [s.name for s in report.sections] == ["generation negotiation_coach"]
    assert report.sections[0].report.text_exact_match == 1.0
    drift = compare_engines("tinyq:1", "other", repo, thresholds=DriftThresholds(min_text_similarity=0.99))
    assert not drift.passed and drift.sections[0].report.text_exact_match < 1.0
    with pytest.raises(ConfigError, match="'tinyq:1' is a causal LM and the other is not"):
        compare_engines("tinyq:1", str(repo / "missing"), repo)
