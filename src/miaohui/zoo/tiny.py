"""A self-made WordPiece tokenizer for random-weight models (tests, GPU shape benchmarks) on machines
without the MiniLM package. Real models always use their own tokenizer."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def word_tokenizer(vocab_size: int = 30522) -> Tokenizer:
    """Specials, ASCII, common CJK characters, then filler pieces up to ``vocab_size`` ids."""
    pieces = list(SPECIALS) + [chr(c) for c in range(33, 127)] + [chr(c) for c in range(0x4E00, 0x4E00 + 8000)]
    pieces += [f"##{chr(c)}" for c in range(97, 123)]
    pieces += [f"[unused{i}]" for i in range(max(0, vocab_size - len(pieces)))]
    vocab = {p: i for i, p in enumerate(pieces[:vocab_size])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tok.decoder = decoders.WordPiece()
    return tok


def any_tokenizer(vocab_size: int = 30522) -> Tokenizer:
    """MiniLM's real tokenizer where the package is installed, else :func:`word_tokenizer`."""
    try:
        from miaohui.zoo.minilm import load_minilm_tokenizer

        return load_minilm_tokenizer()
    except Exception:
        return word_tokenizer(vocab_size)


def save_tiny_intent(folder: Path) -> Path:
    """A tiny random-weight BERT intent classifier (2 layers, hidden 32, 4 labels) with :func:`any_tokenizer`,
    saved as a checkpoint in ``folder``: fast serving tests and host-path benchmarks, never accuracy."""
    from miaohui.models.checkpoint import ModelMeta, save_checkpoint
    from miaohui.models.intent import IntentClassifier, random_bert

    tok = any_tokenizer()
    encoder = random_bert(hidden=32, layers=2, heads=2, vocab=tok.get_vocab_size(), max_positions=128)
    meta = ModelMeta(
        kind="intent",
        base="tiny-random",
        bert_config=encoder.config.to_diff_dict(),
        labels=["greeting", "goodbye", "human_agent", "out_of_scope"],
        max_length=64,
    )
    return save_checkpoint(folder, IntentClassifier(encoder, num_labels=4).eval(), meta, tok)


def save_bert_base_intent(folder: Path, num_labels: int = 24) -> Path:
    """A BERT-base-shaped random-weight intent classifier (12 layers × 768, 12 heads, FFN 3072, seed 0) with
    :func:`any_tokenizer`, saved in ``folder``: the shape the GPU benchmarks and GPU tests time, never accuracy."""
    from miaohui.models.checkpoint import ModelMeta, save_checkpoint
    from miaohui.models.intent import IntentClassifier, random_bert

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
