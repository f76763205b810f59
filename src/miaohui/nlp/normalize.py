"""Text normalization for model input, and Chinese numeral parsing.

Two ways to normalize:

* :func:`normalize_text` — what the intent model sees. Zero-width characters are removed, the text is
  NFKC-normalized (full-width ASCII ``U+FF01–FF5E`` becomes ASCII, so ``５万`` → ``5万`` and ``，`` →
  ``,``; the ideographic space becomes a space; compatibility ideographs and Kangxi radicals become the
  ordinary ideographs), control characters become spaces, whitespace runs collapse to one space and the
  ends are stripped. Chinese punctuation outside the full-width ASCII block (``。、“”《》【】…``) is kept.
  Case is kept (lower-casing is the tokenizer's business).
* :func:`fold_with_offsets` — the same character folding without collapsing whitespace, plus a map from
  every folded character back to its index in the original, so that rule-based extractors can match on
  clean text and still report spans in the caller's string.

:func:`cn_to_number` parses one numeral written with Chinese digits and units, Arabic digits, or a mix
(``二十三``, ``三万五``, ``1.5亿``, ``百分之三点五``, ``幺三八``).
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

__all__ = [
    "CN_DIGITS",
    "CN_UNITS",
    "cn_to_number",
    "fold_with_offsets",
    "normalize_text",
]

#: Characters removed outright: zero-width space/joiners, word joiner, BOM, soft hyphen, Mongolian vowel sep.
_ZERO_WIDTH = frozenset("\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e")
_ZERO_WIDTH_TABLE = dict.fromkeys(map(ord, _ZERO_WIDTH))
_WS_RE = re.compile(r"\s+")

#: Chinese digit characters (financial forms and the ASR forms 幺 = 1, 两 = 2, 〇 = 0 included).
CN_DIGITS: dict[str, int] = {
    "零": 0, "〇": 0, "○": 0,
    "一": 1, "壹": 1, "幺": 1,
    "二": 2, "贰": 2, "两": 2,
    "三": 3, "叁": 3,
    "四": 4, "肆": 4,
    "五": 5, "伍": 5,
    "六": 6, "陆": 6,
    "七": 7, "柒": 7,
    "八": 8, "捌": 8,
    "九": 9, "玖": 9,
}  # fmt: skip
#: Chinese unit characters and their values.
CN_UNITS: dict[str, int] = {
    "十": 10, "拾": 10,
    "百": 100, "佰": 100,
    "千": 1000, "仟": 1000,
    "万": 10_000, "萬": 10_000,
    "亿": 100_000_000, "億": 100_000_000,
}  # fmt: skip
_SMALL_UNITS = frozenset({10, 100, 1000})
_ZERO_CHARS = frozenset("零〇○")
_PERCENT_PREFIXES = {"百分之": 1.0, "千分之": 0.1, "万分之": 0.01}
_ASCII_SUFFIX = {"k": 1e3, "w": 1e4}
_TOKEN_RE = re.compile(r"\d+(?:\.\d+)?|.", re.S)
_THOUSANDS_COMMA_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


# --------------------------------------------------------------------------------------------- folding


def _is_plain(ch: str) -> bool:
    """True for characters that NFKC leaves alone and that are not whitespace (fast path)."""
    return (" " < ch < "\x7f") or ("\u4e00" <= ch <= "\u9fff")


@lru_cache(maxsize=4096)
def _fold_char(ch: str) -> str:
    """Fold one character: drop zero-width, whitespace → space, controls → space, else NFKC."""
    if ch in _ZERO_WIDTH:
        return ""
    if ch.isspace():
        return " "
    if unicodedata.category(ch) == "Cc":
        return " "
    return unicodedata.normalize("NFKC", ch)


class _FoldTable(dict[int, str]):
    """``str.translate`` table of :func:`_fold_char`, filled on first sight of a code point (bounded); the
    characters whose fold is not exactly one character are remembered in ``resized``."""

    LIMIT = 1 << 16

    def __init__(self) -> None:
        super().__init__()
        self.resized: set[str] = set()

    def __missing__(self, code: int) -> str:
        ch = chr(code)
        folded = ch if _is_plain(ch) else _fold_char(ch)
        if len(folded) != 1:
            self.resized.add(ch)
        if len(self) < self.LIMIT:
            self[code] = folded
        return folded


_FOLD = _FoldTable()


def fold_with_offsets(text: str) -> tuple[str, list[int]]:
    """Fold ``text`` character by character and map each folded character to its original index.

    Returns ``(folded, offsets)`` where ``offsets[i]`` is the index in ``text`` of the character that
    produced ``folded[i]``; ``offsets`` has one extra entry, ``len(text)``, so that an end offset can be
    looked up too. Whitespace is not collapsed (every whitespace character becomes one space).
    """
    if text.isascii() and text.isprintable():
        return text, list(range(len(text) + 1))
    folded = text.translate(_FOLD)  # C speed; one character in, one out unless a character is in ``resized``
    if _FOLD.resized.isdisjoint(text):
        return folded, list(range(len(text) + 1))
    out: list[str] = []
    offsets: list[int] = []
    for i, ch in enumerate(text):
        folded = ch if _is_plain(ch) else _fold_char(ch)
        out.append(folded)
        offsets.extend([i] * len(folded))
    offsets.append(len(text))
    return "".join(out), offsets


def normalize_text(text: str) -> str:
    """Normalize an utterance for model input (see the module docstring for the exact rules)."""
    text = text.translate(_ZERO_WIDTH_TABLE)
    text = unicodedata.normalize("NFKC", text)
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)
    return _WS_RE.sub(" ", text).strip()


# --------------------------------------------------------------------------------------------- numerals

# A token is (kind, value, width): kind "num" (a digit or an Arabic number; width = its digit count),
# "zero" (零/〇), "unit" (十百千万亿) or "dot" (点).
_Token = tuple[str, float, int]


def _tokenize(body: str) -> list[_Token] | None:
    """Split a numeral body into tokens; None if a character is not part of a numeral."""
    tokens: list[_Token] = []
    for piece in _TOKEN_RE.findall(body):
        if piece[0].isdigit():
            tokens.append(("num", float(piece), len(piece)))
        elif piece in _ZERO_CHARS:
            tokens.append(("zero", 0.0, 1))
        elif piece in CN_DIGITS:
            tokens.append(("num", float(CN_DIGITS[piece]), 1))
        elif piece in CN_UNITS:
            tokens.append(("unit", float(CN_UNITS[piece]), 1))
        elif piece == "点":
            tokens.append(("dot", 0.0, 1))
        else:
            return None
    return tokens


def _digit_string(tokens: list[_Token]) -> float | None:
    """Read a run of bare digits (``幺三八`` → 138, ``二零二六`` → 2026); None for ``两三``-style ranges."""
    if any(kind == "num" and width != 1 for kind, _, width in tokens):
        return None  # Arabic numbers next to other digits, e.g. "5五"
    has_zero = any(kind == "zero" for kind, _, _ in tokens)
    if len(tokens) == 2 and not has_zero:
        return None  # "两三", "三五": an approximate range, not the number 23 / 35
    return float("".join(str(int(value)) for _, value, _ in tokens))


def _parse_integer(tokens: list[_Token]) -> float | None:
    """Evaluate digit/unit tokens (no dot) with the usual 万/亿 sections; None if malformed."""
    if not tokens:
        return None
    if all(kind in ("num", "zero") for kind, _, _ in tokens):
        return tokens[0][1] if len(tokens) == 1 else _digit_string(tokens)
    total = section = 0.0
    number: float | None = None
    number_width = 0
    prev = ""
    last_unit = 0.0
    last_small = 0.0
    zero_gap = False
    for kind, value, width in tokens:
        if kind == "num":
            if prev == "num":
                return None  # "三五万": two digits in a row inside a unit expression
            number, number_width = value, width
        elif kind == "zero":
            zero_gap = True
        elif value in _SMALL_UNITS:
            if number is None and value != 10:
                return None  # "百", "千万" without a leading digit
            if last_small and value >= last_small:
                return None  # "三十百"
            section += (1.0 if number is None else number) * value
            number, last_unit, last_small, zero_gap = None, value, value, False
        else:  # 万 or 亿
            if number is None and section == 0 and total == 0:
                return None
            section += number or 0.0
            total = (total + section) * value if value > 10_000 else total + section * value
            section, number, last_unit, last_small, zero_gap = 0.0, None, value, 0.0, False
        prev = kind
    if number is not None:
        if prev == "num" and last_unit >= 100 and not zero_gap and number_width == 1:
            number *= last_unit / 10  # colloquial abbreviation: 三万五 = 35000, 两千五 = 2500
        section += number
    return total + section


def _parse_decimal(tokens: list[_Token]) -> float | None:
    """Evaluate tokens holding one 点: integer part, fraction digits, then optional 百/千/万/亿 units."""
    dot = next(i for i, (kind, _, _) in enumerate(tokens) if kind == "dot")
    left, right = tokens[:dot], tokens[dot + 1 :]
    whole = _parse_integer(left) if left else 0.0
    digits = ""
    i = 0
    while i < len(right) and right[i][0] in ("num", "zero"):
        value = right[i][1]
        if value != int(value):
            return None
        digits += str(int(value))
        i += 1
    if whole is None or not digits:
        return None
    scale = 1.0
    for kind, value, _ in right[i:]:
        if kind != "unit" or value == 10:
            return None  # "三点五十" is a clock time, not a decimal
        scale *= value
    return (whole + float("0." + digits)) * scale


def cn_to_number(text: str) -> float | None:
    """Parse one numeral (Chinese, Arabic or mixed); None if ``text`` is not exactly one numeral.

    Handles digits 零〇一二两三…九, 幺 (ASR "one"), financial forms 壹贰叁…, units 十百千万亿, colloquial
    abbreviations (三万五 = 35000, 一百五 = 150), 零 gaps (一百零五), decimals with 点 (三点五, 零点五),
    digit-by-digit readings (幺三八 = 138), Arabic numbers with thousands commas and 万/亿/k/w multipliers
    (5万, 1.5亿, 2,000, 2k, 1.5w), a sign (负/-), and percents, returned as the percent number:
    百分之四 → 4.0, 5% → 5.0, 千分之五 → 0.5. Ambiguous ranges such as 两三 or 三五万 return None.
    """
    s = _THOUSANDS_COMMA_RE.sub("", fold_with_offsets(text)[0]).replace(" ", "")
    sign = 1.0
    if s[:1] in ("负", "-"):
        sign, s = -1.0, s[1:]
    elif s[:1] in ("正", "+"):
        s = s[1:]
    scale = 1.0
    for prefix, factor in _PERCENT_PREFIXES.items():
        if s.startswith(prefix):
            s, scale = s[len(prefix) :], factor
            break
    else:
        if s.endswith("%"):
            s = s[:-1]
    if len(s) > 1 and s[-1].lower() in _ASCII_SUFFIX and s[-2].isdigit():
        scale *= _ASCII_SUFFIX[s[-1].lower()]
        s = s[:-1]
    tokens = _tokenize(s) if s else None
    if not tokens:
        return None
    dots = sum(1 for kind, _, _ in tokens if kind == "dot")
    if dots > 1:
        return None
    value = _parse_decimal(tokens) if dots else _parse_integer(tokens)
    return None if value is None else _tidy(sign * value * scale)


def _tidy(value: float) -> float:
    """Round away binary noise from scaling (1.1 × 10000 = 11000.000000000002 → 11000.0)."""
    return float(f"{value:.12g}")
