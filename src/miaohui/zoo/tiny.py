"""A self-made WordPiece tokenizer for random-weight models (tests, GPU shape benchmarks) on machines
without the MiniLM package. Real models always use their own tokenizer."""

from __future__ import annotations

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
