"""``train-intent --data`` on a label set the project's data does not have (a library's four intents), with and
without ``--dev``; ``--backbone`` as a Hugging Face encoder directory (MiniLM's sentence-transformers folder, tiny
random DistilBERT / RoBERTa / ELECTRA saved here); then built (ONNX Runtime fp32) and served on ``/v1/intent`` with
its own labels; a dialogue pipeline whose routes the model lacks says so.

Kept fast: MiniLM (6 × 384) trains once for one epoch on 48 utterances; the other encoders are 2 × 32 random.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from miaohui.cli import app as cli_app
from miaohui.config import BuildConfig
from miaohui.dialogue.engine_adapters import EngineClassifier
from miaohui.dialogue.pipeline import Pipeline
from miaohui.engines.store import build_artifact
from miaohui.errors import BuildError, ConfigError, UnavailableError
from miaohui.models.checkpoint import WEIGHTS_NAME, load_checkpoint
from miaohui.models.intent import IntentClassifier
from miaohui.models.train import TrainConfig, train_intent
from miaohui.nlp.tokenizer import TextTokenizer
from miaohui.server.dialogue_api import DialogueService
from miaohui.server.http import create_app
from miaohui.server.metrics import Metrics
from miaohui.server.state import ServerState
from miaohui.serving.repository import ModelManager
from miaohui.validate.comparator import TorchClassifier
from miaohui.zoo.intents import load_train_data
from miaohui.zoo.minilm import minilm_model_dir
from miaohui.zoo.tiny import any_tokenizer

LIBRARY: dict[str, list[str]] = {
    "renew_loan": [
        "can I renew my books", "please extend my loan", "I need the novel for two more weeks",
        "renew everything on my card", "extend the due date of my DVD", "keep the atlas a bit longer",
        "renew the loan on the cookbook", "how do I renew online", "more time with the biography please",
        "push back the return date", "renew my audiobook", "can my loan be extended again",
    ],
    "opening_hours": [
        "when do you open", "are you open on sunday", "what time does the library close",
        "opening hours today", "is the branch open on holidays", "until when can I study tonight",
        "do you open early on saturday", "what are your hours", "is the reading room open late",
        "when does the library open tomorrow", "closing time on friday", "are you closed on monday",
    ],
    "late_fee": [
        "how much is the late fine", "I have an overdue charge", "pay my library fine",
        "why was I charged a fee", "what do late returns cost", "can you waive my overdue fee",
        "how much do I owe", "fine for a lost book", "the fee for returning late",
        "pay the penalty online", "is there a fine for DVDs", "remove the late charge from my card",
    ],
    "find_book": [
        "where is the history section", "do you have Dune", "find me a cookbook",
        "is this title on the shelf", "which floor has science fiction", "look up a book by its author",
        "I am searching for a poetry collection", "is the new thriller available", "where are the children's books",
        "can you locate a travel guide", "do you stock graphic novels", "search the catalogue for chess books",
    ],
}  # fmt: skip
DEV_TEXTS: dict[str, list[str]] = {
    "renew_loan": ["extend my books please", "renew my loan again"],
    "opening_hours": ["are you open today", "what time do you close"],
    "late_fee": ["how big is my fine", "pay the overdue fee"],
    "find_book": ["where are the cookbooks", "do you have this novel"],
}


def _jsonl(path: Path, table: dict[str, list[str]]) -> Path:
    rows = [{"text": t, "intent": label, "lang": "en"} for label, texts in table.items() for t in texts]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("library-data")
    return _jsonl(root / "library.jsonl", LIBRARY), _jsonl(root / "library-dev.jsonl", DEV_TEXTS)


@pytest.fixture(scope="module")
def minilm_library(library: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The CLI end to end: MiniLM's sentence-transformers directory as --backbone, no --dev (held out)."""
    out = tmp_path_factory.mktemp("library-model") / "library"
    args = ["train-intent", "--data", str(library[0]), "--backbone", str(minilm_model_dir())]
    result = CliRunner().invoke(
        cli_app, [*args, "--epochs", "1", "--min-steps", "0", "--trainable-layers", "2", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    return out, result.output


def _hf_encoder(folder: Path, arch: str) -> Path:
    """A tiny random HF encoder directory (save_pretrained) with an existing tokenizer (MiniLM's)."""
    from transformers import AutoConfig, AutoModel

    tok = any_tokenizer()
    shape = {
        "distilbert": {"dim": 32, "n_heads": 2, "n_layers": 2, "hidden_dim": 64},
        "roberta": {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64},
        "electra": {
            "embedding_size": 16, "hidden_size": 32, "num_attention_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 64,
        },
        "bert": {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64},
    }[arch]  # fmt: skip
    extra = {"pad_token_id": tok.token_to_id("[PAD]")} if arch == "roberta" else {}
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, vocab_size=tok.get_vocab_size(), max_position_embeddings=64, **shape, **extra)
    AutoModel.from_config(config).save_pretrained(str(folder))
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_cli_trains_on_own_labels_with_a_held_out_part(minilm_library: tuple[Path, str]) -> None:
    path, output = minilm_library
    assert "4 labels, 40 train / 8 dev (held out 20% of each label of" in output
    for label in LIBRARY:
        assert label in output  # the per-label dev accuracy table
    meta = load_checkpoint(path).meta
    assert meta.labels == sorted(LIBRARY)
    assert meta.bert_config["model_type"] == "bert" and meta.base == str(minilm_model_dir().resolve())
    assert meta.train["n_train"] == 40 and meta.train["n_dev"] == 8
    assert set(meta.train["dev_per_label"]) == set(LIBRARY)


def test_own_data_with_a_dev_file_and_an_hf_bert_dir(library: tuple[Path, Path], tmp_path: Path) -> None:
    backbone = _hf_encoder(tmp_path / "hf-bert", "bert")
    data = load_train_data(library[0], library[1])
    assert data.dev_source == str(library[1]) and len(data.train) == 48 and len(data.dev) == 8
    cfg = TrainConfig(backbone=str(backbone), epochs=1, min_steps=0, trainable_layers=1)
    path, report = train_intent(cfg, tmp_path / "ck", progress=False, data=data)
    assert report.n == 8 and set(report.per_label) == set(LIBRARY)
    meta = load_checkpoint(path).meta
    assert meta.labels == sorted(LIBRARY) and meta.max_length == 64  # lowered to the 64 positions it has
    assert meta.train["dev_data"] == str(library[1])


@pytest.mark.parametrize("arch", ["distilbert", "roberta", "electra"])
def test_hf_backbone_checkpoint_rebuilds_its_architecture(
    arch: str, library: tuple[Path, Path], tmp_path: Path
) -> None:
    from transformers import AutoModel

    backbone = _hf_encoder(tmp_path / f"hf-{arch}", arch)
    cfg = TrainConfig(backbone=str(backbone), epochs=1, min_steps=0, trainable_layers=1)
    path, _ = train_intent(cfg, tmp_path / "ck", progress=False, data=load_train_data(library[0]))
    loaded = load_checkpoint(path)
    assert loaded.meta.bert_config["model_type"] == arch
    assert type(loaded.module.encoder).__name__ == type(AutoModel.from_pretrained(str(backbone))).__name__
    # the same weights in the source's own class (from its directory) give identical logits
    source = AutoModel.from_pretrained(str(backbone))
    if getattr(source, "pooler", None) is not None:
        source.pooler = None
    reference = IntentClassifier(source, len(LIBRARY))
    reference.load_state_dict(load_file(str(path / WEIGHTS_NAME)))
    tok = TextTokenizer(loaded.tokenizer, loaded.meta.max_length)
    ids, mask = (torch.from_numpy(x) for x in tok.encode(["renew my books", "when do you open on sunday"]))
    with torch.inference_mode():
        assert torch.equal(loaded.module(ids, mask), reference.eval()(ids, mask))
        frozen = loaded.module.encoder.embeddings.word_embeddings.weight
        assert torch.equal(frozen, source.embeddings.word_embeddings.weight)  # frozen layers stay the source's


def test_inductor_refuses_a_non_bert_checkpoint(library: tuple[Path, Path], tmp_path: Path) -> None:
    backbone = _hf_encoder(tmp_path / "hf-roberta", "roberta")
    cfg = TrainConfig(backbone=str(backbone), epochs=1, min_steps=0, trainable_layers=0)
    path, _ = train_intent(cfg, tmp_path / "ck", progress=False, data=load_train_data(library[0]))
    with pytest.raises(BuildError) as info:
        build_artifact(path, "lib", BuildConfig(backend="inductor"), tmp_path / "repo", log=lambda m: None)
    assert info.value.message == (f"the inductor backend compiles BERT encoders; {path} holds a 'roberta' encoder")
    assert not (tmp_path / "repo" / "lib" / "1").exists()


@pytest.fixture(scope="module")
def library_repo(minilm_library: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("library-repo")
    result = CliRunner().invoke(
        cli_app, ["build", str(minilm_library[0]), "--name", "library", "--repository", str(repo)]
    )
    assert result.exit_code == 0, result.output
    return repo


def test_validate_on_own_dev_data(library_repo: Path, library: tuple[Path, Path]) -> None:
    """The accuracy gate on the user's own dev file (any labels); the project's dev split is refused by name."""
    args = ["validate", "library", "--repository", str(library_repo), "--max-drop", "100", "--min-agreement", "0"]
    result = CliRunner().invoke(cli_app, [*args, "--data", str(library[1])])
    assert result.exit_code == 0, result.output
    assert "top-1 agreement" in result.output and "gate passed" in result.output
    refused = CliRunner().invoke(cli_app, args)
    assert refused.exit_code == 2
    assert "this model has its own labels" in refused.output and "pass --data YOUR_DEV.jsonl" in refused.output


@pytest.fixture
async def client(library_repo: Path) -> AsyncIterator[httpx.AsyncClient]:
    metrics = Metrics()
    manager = ModelManager(library_repo, observer_factory=metrics.observer)
    await manager.load_all()
    app = create_app(ServerState(manager, metrics))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c
    await manager.stop()


async def test_built_model_serves_its_own_labels(client: httpx.AsyncClient, minilm_library: tuple[Path, str]) -> None:
    texts = ["can I extend my loan", "what time do you open", "how much is my fine", "do you have Dune"]
    got = (await client.post("/v1/intent", json={"texts": texts, "model": "library"})).json()
    assert [g["model"] for g in got] == ["library"] * 4
    reference = TorchClassifier(minilm_library[0])
    want = await reference.classify(texts)
    assert [g["intent"] for g in got] == [w[0] for w in want]  # ORT fp32 = the checkpoint's own argmax
    assert {g["candidate"] for g in got} <= set(LIBRARY)
    assert [g["intent"] for g in got] == ["out_of_scope" if g["out_of_scope"] else g["candidate"] for g in got]
    for g, w in zip(got, want, strict=True):
        assert g["confidence"] == pytest.approx(w[1], abs=1e-4)


async def test_pipeline_with_routes_the_model_lacks_says_so(minilm_library: tuple[Path, str]) -> None:
    classifier = TorchClassifier(minilm_library[0])
    with pytest.raises(ConfigError) as info:
        Pipeline.from_name("meeting_assistant", classifier)
    assert info.value.message == (
        "pipeline 'meeting_assistant' routes intent label(s) ['book_meeting_room', 'cancel_booking', 'goodbye', "
        "'greeting', 'human_agent'] that the intent model "
        f"'torch fp32 ({minilm_library[0]})' does not have (its labels: find_book, late_fee, opening_hours, renew_loan)"
    )


async def test_server_dialogue_reports_routes_the_served_model_lacks(
    library_repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = ModelManager(library_repo, observer_factory=Metrics().observer)
    service = DialogueService(EngineClassifier(manager, "library"), pipelines=["meeting_assistant"])
    await manager.load_all()
    try:
        with caplog.at_level(logging.ERROR, logger="miaohui.server"):
            failed = service.check_labels()
        assert list(failed) == ["meeting_assistant"]
        assert "that the intent model 'library' does not have" in caplog.text
        with pytest.raises(UnavailableError) as info:
            await service.turn("meeting_assistant", "book a room for tomorrow")
        assert info.value.message == failed["meeting_assistant"].message
    finally:
        await manager.stop()


def test_backbone_dir_forms_and_errors(tmp_path: Path) -> None:
    from transformers import GPT2Config

    from miaohui.zoo.backbones import load_backbone

    # a sentence-transformers directory whose encoder sits in its Transformer module's folder
    st = tmp_path / "st"
    _hf_encoder(st / "0_Transformer", "bert")
    (st / "0_Transformer" / "tokenizer.json").rename(st / "tokenizer.json")
    modules = [{"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}]
    (st / "modules.json").write_text(json.dumps(modules))
    encoder, tok = load_backbone(str(st))
    assert type(encoder).__name__ == "BertModel" and encoder.pooler is None
    assert tok.token_to_id("[PAD]") is not None

    with pytest.raises(ConfigError) as info:
        load_backbone(str(tmp_path / "nowhere"))
    assert (
        info.value.message == f"unknown backbone {str(tmp_path / 'nowhere')!r} (neither a shipped name nor a directory)"
    )

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as info:
        load_backbone(str(tmp_path / "empty"))
    assert info.value.message == f"{tmp_path / 'empty'} is not a Hugging Face model directory (no config.json)"

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(str(tmp_path / "gpt2"))
    with pytest.raises(ConfigError) as info:
        load_backbone(str(tmp_path / "gpt2"))
    assert info.value.message == f"{tmp_path / 'gpt2'}: architecture 'gpt2' is not an encoder train-intent fine-tunes"
