"""Find every numeric quantity in a text, and check a reply's numbers against its sources.

Used by the compliance check "every number in a bot reply must come from the user's words or the knowledge
base": :func:`numbers_grounded` returns the numbers of a reply that no source mentions.

What counts as a number (each mention gives one float; the sign is ignored):

* Arabic numbers, with thousands commas and decimals: ``2,000`` → 2000, ``3.5`` → 3.5, ``09`` → 9.
* Chinese numerals and mixes: ``五万`` → 50000, ``三点五`` → 3.5, ``一百零五`` → 105, ``1万5`` → 15000,
  digit readings ``幺三八`` → 138 (see :func:`miaohui.nlp.normalize.cn_to_number`); prices ``三块五`` → 3.5.
* Multipliers: ``5万`` → 50000, ``1.5亿``, ``2k`` → 2000, ``1.5w`` → 15000, ``10 thousand`` → 10000,
  ``1.5 million``.
* Percents as their number: ``年化5%`` → 5.0, ``百分之四`` → 4.0, ``4.5个点`` → 4.5, ``3.5 percent`` → 3.5,
  ``千分之五`` → 0.5 (per-mille is converted to percent), ``百分百`` → 100.
* English number words: ``two thousand`` → 2000, ``twenty-five`` → 25.
* Ranges share their multiplier: ``3到5万`` → 30000, 50000; ``3-5%`` → 3, 5. Approximate ranges give both
  ends: ``两三天`` → 2, 3; ``三五万`` → 30000, 50000.
* Clock times are split: ``下午三点五十`` → 3, 50; ``3点05分`` → 3, 5.

What does not count: ordinals (``第一``, ``第3``), list markers (``一、``, ``1、``), digits glued to a
preceding ASCII letter (``H200``, ``R2``, ``5G`` counts 5 though), the article-like lone ``一`` (``一下``,
``一个``, ``一起``; it counts before a unit of time, money or measure: ``一年``, ``一万``, ``一个月``,
``一元``), lone ``one`` unless a unit follows, and a curated list of words that merely contain numerals
(``十分``, ``千万别``, ``万一``, ``一五一十``, ``五险一金``, ``四川``, ``零钱`` ...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from miaohui.nlp.normalize import CN_DIGITS, CN_UNITS, cn_to_number, fold_with_offsets

__all__ = [
    "ARABIC_PATTERN",
    "CN_NUMERAL_CHARS",
    "NUMERAL_PATTERN",
    "NumberMention",
    "extract_numbers",
    "find_numbers",
    "mask_non_quantities",
    "numbers_grounded",
    "parse_english_number",
]

# --------------------------------------------------------------------------------------------- patterns

_CN_DIGIT_CHARS = "".join(CN_DIGITS)
CN_NUMERAL_CHARS = _CN_DIGIT_CHARS + "".join(CN_UNITS)
#: An Arabic number: thousands commas (``1,234,567.8``) or plain digits with an optional decimal part.
ARABIC_PATTERN = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
#: One numeral: Arabic numbers, Chinese digits/units, and 点 as a decimal point when a digit follows.
NUMERAL_PATTERN = (
    rf"(?:{ARABIC_PATTERN}|[{CN_NUMERAL_CHARS}])"
    rf"(?:{ARABIC_PATTERN}|[{CN_NUMERAL_CHARS}]|点(?=[{_CN_DIGIT_CHARS}\d]))*"
)

_NUMBER_RE = re.compile(
    rf"""
    (?P<pct_pre>百分之|千分之|万分之)?
    (?P<num>{NUMERAL_PATTERN})
    (?P<kw>[kKwW](?![A-Za-z]))?
    (?P<scale>\s*(?:thousand|million|billion)\b)?
    (?P<pct>\s*(?:%|percent\b|per\s?cent\b|pct\b|个百分点|百分点|个点))?
    """,
    re.X | re.I,
)
_HUNDRED_PERCENT_RE = re.compile(r"百分百")

_EN_SMALL = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
    "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30,
    "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90,
}  # fmt: skip
_EN_SCALE = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
_EN_WORD = "|".join(sorted([*_EN_SMALL, *_EN_SCALE], key=len, reverse=True))
_EN_NUMBER_RE = re.compile(
    rf"\b(?:{_EN_WORD})(?:(?:\s+and\s+|\s+|-)(?:{_EN_WORD}))*\b(?P<pct>\s*(?:%|percent\b|per\s?cent\b))?",
    re.I,
)
_EN_ONE_UNIT_RE = re.compile(
    r"\s*(?:years?|months?|weeks?|days?|hours?|minutes?|seconds?|percent|%|dollars?|yuan|rmb|usd|"
    r"bucks|times|point|o'clock|am\b|pm\b)",
    re.I,
)

#: Words that contain numeral characters without stating a quantity; masked before matching.
_MASK_RE = re.compile(
    r"十分(?!钟)|十足|十全十美|万分|(?<![\d零〇一二两三四五六七八九十百])千万(?![元块美亿])|千千万万"
    r"|三心二意|五湖四海|七上八下|乱七八糟|一五一十|四面八方|五花八门|九牛一毛|千方百计|千军万马|万无一失"
    r"|一清二楚|独一无二|接二连三|三番五次|三番两次|丢三落四|不三不四|一干二净|一心一意|一模一样|一带一路"
    r"|五险一金|三险一金|四川|三亚|十堰|九江|六安|三明|五华|七星|二七|万达|三星|万科|一汽|五粮液|九寨沟"
    r"|八达岭|九龙|三里屯|五道口|千岛湖|万州|八卦|七夕|九州|五金|三农|十字|二手|三甲|一把手|两会"
    r"|零钱|零售|零花|零食|零用|零件|零星|零散|零碎|零工|零存整取|零头|零部件|零下"
)
#: After a lone 一, the units that make it a quantity rather than an article.
_ONE_UNITS_RE = re.compile(
    r"(?:个?月|年|天|日|个?星期|周|个?小时|分钟|秒|岁|元|块钱|块|毛|角|美元|港元|欧元|倍|成|号|期|级|档"
    r"|个?百分点|个点|楼|层|套房|米|公里|斤|公斤|克|吨|万|亿|千|百|点钟|点半|点整|个工作日)"
)
_ONE_AFTER_RE = re.compile(r"(?:周|星期|礼拜|初)$")
_TIME_OF_DAY_RE = re.compile(r"(?:上午|下午|中午|晚上|早上|早晨|凌晨|傍晚|夜里|半夜|今晚|明晚|今早|明早|早|晚)$")
_CLASSIFIERS = frozenset("个年月天次笔张份只件位家周人元块")
_RANGE_GAP_RE = re.compile(r"\s*(?:到|至|-|~|～|—|–|to|or)\s*", re.I)
_APPROX_RANGE_RE = re.compile(r"([一二两三四五六七八九])([二三四五六七八九])([十百千万亿]*)")
_TRAILING_UNITS_RE = re.compile(r"[百千万亿]+$")
_BIG_UNIT_CHARS = "百千万亿佰仟萬億"
_CURRENCY_CODE_RE = re.compile(r"(?:RMB|CNY|USD|HKD|EUR|GBP|JPY)$", re.I)
#: ``三块五`` = 3.5 yuan: 块 used as the decimal point of a price.
_YUAN_JIAO_RE = re.compile(
    rf"(?<![\d{CN_NUMERAL_CHARS}])(?P<yuan>[{CN_NUMERAL_CHARS}]+|\d+)块钱?(?P<jiao>[一二两三四五六七八九\d])"
    rf"(?![\d{CN_NUMERAL_CHARS}])(?:毛钱?|角钱?)?"
)


class NumberMention(BaseModel):
    """One numeric quantity found in a text; ``start``/``end`` index the caller's original string."""

    model_config = ConfigDict(frozen=True)

    value: float
    text: str
    start: int
    end: int
    percent: bool = False
    #: The multiplier the mention carries (万 → 10000, k → 1000, % → 1); used to spread it across ranges.
    multiplier: float = 1.0


