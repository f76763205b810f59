"""Incremental detokenization: text deltas that are correct across UTF-8 and BPE token boundaries.

A byte-level BPE token may hold half of a multi-byte character (Chinese, emoji), and a token's text can
depend on its neighbours (leading spaces, merges). Decoding each token alone is therefore wrong. The
usual fix (TGI, vLLM): keep two offsets into the ids, decode the window ``[prefix, read)`` and
``[prefix, end)``, and emit the difference only when the longer text does not end in U+FFFD (an
incomplete character). A few prompt tokens seed the window so the first output token decodes in context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"
_CONTEXT = 4


class IncrementalDetokenizer:
    """``push(token_id) -> text delta`` (maybe ``""`` while a character is incomplete); ``flush()`` at
    the end returns what is still held (an incomplete character decodes to U+FFFD)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_INCOMPLETE):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def detokenizer_factory(tokenizer: Tokenizer) -> _Factory:
    """A callable ``prompt_ids -> IncrementalDetokenizer`` for the scheduler."""
    return _Factory(tokenizer)


class _Factory:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    def __call__(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok, prompt_ids)
