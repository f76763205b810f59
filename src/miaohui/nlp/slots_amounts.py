"""Money slots: ``card_tail`` (four digits after 尾号 / "ending in"), ``percent`` and ``amount`` (currency or
multiplier, ranges sharing the unit); the rules are :mod:`miaohui.nlp.slots`'s docstring."""

from __future__ import annotations

import re

from miaohui.nlp.normalize import CN_DIGITS, cn_to_number
from miaohui.nlp.numbers import NUMERAL_PATTERN, parse_english_number
from miaohui.nlp.slots_base import CN_D, Candidate

_RANGE_HEAD_RE = re.compile(rf"(?<![\d.{CN_D}十百千万亿])({NUMERAL_PATTERN})\s*(?:到|至|-|~|—|–)\s*$")
_EN_NUM_WORDS = (
    r"(?:zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen"
    r"|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety"
    r"|hundred|thousand|million|billion)"
)
_EN_NUM_SEQ = rf"\b{_EN_NUM_WORDS}(?:(?:\s+and\s+|\s+|-){_EN_NUM_WORDS})*\b"


def _num(text: str) -> float | None:
    """Parse a numeral found by the regexes (Arabic, Chinese or mixed)."""
    return cn_to_number(text)


def _range_head(masked: str, start: int) -> tuple[int, int, str] | None:
    """The bare numeral of ``3到`` / ``3-`` right before ``start``, as (start, end, numeral)."""
    m = _RANGE_HEAD_RE.search(masked, max(0, start - 24), start)
    return (m.start(1), m.end(1), m.group(1)) if m else None


_CARD_TAIL_RE = re.compile(
    rf"""
    (?P<cn>(?:尾号|尾数|末尾|卡号后四位|后四位|末四位|最后四位)(?:数字|号码|号)?\s*(?:是|为|:)?\s*)
    (?P<d>\d{{4}}|[{CN_D}]{{4}})(?![\d{CN_D}])
    |
    (?:ending|ends)\s+(?:in|with)\s+(?P<e1>\d{{4}})(?!\d)
    |
    last\s+(?:four|4)\s+(?:digits?|numbers?)\s*(?:of\s+(?:my|the)\s+card\s*)?(?:are|is)?\s*:?\s*(?P<e2>\d{{4}})(?!\d)
    """,
    re.X | re.I,
)


def card_tails(folded: str) -> list[Candidate]:
    """Last four digits of a bank card."""
    found: list[Candidate] = []
    for m in _CARD_TAIL_RE.finditer(folded):
        group = "d" if m["d"] else ("e1" if m["e1"] else "e2")
        if group == "d" and re.search(r"(?:手机|电话|号码)号?$", folded[max(0, m.start() - 4) : m.start()]):
            continue
        raw = m[group]
        digits = raw if raw.isdigit() else "".join(str(CN_DIGITS[c]) for c in raw)
        found.append(Candidate("card_tail", m.start(group), m.end(group), digits))
    return found


_PERCENT_RE = re.compile(
    rf"""
    (?P<pre>百分之|千分之)(?P<n1>{NUMERAL_PATTERN})
    | (?<![A-Za-z])(?P<n2>{NUMERAL_PATTERN})\s*(?P<post>%|percent\b|per\s?cent\b|pct\b|个百分点|百分点|个点)
    | (?P<full>百分百)
    | (?:年化|收益率|利率|回报率|利息)(?:收益率?)?(?:大概|大约|约|是|为|在|有|能到|能有|达到|可以到|\s)*
      (?P<n3>\d{{1,2}}(?:\.\d+)?|[{CN_D}十]{{1,3}}(?:点[{CN_D}]+)?)
      (?![\d.{CN_D}十百千万亿元块%]|\s*(?:个|w|k|percent|万|元|块))
    """,
    re.X | re.I,
)


def percents(masked: str) -> list[Candidate]:
    """Percentages, as the percent number."""
    found: list[Candidate] = []
    for m in _PERCENT_RE.finditer(masked):
        if m["full"]:
            found.append(Candidate("percent", m.start(), m.end(), 100.0, "%"))
            continue
        group = "n1" if m["n1"] else ("n2" if m["n2"] else "n3")
        value = _num(m[group])
        if value is None or (group == "n3" and not 0 < value <= 30):
            continue
        if m["pre"] == "千分之":
            value = float(f"{value / 10:.12g}")
        start = m.start() if group == "n1" else m.start(group)
        end = m.end() if group != "n3" else m.end("n3")
        found.append(Candidate("percent", start, end, value, "%"))
        head = _range_head(masked, start) if group == "n2" else None
        if head and (head_value := _num(head[2])) is not None:
            found.append(Candidate("percent", head[0], head[1], head_value, "%"))
    return found