# --------------------------------------------------------------------------------------------- helpers


def parse_english_number(words: str) -> float | None:
    """Parse English number words (``two thousand five hundred``, ``twenty-five``); None if malformed."""
    tokens = [t for t in re.split(r"[\s-]+", words.lower()) if t and t != "and"]
    if not tokens:
        return None
    total = current = 0
    seen_digit = False
    for token in tokens:
        if token in _EN_SMALL:
            current += _EN_SMALL[token]
            seen_digit = True
        elif token == "hundred":
            if not seen_digit:
                return None
            current *= 100
        elif token in _EN_SCALE:
            if not seen_digit:
                return None
            total += current * _EN_SCALE[token]
            current = 0
        else:
            return None
    return float(total + current)


def mask_non_quantities(text: str) -> str:
    """Blank out non-quantity words with NULs (same length, so offsets stay valid)."""
    return _MASK_RE.sub(lambda m: "\0" * len(m.group()), text)


def _is_excluded(masked: str, start: int, end: int, num: str) -> bool:
    """Ordinals, list markers, identifiers (H200) and the article-like lone 一."""
    before = masked[max(0, start - 3) : start]
    after = masked[end : end + 6]
    if before.endswith("第"):
        return True
    if after[:1] == "、" and (start == 0 or masked[start - 1] in "\n \0。，,;；:：("):
        return True
    if before.endswith("(") and after.startswith(")"):
        return True  # "(1)" / "（一）" list markers (full-width brackets are folded to ASCII)
    if num[0].isdigit() and before[-1:].isascii() and before[-1:].isalpha():
        return not _CURRENCY_CODE_RE.search(before)  # "RMB5000" is money, "H200" an identifier
    if num in ("一", "壹"):
        if _ONE_AFTER_RE.search(before) or _ONE_UNITS_RE.match(after):
            return False
        return not (after[:1] == "点" and _TIME_OF_DAY_RE.search(before))
    return False


