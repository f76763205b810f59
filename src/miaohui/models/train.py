"""``miaohui train-intent``: fine-tune encoder + head on intent data, on CPU, in minutes.

The data is the project's 24-label set, or a user's own JSONL with any labels
(:func:`~miaohui.zoo.intents.load_train_data`); the encoder a shipped backbone or a Hugging Face encoder
directory (BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ELECTRA: :func:`~miaohui.zoo.backbones.load_backbone`).
The bottom ``L - trainable_layers`` encoder layers are frozen; their outputs are computed once
(:class:`FrozenPrefix`), so an epoch runs only the top layers and the head.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from miaohui.errors import ConfigError
from miaohui.models.checkpoint import ModelMeta, save_checkpoint
from miaohui.models.intent import IntentClassifier, mean_pool
from miaohui.nlp.normalize import normalize_text
from miaohui.nlp.tokenizer import TextTokenizer, pad_batch, truncate_ids
from miaohui.zoo.backbones import BACKBONES, load_backbone
from miaohui.zoo.intents import LABELS, TrainData, load_train_data


class TrainConfig(BaseModel):
    """Fine-tuning settings. Defaults reach ≥ 92 % dev accuracy with e5-small in a few CPU minutes."""

    model_config = ConfigDict(extra="forbid")

    backbone: str = "e5-small"
    """Encoder to start from: ``e5-small``, ``minilm`` or a Hugging Face encoder directory."""
    epochs: int = Field(default=8, ge=1, le=100)
    batch_size: int = Field(default=32, ge=1, le=1024)
    lr_encoder: float = Field(default=8e-5, gt=0)
    """Learning rate of the fine-tuned encoder layers."""
    lr_head: float = Field(default=3e-3, gt=0)
    warmup: float = Field(default=0.1, ge=0, lt=1)
    """Fraction of steps with linear warm-up."""
    max_length: int = Field(default=128, ge=8, le=512)
    """Longest sequence the model accepts at serving time (lowered to what the encoder's position table
    holds); training truncates to ``train_length``."""
    train_length: int = Field(default=64, ge=8, le=512)
    trainable_layers: int = Field(default=4, ge=0, le=48)
    """Top encoder layers that are fine-tuned (the rest are frozen and cached)."""
    seed: int = 0
    threads: int = Field(default=2, ge=1)


class _Labelled(Protocol):
    @property
    def text(self) -> str: ...
    @property
    def intent(self) -> str: ...


@dataclass
class EvalReport:
    accuracy: float
    per_label: dict[str, float]
    n: int


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.fields[stage]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        disable=not enabled,
    )


def _token_ids(tok: TextTokenizer, texts: list[str], length: int) -> list[list[int]]:
    return [truncate_ids(ids, length) for ids in tok.token_ids([normalize_text(t) for t in texts])]


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T] 0/1 → [B, 1, 1, T] additive mask (0 keep, dtype-min drop), as BERT layers consume it."""
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


