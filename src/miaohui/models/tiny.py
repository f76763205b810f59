"""Random-weight BERT intent classifiers saved as checkpoints, with :func:`~miaohui.zoo.tiny.any_tokenizer`:
fast serving tests, host-path benchmarks and GPU shape benchmarks, never accuracy."""

from __future__ import annotations

from pathlib import Path

from miaohui.models.checkpoint import ModelMeta, save_checkpoint
from miaohui.models.intent import IntentClassifier, random_bert
from miaohui.zoo.tiny import any_tokenizer


def save_tiny_intent(folder: Path, labels: list[str] | None = None) -> Path:
    """A tiny random-weight BERT intent classifier (2 layers, hidden 32; ``labels``, default 4 of the project's) with
    :func:`any_tokenizer`, saved as a checkpoint in ``folder``: fast serving tests and host-path benchmarks, never
    accuracy."""
    labels = labels or ["greeting", "goodbye", "human_agent", "out_of_scope"]
    tok = any_tokenizer()
    encoder = random_bert(hidden=32, layers=2, heads=2, vocab=tok.get_vocab_size(), max_positions=128)
    meta = ModelMeta(
        kind="intent", base="tiny-random", bert_config=encoder.config.to_diff_dict(), labels=labels, max_length=64
    )
    return save_checkpoint(folder, IntentClassifier(encoder, num_labels=len(labels)).eval(), meta, tok)


def save_bert_base_intent(folder: Path, num_labels: int = 24) -> Path:
    """A BERT-base-shaped random-weight intent classifier (12 layers × 768, 12 heads, FFN 3072, seed 0) with
    :func:`any_tokenizer`, saved in ``folder``: the shape the GPU benchmarks and GPU tests time, never accuracy."""
    tok = any_tokenizer()
    enc = random_bert(hidden=768, layers=12, heads=12, vocab=tok.get_vocab_size(), intermediate=3072, seed=0)
    meta = ModelMeta(
        kind="intent",
        base="bert-base-random",
        bert_config=enc.config.to_diff_dict(),
        labels=[f"label_{i}" for i in range(num_labels)],
        max_length=128,
    )
    return save_checkpoint(folder, IntentClassifier(enc, num_labels).eval(), meta, tok)
