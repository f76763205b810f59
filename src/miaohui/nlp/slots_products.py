"""``product`` slots (canonical Chinese product names) and ``risk_level`` slots (the five questionnaire levels);
the rules are :mod:`miaohui.nlp.slots`'s docstring."""

from __future__ import annotations

import re
from collections.abc import Iterator

from miaohui.nlp.slots_base import Candidate, parse_table

#: ``canonical: surface|surface|...`` — English surfaces match case-insensitively on word boundaries.
_PRODUCT_TABLE = """
货币基金: 货币基金|货币型基金|货基|余额宝|money market fund|money market funds
债券基金: 债券基金|债券型基金|债基|纯债基金|bond fund|bond funds
指数基金: 指数基金|指数型基金|index fund|index funds|etf|etfs
股票型基金: 股票基金|股票型基金|偏股基金|偏股型基金|equity fund|equity funds|stock fund|stock funds
混合型基金: 混合基金|混合型基金
基金: 基金|基金定投|定投|mutual fund|mutual funds|fund|funds
黄金: 黄金|金条|纸黄金|积存金|黄金积存|实物黄金|gold
定期: 定期存款|整存整取|零存整取|定期|time deposit|time deposits|fixed deposit|fixed deposits
定期: term deposit|term deposits
活期: 活期存款|活期|demand deposit|demand deposits|current deposit
大额存单: 大额存单|certificate of deposit|certificates of deposit|cd|cds
结构性存款: 结构性存款|structured deposit|structured deposits
存款: 存款|deposit|deposits
理财: 理财产品|银行理财|理财|wealth management product|wealth management products
理财: wealth product|wealth products|wmp|wmps
股票: 股票|炒股|A股|港股|美股|股市|stock|stocks|shares|equities|stock market
国债: 国债|储蓄国债|凭证式国债|电子式国债|treasury bond|treasury bonds|government bond|government bonds
债券: 债券|bond|bonds
外汇: 外汇|换汇|购汇|结汇|forex|foreign exchange|fx
保险: 保险|年金险|重疾险|寿险|意外险|分红险|万能险|商业保险|insurance|annuity|annuities
房贷: 房贷|房屋贷款|住房贷款|按揭|按揭贷款|商贷|mortgage|mortgages|home loan|home loans|housing loan
车贷: 车贷|汽车贷款|car loan|car loans|auto loan|auto loans
消费贷: 消费贷|消费贷款|信用贷|信用贷款|personal loan|personal loans|consumer loan|consumer loans
经营贷: 经营贷|经营贷款
贷款: 贷款|loan|loans
信用卡: 信用卡|credit card|credit cards
借记卡: 借记卡|储蓄卡|debit card|debit cards
"""


_PRODUCTS = parse_table(_PRODUCT_TABLE)
#: Surfaces that need context: what must not follow (or precede) them.
_PRODUCT_NOT_AFTER: dict[str, str] = {
    "黄金": "周|时间|时段|地段|期|档|搭档|比例|法则|分割|年龄|单身|海岸",
    "定期": "检查|体检|更新|清理|维护|举办|开展|召开|培训|回访|巡查|复查|消毒|保养|查看|打扫|联系|通知"
    "|发布|报告|会议|开会|会",
    "保险": "柜|箱|丝|起见|杠|栓",
    "基金": "会",
    "理财": "经理|师|顾问|专员|规划师|知识|课|App|APP|app",
    "存款": "证明",
    "gold": r"\s+(?:card|member|medal)",
}
_PRODUCT_NOT_BEFORE: dict[str, str] = {
    "保险": "社会|医疗|养老|失业|工伤|生育",
    "存款": "定期|活期|结构性|大额",
    "贷款": "住房|房屋|汽车|消费|信用|经营|按揭|公积金",
    "理财": "银行",
}
_CASE_SENSITIVE = frozenset({"cd", "cds", "fx", "etf", "etfs", "wmp", "wmps"})


def _surface_pattern(surface: str) -> str:
    """Regex for one product surface with its context guards and (for English) word boundaries."""
    body = re.escape(surface).replace(r"\ ", r"\s+")
    if surface in _CASE_SENSITIVE:
        body = f"(?-i:{re.escape(surface.upper())})"
    if surface.isascii():
        body = rf"(?<![A-Za-z]){body}(?![A-Za-z])"
    for before in _PRODUCT_NOT_BEFORE.get(surface, "").split("|"):
        if before:
            body = f"(?<!{before}){body}"
    if surface in _PRODUCT_NOT_AFTER:
        body = f"{body}(?!{_PRODUCT_NOT_AFTER[surface]})"
    return body


