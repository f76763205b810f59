"""Encoder backbones for ``train-intent``: the shipped ones by name (offline, from registry packages) or a
Hugging Face encoder directory as ``save_pretrained`` / sentence-transformers write it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tokenizers import Tokenizer

from miaohui.errors import ArtifactError, ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

BackboneName = Literal["e5-small", "minilm"]
BACKBONES: tuple[str, ...] = ("e5-small", "minilm")
HF_ENCODERS: tuple[str, ...] = ("bert", "roberta", "xlm-roberta", "distilbert", "electra")
"""``model_type`` values of the HF encoders ``train-intent`` fine-tunes (their layers take ``(hidden, mask)``)."""


def load_backbone(name: str) -> tuple[Any, Tokenizer]:
    """A fresh fp32 encoder (eval mode, no pooler) and its tokenizer. ``e5-small`` is multilingual
    (Chinese-capable), ``minilm`` English; any other value is read as a Hugging Face encoder directory."""
    if name == "e5-small":
        from miaohui.zoo.e5 import load_e5

        return load_e5()
    if name == "minilm":
        from miaohui.zoo.minilm import load_minilm

        return load_minilm()
    if Path(name).is_dir():
        return load_hf_encoder(Path(name))
    raise ConfigError(
        f"unknown backbone {name!r} (neither a shipped name nor a directory)",
        f"choose one of {', '.join(BACKBONES)} or give a Hugging Face encoder directory",
    )


def _model_folder(folder: Path) -> Path:
    """The folder holding ``config.json``: ``folder`` itself, or a sentence-transformers directory's Transformer
    module (``modules.json`` → its ``path``, e.g. ``0_Transformer``)."""
    if (folder / "config.json").is_file():
        return folder
    modules = folder / "modules.json"
    if modules.is_file():
        try:
            entries = json.loads(modules.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ArtifactError(f"{modules} is not valid JSON: {exc}", "restore the model directory") from exc
        for entry in entries if isinstance(entries, list) else []:
            sub = folder / str(entry.get("path", ""))
            if str(entry.get("type", "")).endswith("Transformer") and (sub / "config.json").is_file():
                return sub
    raise ConfigError(
        f"{folder} is not a Hugging Face model directory (no config.json)",
        "give a directory written by save_pretrained, or a sentence-transformers directory",
    )


def load_hf_tokenizer(folder: Path) -> Tokenizer:
    """``tokenizer.json`` of ``folder`` (or of its parent, for a sentence-transformers module), else the fast
    tokenizer ``AutoTokenizer`` builds from the folder's vocabulary files."""
    for candidate in (folder / "tokenizer.json", folder.parent / "tokenizer.json"):
        if candidate.is_file():
            try:
                return Tokenizer.from_file(str(candidate))
            except Exception as exc:  # tokenizers raises a bare Exception for a bad file
                raise ArtifactError(f"cannot read tokenizer {candidate}: {exc}", "restore tokenizer.json") from exc
    from transformers import AutoTokenizer

    try:
        auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, use_fast=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"{folder} has no usable tokenizer ({exc})",
            "save the tokenizer next to the model: tokenizer.save_pretrained(DIR) (writes tokenizer.json)",
        ) from exc
    backend = getattr(auto, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ConfigError(
            f"{folder}: the tokenizer {type(auto).__name__} has no fast (tokenizers) backend",
            "convert it once with a fast tokenizer class and save tokenizer.json into the directory",
        )
    return backend


def load_hf_encoder(folder: Path) -> tuple[PreTrainedModel, Tokenizer]:
    """The encoder of an HF directory as its bare ``AutoModel`` (a ``*ForSequenceClassification`` directory gives
    its encoder; the pooler is dropped: the classifier mean-pools), fp32, eval mode, and its tokenizer."""
    from transformers import AutoConfig, AutoModel

    src = _model_folder(folder)
    try:
        config = AutoConfig.from_pretrained(str(src), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read {src / 'config.json'}: {exc}", "restore the model directory") from exc
    if config.model_type not in HF_ENCODERS:
        raise ConfigError(
            f"{src}: architecture {config.model_type!r} is not an encoder train-intent fine-tunes",
            f"use a directory of one of {', '.join(HF_ENCODERS)}",
        )
    try:
        model = AutoModel.from_pretrained(str(src), local_files_only=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ArtifactError(f"cannot load the weights of {src}: {exc}", "restore the model directory") from exc
    drop_pooler(model)
    return model.float().eval(), load_hf_tokenizer(src)


def drop_pooler(model: Any) -> None:
    """Remove BERT-style poolers (unused: the classifier mean-pools) so the saved weights are the encoder's."""
    if getattr(model, "pooler", None) is not None:
        model.pooler = None
