"""Batched tokenization with HF ``tokenizers`` (Rust, releases the GIL) and padding to numpy arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from miaohui.errors import ArtifactError, InputError


class TextTokenizer:
    """Encodes text to ``input_ids`` / ``attention_mask`` (int64) for encoder engines."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, pad_id: int | None = None) -> None:
        self._tok = tokenizer
        self._tok.no_padding()
        self._tok.no_truncation()
        self.max_length = max_length
        self.pad_id = pad_id if pad_id is not None else _guess_pad_id(tokenizer)

    @classmethod
    def from_file(cls, path: Path, max_length: int) -> TextTokenizer:
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ArtifactError(
                f"cannot read tokenizer {path}: {exc}", "rebuild the artifact; its tokenizer.json is damaged"
            ) from exc
        return cls(tok, max_length)

    def to_str(self) -> str:
        return self._tok.to_str()

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids (with special tokens) of each text, unpadded and untruncated."""
        return [enc.ids for enc in self._tok.encode_batch(texts, add_special_tokens=True)]

    def encode(self, texts: list[str], truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Pad to the longest text. Over-long texts raise :class:`InputError` unless ``truncate``."""
        ids = self.token_ids(texts)
        if truncate:
            ids = [truncate_ids(seq, self.max_length) for seq in ids]
        else:
            for i, seq in enumerate(ids):
                check_length(seq, self.max_length, i)
        return pad_batch(ids, self.pad_id)


def truncate_ids(ids: list[int], max_length: int) -> list[int]:
    """Keep the first ``max_length - 1`` tokens and the final special token."""
    if len(ids) <= max_length:
        return ids
    return [*ids[: max_length - 1], ids[-1]]


def check_length(ids: list[int], max_length: int, index: int = 0) -> None:
    if len(ids) > max_length:
        raise InputError(
            f"text #{index} is {len(ids)} tokens long; this model accepts at most {max_length}",
            "shorten the text or split it into several requests",
        )


def pad_batch(seqs: list[list[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id lists to ``length`` (default: the longest) → (ids, mask), both int64."""
    width = max(length or 0, max((len(s) for s in seqs), default=1))
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def _guess_pad_id(tok: Tokenizer) -> int:
    for piece in ("<pad>", "[PAD]"):
        pid = tok.token_to_id(piece)
        if pid is not None:
            return pid
    return 0
