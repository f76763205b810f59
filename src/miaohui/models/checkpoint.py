"""A trained model on disk: ``miaohui-model.json`` + ``model.safetensors`` + ``tokenizer.json``.

This is the *source* every engine is built from; its digest is part of every build key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from miaohui.errors import ArtifactError
from miaohui.models.decision import IntentDecision
from miaohui.paths import atomic_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

# torch, safetensors' torch helpers and transformers are imported where a checkpoint is loaded or saved, never at
# import: a server that only loads prebuilt engines reads the metadata here without the training framework

META_NAME = "miaohui-model.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"


class ModelMeta(BaseModel):
    """What a checkpoint is: architecture, labels, tokenizer limits, how it was trained."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["intent", "encoder"]
    """``intent`` (logits over labels) or ``encoder`` (normalized sentence embeddings)."""
    base: str
    """Backbone it was made from, e.g. ``e5-small`` or ``minilm``."""
    bert_config: dict[str, Any]
    """The encoder's HF config (``config.to_dict()``); its ``model_type`` (absent: ``bert``) picks the
    architecture the loader rebuilds (:func:`build_encoder`)."""
    labels: list[str] = Field(default_factory=list)
    max_length: int = 128
    """Longest token sequence (special tokens included) the model accepts."""
    train: dict[str, Any] = Field(default_factory=dict)
    """Training settings and dev metrics, for the record."""
    decision: IntentDecision | None = None
    """An ``intent`` model's temperature and out-of-scope threshold, fitted on dev by ``train-intent`` and applied
    where the server answers; None (a model from elsewhere): temperature 1, never out of scope."""
    source_format: Literal["miaohui", "hf", "onnx"] = "miaohui"
    """Where the model came from: a ``train-intent`` checkpoint, a Hugging Face directory, or an ONNX file
    (:mod:`miaohui.sources`). ``hf``: ``bert_config`` holds the source's full ``config.json``."""
    architecture: str | None = None
    """The source's class, e.g. ``BertForSequenceClassification`` (``hf``); None for a miaohui checkpoint."""
    pooling: Literal["mean", "cls"] = "mean"
    """How an ``encoder`` pools token states into one vector (miaohui's own encoders: masked mean)."""
    normalize: bool = True
    """Whether an ``encoder``'s vectors are L2-normalized (miaohui's own encoders: yes)."""


@dataclass
class LoadedModel:
    path: Path
    meta: ModelMeta
    module: torch.nn.Module
    tokenizer: Tokenizer
    digest: str


def save_checkpoint(path: Path, module: torch.nn.Module, meta: ModelMeta, tokenizer: Tokenizer) -> Path:
    """Write atomically: a temp dir next to ``path`` renamed into place."""
    from safetensors.torch import save_file

    path = Path(path)
    with atomic_dir(path) as tmp:
        state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_NAME))
        (tmp / TOKENIZER_NAME).write_text(tokenizer.to_str(), encoding="utf-8")
        (tmp / META_NAME).write_text(meta.model_dump_json(indent=2), encoding="utf-8")
    return path


def read_meta(path: Path) -> ModelMeta:
    meta_file = Path(path) / META_NAME
    if not meta_file.is_file():
        raise ArtifactError(
            f"{path} is not a miaohui model (no {META_NAME})",
            "train one with `miaohui train-intent` or point at a model directory",
        )
    try:
        return ModelMeta.model_validate_json(meta_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ArtifactError(f"{meta_file} is damaged: {exc}", "retrain or restore the model directory") from exc


_DIGESTS: dict[tuple[str, tuple[tuple[int, int], ...]], str] = {}


def model_digest(path: Path) -> str:
    """sha256 over the checkpoint's files (meta, weights, tokenizer); remembered while their sizes and
    modification times are unchanged, so building several engines from one model hashes it once."""
    files = [Path(path) / name for name in (META_NAME, WEIGHTS_NAME, TOKENIZER_NAME)]
    key = (str(Path(path).resolve()), tuple((f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in _DIGESTS:
        _DIGESTS[key] = _hash_files(files)
    return _DIGESTS[key]


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for file in files:
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def build_encoder(bert_config: dict[str, Any], attn_implementation: str = "sdpa") -> PreTrainedModel:
    """The encoder a stored config describes, random weights: ``BertModel`` (no pooler) for ``model_type``
    ``bert`` or none (checkpoints written before other architectures were trained), else the bare ``AutoModel``
    of that ``model_type`` (RoBERTa, XLM-RoBERTa, DistilBERT, ELECTRA ...) with its pooler removed."""
    # transformers is imported here, not at import: a server that only loads engines skips it
    model_type = bert_config.get("model_type", "bert")
    if model_type == "bert":
        from transformers import BertConfig, BertModel

        config = BertConfig(**bert_config)
        config._attn_implementation = attn_implementation
        return BertModel(config, add_pooling_layer=False)
    from transformers import AutoConfig, AutoModel

    try:
        auto = AutoConfig.for_model(**bert_config)
    except (ValueError, KeyError) as exc:
        raise ArtifactError(
            f"the checkpoint's encoder architecture {model_type!r} is unknown to transformers: {exc}",
            "upgrade transformers, or retrain the model from a supported backbone",
        ) from exc
    encoder = AutoModel.from_config(auto, attn_implementation=attn_implementation)
    if getattr(encoder, "pooler", None) is not None:
        encoder.pooler = None  # as train-intent saved it: the classifier mean-pools
    return encoder


def build_module(meta: ModelMeta, attn_implementation: str = "sdpa") -> torch.nn.Module:
    from miaohui.models.intent import IntentClassifier, SentenceEncoder

    encoder = build_encoder(meta.bert_config, attn_implementation)
    if meta.kind == "intent":
        return IntentClassifier(encoder, num_labels=len(meta.labels))
    return SentenceEncoder(encoder)


def load_checkpoint(path: Path, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load a checkpoint in eval mode. ``attn_implementation='eager'`` for ONNX export."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_meta(path)
    module = build_module(meta, attn_implementation)
    try:
        state = load_file(str(path / WEIGHTS_NAME))
        module.load_state_dict(state)
        tokenizer = Tokenizer.from_file(str(path / TOKENIZER_NAME))
    except Exception as exc:
        raise ArtifactError(f"cannot load model {path}: {exc}", "retrain or restore the model directory") from exc
    module.eval()
    return LoadedModel(path=path, meta=meta, module=module, tokenizer=tokenizer, digest=model_digest(path))


def meta_json(meta: ModelMeta) -> str:
    return json.dumps(meta.model_dump(mode="json"), ensure_ascii=False)