def _trim_classifier_tail(num: str, after: str) -> str:
    """``5万一个月`` matches ``5万一``; drop the digit that belongs to the classifier phrase."""
    if len(num) >= 2 and num[-1] in CN_DIGITS and num[-2] in _BIG_UNIT_CHARS and after[:1] in _CLASSIFIERS:
        return num[:-1]
    return num


def _split_clock(num: str, before: str, after: str) -> list[str] | None:
    """Split ``三点五十`` / ``3点05`` (+分) / ``下午三点五`` into hour and minute numerals."""
    if "点" not in num:
        return None
    value = cn_to_number(num)
    if value is not None and not after.startswith("分") and not _TIME_OF_DAY_RE.search(before):
        return None
    return [part for part in num.split("点") if part]


def _approximate_range(num: str) -> list[float] | None:
    """``两三`` → [2, 3], ``三五万`` → [30000, 50000]; None if ``num`` is not such a range."""
    m = _APPROX_RANGE_RE.fullmatch(num)
    if not m or CN_DIGITS[m[2]] <= CN_DIGITS[m[1]]:
        return None
    unit = cn_to_number("一" + m[3]) if m[3] else 1.0
    if unit is None:
        return None
    return [CN_DIGITS[m[1]] * unit, CN_DIGITS[m[2]] * unit]


def _trailing_multiplier(num: str) -> tuple[float, float | None]:
    """The trailing 百/千/万/亿 multiplier of a numeral and the number before it (``5千`` → 1000, 5)."""
    m = _TRAILING_UNITS_RE.search(num)
    if not m or m.start() == 0:
        return 1.0, None
    head = num[: m.start()]
    if head[-1] in "十拾":
        return 1.0, None
    return cn_to_number("一" + m.group()) or 1.0, cn_to_number(head)


# --------------------------------------------------------------------------------------------- scanning


def _mentions_from_match(m: re.Match[str], masked: str, text: str, offsets: list[int]) -> list[NumberMention]:
    """Turn one regex match into zero or more mentions (clock times and ranges give two)."""
    num, start = m["num"], m.start("num")
    while num and num[0] in _BIG_UNIT_CHARS:
        num, start = num[1:], start + 1
    if not num:
        return []
    num = _trim_classifier_tail(num, masked[m.end("num") :])
    end = start + len(num)
    if _is_excluded(masked, start, end, num):
        return []
    before = masked[max(0, start - 3) : start]
    clock = _split_clock(num, before, masked[end:])
    if clock is not None:
        values = [cn_to_number(part) for part in clock]
        return [_mention(v, start, end, text, offsets) for v in values if v is not None]
    value = cn_to_number(num)
    if value is None:
        pair = _approximate_range(num)
        return [_mention(v, start, end, text, offsets) for v in pair] if pair else []
    multiplier, _ = _trailing_multiplier(num)
    if m["kw"] and num[-1].isdigit():
        factor = 1e3 if m["kw"].lower() == "k" else 1e4
        value, multiplier, end = value * factor, multiplier * factor, m.end("kw")
    if m["scale"] and num[-1].isdigit():
        factor = float(_EN_SCALE[m["scale"].strip().lower()])
        value, multiplier, end = value * factor, multiplier * factor, m.end("scale")
    percent = bool(m["pct_pre"] or m["pct"])
    if m["pct_pre"]:
        value *= {"百分之": 1.0, "千分之": 0.1, "万分之": 0.01}[m["pct_pre"]]
        start = m.start("pct_pre")
    if m["pct"]:
        end = m.end("pct")
    return [_mention(value, start, end, text, offsets, percent=percent, multiplier=multiplier)]