_CURRENCY = {
    "$": "USD", "us$": "USD", "usd": "USD", "美元": "USD", "美金": "USD", "刀": "USD",
    "dollar": "USD", "dollars": "USD", "bucks": "USD",
    "hk$": "HKD", "hkd": "HKD", "港币": "HKD", "港元": "HKD",
    "€": "EUR", "eur": "EUR", "欧元": "EUR", "日元": "JPY", "£": "GBP", "英镑": "GBP",
}  # fmt: skip
_AMOUNT_RE = re.compile(
    rf"""
    (?:(?P<pre>US\$|HK\$|\$|¥|€|£|RMB|CNY|USD|HKD|EUR|人民币|美元|美金|港币|港元)\s*|(?<![A-Za-z\d.]))
    (?P<num>{NUMERAL_PATTERN})
    (?P<mult>[kKwW](?![A-Za-z])|\s*(?:thousand|million|billion|grand)\b)?
    (?:\s*(?P<post>块钱|块(?!儿|屏|地|田|肉|石|砖|布|板|表|糖|蛋糕|区域|牌|玻璃|钱包|去|走|来|吃|玩)
        |元(?!旦|素|宵)|圆|人民币|美元|美金|刀(?![子片具])|港币|港元|欧元|日元|英镑
        |毛钱|毛(?!衣|巾|病|笔|孩|利|绒|发|线|毯)|角钱|角(?!度|落|色)
        |yuan\b|rmb\b|cny\b|usd\b|hkd\b|eur\b|dollars?\b|bucks\b)
      (?:(?P<jiao>[一二两三四五六七八九\d](?![\d{CN_D}十百千万亿]))(?:毛钱?|角钱?)?)?)?
    """,
    re.X | re.I,
)
_EN_AMOUNT_RE = re.compile(
    rf"(?P<num>{_EN_NUM_SEQ})\s*(?P<post>yuan|rmb|dollars?|bucks|usd)?\b",
    re.I,
)
_MULTIPLIERS = {"k": 1e3, "w": 1e4, "thousand": 1e3, "grand": 1e3, "million": 1e6, "billion": 1e9}
_COUNTED_NOUN_RE = re.compile(
    r"\s*(?:多|余)?(?:人|步|次|个|名|户|辆|台|公里|千米|米|平|字|件|张|股|份|只|条|粉|票|册|本|家|所|吨|斤"
    r"|公斤|亩|年|天|小时|分钟|英里|km|kg|用户|网友|观众|people|users|steps|views)",
    re.I,
)
_TAIL_CLASSIFIERS = frozenset("个年月天次笔张份只件位家周人")


def _amount_value(m: re.Match[str]) -> tuple[float, int] | None:
    """Value of an amount match and where the numeric part ends (before the currency)."""
    num = m["num"]
    end = m.end("num")
    tail_digit = len(num) >= 2 and num[-1] in CN_DIGITS and num[-2] in "万千百亿"
    if tail_digit and m["post"] is None and m.string[end : end + 1] in _TAIL_CLASSIFIERS:
        num, end = num[:-1], end - 1  # "5万一个月": the 一 belongs to 一个月
    value = _num(num)
    if value is None:
        return None
    if m["mult"] and num[-1].isdigit():
        value *= _MULTIPLIERS[m["mult"].strip().lower()]
        end = m.end("mult")
    return value, end


def amounts(masked: str) -> list[Candidate]:
    """Money amounts with their currency."""
    found: list[Candidate] = []
    for m in _AMOUNT_RE.finditer(masked):
        parsed = _amount_value(m)
        if parsed is None:
            continue
        value, num_end = parsed
        currency_word = (m["pre"] or m["post"] or "").lower()
        big = bool(re.search(r"[万亿萬億]", masked[m.start("num") : num_end])) or bool(
            m["mult"] and num_end == m.end("mult")
        )
        if not currency_word and not big:
            continue
        if m["post"] is None and _COUNTED_NOUN_RE.match(masked, num_end):
            continue
        end = m.end() if m["post"] else num_end
        if m["post"] and m["post"][0] in "毛角":
            value /= 10  # 五毛 = 0.5 yuan
        elif m["jiao"] and m["post"] in ("块", "块钱"):
            value += (int(m["jiao"]) if m["jiao"].isdigit() else CN_DIGITS[m["jiao"]]) / 10  # 三块五 = 3.5
        unit = _CURRENCY.get(currency_word, "CNY")
        start = m.start("pre") if m["pre"] else m.start("num")
        found.append(Candidate("amount", start, end, float(f"{value:.12g}"), unit))
        found.extend(_amount_range_head(masked, start, m["num"], value, unit))
    found.extend(_english_amounts(masked))
    return found


def _amount_range_head(masked: str, start: int, num: str, value: float, unit: str) -> list[Candidate]:
    """``3到5万`` / ``300-500元``: the first end of a range takes the unit and multiplier of the second."""
    head = _range_head(masked, start)
    if head is None:
        return []
    head_value = _num(head[2])
    if head_value is None:
        return []
    unit_m = re.search(r"[百千万亿]+$", num)
    multiplier = 1.0
    if unit_m and unit_m.start() > 0 and num[unit_m.start() - 1] not in "十拾":
        multiplier = _num("一" + unit_m.group()) or 1.0
        tail_value = _num(num[: unit_m.start()])
        if tail_value is None or head_value >= tail_value:
            multiplier = 1.0
    return [Candidate("amount", head[0], head[1], float(f"{head_value * multiplier:.12g}"), unit)]


def _english_amounts(folded: str) -> list[Candidate]:
    """``two thousand`` / ``five hundred dollars``: English number words with a currency or a scale."""
    found: list[Candidate] = []
    for m in _EN_AMOUNT_RE.finditer(folded):
        words = m["num"]
        has_scale = re.search(r"thousand|million|billion", words, re.I) is not None
        if not (m["post"] or has_scale):
            continue
        value = parse_english_number(words)
        if value is None:
            continue
        if not m["post"] and _COUNTED_NOUN_RE.match(folded, m.end("num")):
            continue
        end = m.end() if m["post"] else m.end("num")
        found.append(Candidate("amount", m.start(), end, value, _CURRENCY.get((m["post"] or "").lower(), "CNY")))
    return found