def _by_first_char(surfaces: list[str]) -> dict[str, re.Pattern[str]]:
    """One regex per (lower-cased) first character, of the surfaces that start with it, longest first.

    Equivalent to one alternation of all surfaces (longest first) tried at every position, but only the few
    surfaces that can start at a position are tried there: the surfaces' patterns open with lookbehinds, which
    keep ``re`` from skipping ahead by first characters itself (≈ 5× faster on a typical request)."""
    groups: dict[str, list[str]] = {}
    for surface in sorted(surfaces, key=len, reverse=True):
        groups.setdefault(surface[0].lower(), []).append(surface)
    return {c: re.compile("|".join(_surface_pattern(s) for s in group), re.I) for c, group in groups.items()}


_PRODUCT_RES = _by_first_char(list(_PRODUCTS))


def _product_matches(folded: str) -> Iterator[re.Match[str]]:
    """Non-overlapping product matches, left to right (what ``finditer`` of the whole alternation gives)."""
    i, n = 0, len(folded)
    while i < n:
        pattern = _PRODUCT_RES.get(folded[i].lower())
        m = pattern.match(folded, i) if pattern is not None else None
        if m is None:
            i += 1
            continue
        yield m
        i = m.end()


_RISK_LEVELS: dict[str, str] = {
    "保守型": "保守型", "谨慎型": "保守型", "保守": "保守型", "低风险": "保守型",
    "稳健型": "稳健型", "稳健": "稳健型", "中低风险": "稳健型",
    "平衡型": "平衡型", "中风险": "平衡型", "中等风险": "平衡型",
    "成长型": "成长型", "中高风险": "成长型",
    "进取型": "进取型", "激进型": "进取型", "进取": "进取型", "激进": "进取型", "高风险": "进取型",
}  # fmt: skip
_EN_RISK_LEVELS: list[tuple[str, str]] = [
    (
        r"low[\s-]to[\s-](?:medium|moderate)[\s-]risk|medium[\s-]low[\s-]risk|moderately\s+conservative",
        "稳健型",
    ),
    (r"(?:medium|moderate)[\s-](?:to[\s-])?high[\s-]risk|growth[\s-](?:oriented|type)", "成长型"),
    (r"conservative|cautious|low[\s-]risk", "保守型"),
    (r"balanced|(?:medium|moderate)[\s-]risk", "平衡型"),
    (r"aggressive|high[\s-]risk", "进取型"),
]
_RISK_RE = re.compile(
    "|".join(
        [re.escape(s) for s in sorted(_RISK_LEVELS, key=len, reverse=True)]
        + [rf"(?P<en{i}>\b(?:{p})\b)" for i, (p, _) in enumerate(_EN_RISK_LEVELS)]
    ),
    re.I,
)
#: Questionnaire / product risk codes C1–C5 and R1–R5, only where the context says they are risk levels.
_RISK_CODE_RE = re.compile(
    r"(?:(?<=风险等级)|(?<=风险评级)|(?<=风险级别)|(?<=风险等级是)|(?<=风险评级是)|(?<=风险等级为)|(?<=risk\slevel\s))"
    r"(?P<a>[CR][1-5])(?![0-9A-Za-z])"
    r"|(?<![0-9A-Za-z])(?P<b>[CR][1-5])(?=级|的产品|产品|类产品|型)",
    re.I,
)
_RISK_CODES = ["保守型", "稳健型", "平衡型", "成长型", "进取型"]


def products(folded: str) -> list[Candidate]:
    """Bank products, as canonical Chinese names."""
    found: list[Candidate] = []
    for m in _product_matches(folded):
        key = re.sub(r"\s+", " ", m.group().lower())
        found.append(Candidate("product", m.start(), m.end(), _PRODUCTS[key]))
    return found


#: Every surface of ``_RISK_RE`` and ``_RISK_CODE_RE`` has one of these: without any, the alternations are not run.
_RISK_TRIGGER_RE = re.compile(
    r"[保谨险稳衡长取激]|risk|conservative|cautious|balanced|aggressive|growth|[CR][1-5]", re.I
)


def risk_levels(folded: str) -> list[Candidate]:
    """Risk-tolerance levels, as one of 保守型/稳健型/平衡型/成长型/进取型."""
    found: list[Candidate] = []
    if _RISK_TRIGGER_RE.search(folded) is None:
        return found
    for m in _RISK_RE.finditer(folded):
        canon = _RISK_LEVELS.get(m.group())
        if canon is None:
            index = next(int(k[2:]) for k, v in m.groupdict().items() if v is not None)
            canon = _EN_RISK_LEVELS[index][1]
        found.append(Candidate("risk_level", m.start(), m.end(), canon))
    for m in _RISK_CODE_RE.finditer(folded):
        group = "a" if m["a"] else "b"
        found.append(Candidate("risk_level", m.start(group), m.end(group), _RISK_CODES[int(m[group][1]) - 1]))
    return found
