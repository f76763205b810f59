"""Incremental detokenization: text deltas that are correct across UTF-8 and BPE token boundaries.

A byte-level BPE token may hold half of a multi-byte character (Chinese, emoji), and a token's text can
depend on its neighbours (leading spaces, merges). Decoding each token alone is therefore wrong. The
usual fix (TGI, vLLM): keep two offsets into the ids, decode the window ``[prefix, read)`` and
``[prefix, end)``, and emit the difference only when the longer text does not end in U+FFFD (an
incomplete character). A few prompt tokens seed the window so the first output token decodes in context.

This runs once per generated token in the engine loop, so it avoids most of those decodes without changing a
delta: the window's text is kept until the window moves (it was decoded or emitted already), a one-token window's
text comes from a per-tokenizer cache of each token's text alone, and for a plain byte-level decoder (GPT-2 style
BPE: SmolLM2, Qwen, Llama 3) a token whose text is complete after a complete window simply appends its text. That
holds because such a decoder decodes the concatenated bytes of the tokens: when the window's bytes and the token's
bytes are each valid UTF-8 (no U+FFFD in their texts), their concatenation decodes to the two texts joined, and
after an emitted delta the new window ``[read, end)`` decodes to that delta. Anything else (an incomplete character,
an invalid byte, other decoders such as Metaspace or WordPiece) decodes the window as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"
_CONTEXT = 4
_MAX_CACHED_TOKENS = 1 << 18
"""Most token texts one cache holds (each entry is one short string; vocabularies are up to ~260k tokens)."""


def is_byte_level(tokenizer: object) -> bool:
    """Whether ``tokenizer`` is a ``tokenizers.Tokenizer`` whose decoder is exactly a ``ByteLevel`` one (its decode
    of a token list is the UTF-8 decoding, U+FFFD for invalid bytes, of the tokens' concatenated bytes)."""
    try:
        from tokenizers import Tokenizer, decoders
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        return False
    return isinstance(tokenizer, Tokenizer) and type(tokenizer.decoder) is decoders.ByteLevel


class IncrementalDetokenizer:
    """``push(token_id) -> text delta`` (maybe ``""`` while a character is incomplete); ``flush()`` at
    the end returns what is still held (an incomplete character decodes to U+FFFD).

    ``token_texts`` (token id -> its text decoded alone) may be shared by the detokenizers of one tokenizer and
    ``skip_special_tokens`` (the factory's are); ``byte_level``: whether the tokenizer's decode concatenates token
    bytes (see the module docstring; None: find out with :func:`is_byte_level`)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        token_texts: dict[int, str] | None = None,
        byte_level: bool | None = None,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text: str | None = None
        """The text of the window ``ids[prefix:read]`` once known (None: decode it when needed)."""
        self._texts: dict[int, str] = {} if token_texts is None else token_texts
        self._concat = is_byte_level(tokenizer) if byte_level is None else byte_level

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=self._skip)
            if len(self._texts) < _MAX_CACHED_TOKENS:
                self._texts[token_id] = text
        return text

    def _window_text(self) -> str:
        """The text of ``ids[prefix:read]`` (kept until the window moves)."""
        text = self._prefix_text
        if text is None:
            window = self._ids[self._prefix : self._read]
            text = self._prefix_text = self._token_text(window[0]) if len(window) == 1 else self._decode(window)
        return text

    def push(self, token_id: int) -> str:
        ids = self._ids
        token_id = int(token_id)
        ids.append(token_id)
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._window_text()
        end = len(ids)
        if self._concat and self._read == end - 1 and _INCOMPLETE not in prefix_text:
            text = self._texts.get(token_id)
            if text is None:
                text = self._token_text(token_id)
            if _INCOMPLETE not in text:  # the new text is prefix_text + text
                if text:
                    self._prefix, self._read = self._read, end
                    self._prefix_text = text
                return text
        new_text = self._decode(ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_INCOMPLETE):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, end
            # a byte-level window that was valid UTF-8 ends on a character boundary: the new window's text is delta
            self._prefix_text = delta if self._concat and _INCOMPLETE not in prefix_text else None
            return delta
        return ""

    def flush(self) -> str:
        prefix_text = self._window_text()
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        self._prefix_text = None
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def detokenizer_factory(tokenizer: Tokenizer) -> _Factory:
    """A callable ``prompt_ids -> IncrementalDetokenizer`` for the scheduler."""
    return _Factory(tokenizer)


class _Factory:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._texts: dict[int, str] = {}
        """Each token's text alone, shared by the detokenizers (the same for every sequence of a tokenizer)."""
        self._concat = is_byte_level(tokenizer)

    def __call__(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok, prompt_ids, token_texts=self._texts, byte_level=self._concat)