class FrozenPrefix:
    """Hidden states after the frozen layers, one [T_i, H] tensor per example, computed once."""

    def __init__(self, model: IntentClassifier, ids: list[list[int]], frozen: int, pad_id: int) -> None:
        self.states: list[torch.Tensor] = [torch.empty(0)] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        enc = model.encoder
        with torch.inference_mode():
            for start in range(0, len(order), 64):
                rows = order[start : start + 64]
                a, m = (torch.from_numpy(x) for x in pad_batch([ids[i] for i in rows], pad_id))
                h = embed_tokens(enc, a)
                ext = _additive_mask(m, h.dtype)
                for layer in encoder_layers(enc)[:frozen]:
                    h = _run_layer(layer, h, ext)
                for r, i in enumerate(rows):
                    self.states[i] = h[r, : len(ids[i])].clone()

    @property
    def lengths(self) -> list[int]:
        return [int(x.shape[0]) for x in self.states]

    def batch(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(self.states[i].shape[0] for i in rows)
        hidden = self.states[rows[0]].shape[1]
        h = torch.zeros(len(rows), width, hidden)
        m = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            n = self.states[i].shape[0]
            h[r, :n] = self.states[i]
            m[r, :n] = 1
        return h, m


GROUP_POOL = 16
"""Batches drawn together from one shuffled pool of ``GROUP_POOL × batch_size`` examples (see
:func:`length_grouped_batches`)."""


def length_grouped_batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch's batches: the examples shuffled, cut into pools of ``GROUP_POOL`` batches, each pool sorted by
    length and cut into batches, and the batches shuffled (as Hugging Face's ``group_by_length``). A batch pads to its
    longest text, so batches of similar lengths compute less padding: on the project's data a third less time per
    epoch than batches of random rows, while every batch is still a random draw of the data."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    pool = batch_size * GROUP_POOL
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lambda i: lengths[i])
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _run_layer(layer: nn.Module, h: torch.Tensor, ext_mask: torch.Tensor) -> torch.Tensor:
    out = layer(h, attention_mask=ext_mask)
    return out[0] if isinstance(out, tuple) else out


def _top_forward(model: IntentClassifier, h: torch.Tensor, m: torch.Tensor, frozen: int) -> torch.Tensor:
    ext = _additive_mask(m, h.dtype)
    for layer in encoder_layers(model.encoder)[frozen:]:
        h = _run_layer(layer, h, ext)
    return model.head(model.dropout(mean_pool(h, m)))


def encoder_layers(encoder: Any) -> nn.ModuleList:
    """The transformer layers of an HF encoder: ``encoder.layer`` (BERT, RoBERTa, XLM-R, ELECTRA) or
    ``transformer.layer`` (DistilBERT); each is called as ``layer(hidden, attention_mask=additive_mask)``."""
    for owner in ("encoder", "transformer"):
        layers = getattr(getattr(encoder, owner, None), "layer", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ConfigError(
        f"cannot find the layers of {type(encoder).__name__} (no encoder.layer or transformer.layer)",
        "use a BERT, RoBERTa, XLM-RoBERTa, DistilBERT or ELECTRA encoder",
    )


def embed_tokens(encoder: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """The input of the first layer: the embeddings (and ELECTRA's projection to the hidden size)."""
    h = encoder.embeddings(input_ids)
    project = getattr(encoder, "embeddings_project", None)
    return project(h) if project is not None else h


def _max_length(encoder: Any, wanted: int) -> int:
    """``wanted``, lowered to the positions the encoder has (RoBERTa-style ids start after the padding id)."""
    cfg = encoder.config
    limit = int(getattr(cfg, "max_position_embeddings", wanted))
    if cfg.model_type in ("roberta", "xlm-roberta"):  # positions are padding_idx + 1, + 2 ...
        limit -= (1 if cfg.pad_token_id is None else int(cfg.pad_token_id)) + 1
    return min(wanted, limit)


@torch.inference_mode()
def evaluate(
    model: IntentClassifier,
    tok: TextTokenizer,
    data: Sequence[_Labelled],
    length: int,
    labels: Sequence[str] = LABELS,
) -> EvalReport:
    """Accuracy of the full model (no cache) on ``data``, overall and per label (``labels``: the head's order)."""
    model.eval()
    hits: dict[str, list[int]] = defaultdict(list)
    for start in range(0, len(data), 64):
        batch = data[start : start + 64]
        a, m = (torch.from_numpy(x) for x in pad_batch(_token_ids(tok, [x.text for x in batch], length), tok.pad_id))
        pred = model(a, m).argmax(-1).tolist()
        for ex, p in zip(batch, pred, strict=True):
            hits[ex.intent].append(int(labels[p] == ex.intent))
    total = sum(sum(v) for v in hits.values())
    return EvalReport(
        accuracy=total / max(1, len(data)),
        per_label={k: sum(v) / len(v) for k, v in sorted(hits.items())},
        n=len(data),
    )


def train_intent(
    cfg: TrainConfig, out_dir: Path, progress: bool = True, data: TrainData | None = None
) -> tuple[Path, EvalReport]:
    """Fine-tune on ``data`` (default: the project's 24-label splits), evaluate on its dev part, save a
    checkpoint to ``out_dir``. The head's labels are ``data.labels`` in that order."""
    data = load_train_data(None) if data is None else data
    labels = list(data.labels)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    encoder, raw_tok = load_backbone(cfg.backbone)
    max_length = _max_length(encoder, cfg.max_length)
    train_length = min(cfg.train_length, max_length)
    tok = TextTokenizer(raw_tok, max_length)
    model = IntentClassifier(encoder, len(labels))
    layers = encoder_layers(encoder)
    frozen = len(layers) - min(cfg.trainable_layers, len(layers))
    fixed = [encoder.embeddings, *([encoder.embeddings_project] if hasattr(encoder, "embeddings_project") else [])]
    for p in [p for mod in fixed for p in mod.parameters()] + list(layers[:frozen].parameters()):
        p.requires_grad_(False)
    train, dev = data.train, data.dev
    index = {label: i for i, label in enumerate(labels)}
    targets = torch.tensor([index[x.intent] for x in train])

    started = time.perf_counter()
    model.eval()
    cache = FrozenPrefix(model, _token_ids(tok, [x.text for x in train], train_length), frozen, tok.pad_id)
    trainable = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("head.")]
    opt = torch.optim.AdamW(
        [{"params": trainable, "lr": cfg.lr_encoder}, {"params": model.head.parameters(), "lr": cfg.lr_head}],
        weight_decay=0.01,
    )
    steps = cfg.epochs * math.ceil(len(train) / cfg.batch_size)
    warm = max(1, int(cfg.warmup * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm)))
    )
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.05)
    with _progress(progress) as bar:
        task = bar.add_task("", total=steps, stage="train-intent")
        for epoch in range(cfg.epochs):
            model.train()
            for rows in length_grouped_batches(cache.lengths, cfg.batch_size, rng):
                h, m = cache.batch(rows)
                loss = loss_fn(_top_forward(model, h, m, frozen), targets[rows])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                bar.update(task, advance=1, description=f"epoch {epoch + 1}/{cfg.epochs} loss {loss.item():.3f}")
    seconds = time.perf_counter() - started
    report = evaluate(model, tok, dev, max_length, labels)
    meta = ModelMeta(
        kind="intent",
        base=cfg.backbone if cfg.backbone in BACKBONES else str(Path(cfg.backbone).resolve()),
        bert_config=encoder_config(encoder),
        labels=labels,
        max_length=max_length,
        train={
            "config": cfg.model_dump(),
            "seconds": round(seconds, 1),
            "dev_accuracy": report.accuracy,
            "dev_per_label": report.per_label,
            "n_train": len(train),
            "n_dev": len(dev),
            "data": data.source,
            "dev_data": data.dev_source,
        },
    )
    save_checkpoint(out_dir, model, meta, raw_tok)
    return out_dir, report


def encoder_config(encoder: Any) -> dict[str, object]:
    """The encoder's HF config as the checkpoint stores it (``ModelMeta.bert_config``): ``model_type`` says
    which architecture the loader rebuilds; ``hidden_size``, ``num_attention_heads``, ``num_hidden_layers`` and
    ``vocab_size`` are written under those names for every architecture (DistilBERT calls them ``dim``,
    ``n_heads`` ..., and reads these names back as aliases), so readers of the checkpoint need not know it."""
    config = encoder.config
    cfg = config.to_dict()
    drop = ("transformers_version", "architectures", "_attn_implementation_autoset", "dtype", "torch_dtype")
    for key in drop:
        cfg.pop(key, None)
    if config.model_type != "bert":  # BERT's dict already has them; keep it byte-for-byte as before
        for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            cfg.setdefault(key, getattr(config, key))
    return cfg