def _mention(
    value: float,
    start: int,
    end: int,
    text: str,
    offsets: list[int],
    *,
    percent: bool = False,
    multiplier: float = 1.0,
) -> NumberMention:
    """Build a mention, mapping folded offsets back to the original string."""
    o_start, o_end = offsets[start], offsets[end - 1] + 1
    return NumberMention(
        value=float(f"{abs(value):.12g}"),
        text=text[o_start:o_end],
        start=o_start,
        end=o_end,
        percent=percent,
        multiplier=multiplier,
    )


def _english_mentions(folded: str, text: str, offsets: list[int]) -> list[NumberMention]:
    """Mentions written as English number words."""
    found: list[NumberMention] = []
    for m in _EN_NUMBER_RE.finditer(folded):
        words = m.group().removesuffix(m["pct"] or "")
        if words.strip().lower() == "one" and not _EN_ONE_UNIT_RE.match(folded, m.end()):
            continue
        value = parse_english_number(words)
        if value is None:
            continue
        found.append(_mention(value, m.start(), m.end(), text, offsets, percent=bool(m["pct"])))
    return found


def _spread_ranges(mentions: list[NumberMention], folded_text: str) -> list[NumberMention]:
    """Give the first end of ``3到5万`` / ``3-5%`` the multiplier or percent of the second end."""
    result = list(mentions)
    for i in range(len(result) - 1):
        a, b = result[i], result[i + 1]
        if a.multiplier != 1.0 or a.percent or not (b.multiplier != 1.0 or b.percent):
            continue
        if not _RANGE_GAP_RE.fullmatch(folded_text[a.end : b.start]):
            continue
        b_head = b.value / b.multiplier if b.multiplier else b.value
        if b.multiplier != 1.0 and a.value >= b_head:
            continue  # "五到一千" is 5–1000, not 5000–1000
        result[i] = a.model_copy(update={"value": a.value * b.multiplier, "percent": b.percent})
    return result


def find_numbers(text: str) -> list[NumberMention]:
    """Every numeric quantity in ``text`` with its span, in order of appearance."""
    folded, offsets = fold_with_offsets(text)
    masked = mask_non_quantities(folded)
    mentions: list[NumberMention] = []
    for m in _YUAN_JIAO_RE.finditer(masked):
        yuan, jiao = cn_to_number(m["yuan"]), cn_to_number(m["jiao"])
        if yuan is not None and jiao is not None:
            mentions.append(_mention(yuan + jiao / 10, m.start(), m.end(), text, offsets))
            masked = masked[: m.start()] + "\0" * (m.end() - m.start()) + masked[m.end() :]
    for m in _NUMBER_RE.finditer(masked):
        mentions.extend(_mentions_from_match(m, masked, text, offsets))
    for m in _HUNDRED_PERCENT_RE.finditer(masked):
        mentions.append(_mention(100.0, m.start(), m.end(), text, offsets, percent=True))
    mentions.extend(_english_mentions(folded, text, offsets))
    mentions.sort(key=lambda x: (x.start, x.end))
    # Ranges are judged on the original string (mentions carry original offsets).
    return _spread_ranges(mentions, text)


def extract_numbers(text: str) -> list[float]:
    """The values of :func:`find_numbers`, in order (``"年化5%，5万起投"`` → ``[5.0, 50000.0]``)."""
    return [m.value for m in find_numbers(text)]


def _close_to_any(value: float, pool: Iterable[float], rel_tol: float) -> bool:
    """True if ``value`` equals (within ``rel_tol``) some number of ``pool``."""
    return any(math.isclose(value, other, rel_tol=rel_tol, abs_tol=0.0) for other in pool)


def numbers_grounded(reply: str, sources: list[str], rel_tol: float = 1e-6) -> list[float]:
    """The numbers of ``reply`` that appear in none of ``sources`` (each once, in order of appearance).

    Values are compared after parsing, so ``5万`` in the reply is grounded by ``50000`` in a source and
    ``三点五`` by ``3.5``; percents are compared as their number (``5%`` is 5, not 0.05). An empty result
    means every number in the reply is grounded.
    """
    pool = [value for source in sources for value in extract_numbers(source)]
    ungrounded: list[float] = []
    for value in extract_numbers(reply):
        if not _close_to_any(value, pool, rel_tol) and not _close_to_any(value, ungrounded, rel_tol):
            ungrounded.append(value)
    return ungrounded
