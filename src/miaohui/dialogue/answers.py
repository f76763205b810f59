"""Knowledge-base answers: turn an intent, its slots and the session's memory into template fields.

A *lookup* is a function ``(KnowledgeBase, AnswerContext) -> KbAnswer``. The answer names a *variant*
(``default``, ``above_range``, ``need_risk`` ...) and the *fields* its template may use; the pipeline YAML
holds one template per variant and language, so wording is configuration while figures come from the
knowledge base only. Every field value is also a *fact*: the compliance rule accepts its numbers.
:data:`VARIANT_FIELDS` declares each lookup's variants and fields; pipeline configs are checked against it
at load time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel, Field

from miaohui.dialogue.knowledge import (
    FUND_TYPES_EN,
    PRODUCT_FUND_TYPES,
    RISK_LEVELS_EN,
    DepositRate,
    Fund,
    KnowledgeBase,
    Lang,
)
from miaohui.nlp.numbers import find_numbers
from miaohui.nlp.slots import Slot

__all__ = ["LOOKUPS", "VARIANT_FIELDS", "AnswerContext", "KbAnswer", "MemoryValue", "fmt_num"]

MemoryValue = str | float


@dataclass(frozen=True)
class AnswerContext:
    """What a lookup may read: this turn's text and slots, the session's slot memory, the clock."""

    intent: str
    text: str
    lang: Lang
    slots: tuple[Slot, ...]
    memory: Mapping[str, MemoryValue]
    """Slot memory of the session, this turn's slots included (latest value per name)."""
    now: datetime


class KbAnswer(BaseModel):
    """A lookup's result: which template variant to use, its fields, and the facts behind them."""

    variant: str = "default"
    """Template variant."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Values for the template's ``{placeholders}``."""
    facts: list[str] = Field(default_factory=list)
    """Texts whose numbers the reply may quote besides the fields (e.g. context given to an LLM)."""

    def all_facts(self) -> list[str]:
        return [*self.fields.values(), *self.facts]


Lookup = Callable[[KnowledgeBase, AnswerContext], KbAnswer]


def fmt_num(value: float) -> str:
    """``3.0`` → ``3``, ``1.55`` → ``1.55``."""
    return f"{value:g}"


def _pct(value: float) -> str:
    return f"{fmt_num(value)}%"


def _join(items: list[str], lang: Lang) -> str:
    return ("；" if lang == "zh" else "; ").join(items)


# ------------------------------------------------------------------------------------------------ bank


def _fund_line(f: Fund, lang: Lang) -> str:
    lo, hi = f.return_range
    if lang == "zh":
        kind = f.type if f.type == "黄金ETF" else f"{f.type}型"
        return (
            f"{f.name.zh}（{f.code}，{kind}，{f.risk_level}，历史年化{_pct(lo)}～{_pct(hi)}，"
            f"{fmt_num(f.min_purchase)}元起购，赎回T+{f.redemption_days}到账）"
        )
    return (
        f"{f.name.en} ({f.code}, {FUND_TYPES_EN[f.type]}, {RISK_LEVELS_EN[f.risk_level]}, historical "
        f"annualized {_pct(lo)} to {_pct(hi)}, from {fmt_num(f.min_purchase)} yuan, "
        f"paid T+{f.redemption_days})"
    )


def _risk_name(level: str, lang: Lang) -> str:
    return level if lang == "zh" else RISK_LEVELS_EN[level]


def _funds(kb: KnowledgeBase, ctx: AnswerContext) -> KbAnswer:
    target = ctx.memory.get("percent")
    target_f = float(target) if isinstance(target, float | int) else None
    if target_f is None:
        target_clause = ""
    elif ctx.lang == "zh":
        target_clause = f"，目标年化收益约{_pct(target_f)}"
    else:
        target_clause = f", aiming at about {_pct(target_f)} a year"
    risk = ctx.memory.get("risk_level")
    if not isinstance(risk, str):
        return KbAnswer(variant="need_risk", fields={"target_clause": target_clause})
    product = ctx.memory.get("product")
    types = PRODUCT_FUND_TYPES.get(product, ()) if isinstance(product, str) else ()
    funds = kb.find_funds(risk, target_f, types)
    fields = {"risk_level": _risk_name(risk, ctx.lang), "target_clause": target_clause}
    if not funds:
        return KbAnswer(variant="no_match", fields=fields)
    fields["fund_list"] = _join([_fund_line(f, ctx.lang) for f in funds], ctx.lang)
    best = max(f.return_range[1] for f in funds)
    if target_f is not None and target_f > best:
        return KbAnswer(variant="above_range", fields={**fields, "max_return": _pct(best)})
    return KbAnswer(fields=fields)


_PRODUCT_EN = {"黄金": "gold", "股票": "stocks", "基金": "funds", "外汇": "foreign exchange", "债券": "bonds"}


def _market(kb: KnowledgeBase, ctx: AnswerContext) -> KbAnswer:
    product = ctx.memory.get("product")
    name = product if isinstance(product, str) else None
    types = PRODUCT_FUND_TYPES.get(name, ()) if name else ()
    funds = kb.find_funds(None, None, types, limit=2) if types else []
    label = (name or "市场") if ctx.lang == "zh" else _PRODUCT_EN.get(name or "", "the market")
    fund_list = _join([_fund_line(f, ctx.lang) for f in funds], ctx.lang)
    if not funds:
        return KbAnswer(variant="general", fields={"product": label})
    return KbAnswer(fields={"product": label, "fund_list": fund_list})


def _redemption(kb: KnowledgeBase, ctx: AnswerContext) -> KbAnswer:
    """The FAQ answer, plus the T+N of the fund the user names, or the range of the fund type they name."""
    answer = kb.faq_answer("product_redemption")
    fields = {"answer": answer.get(ctx.lang) if answer else ""}
    fund = kb.find_fund_in_text(ctx.text)
    if fund is not None:
        return KbAnswer(
            variant="fund",
            fields={**fields, "fund": fund.name.get(ctx.lang), "days": f"T+{fund.redemption_days}"},
        )
    product = ctx.memory.get("product")
    types = PRODUCT_FUND_TYPES.get(product, ()) if isinstance(product, str) else ()
    days = sorted({f.redemption_days for f in kb.funds if f.type in types})
    if not days:
        return KbAnswer(fields=fields)
    span = f"T+{days[0]}" if len(days) == 1 else f"T+{days[0]}～T+{days[-1]}"
    kind = types[0]
    name = (kind if kind == "黄金ETF" else f"{kind}型") + "基金" if ctx.lang == "zh" else f"{FUND_TYPES_EN[kind]} funds"
    return KbAnswer(variant="fund", fields={**fields, "fund": name, "days": span})


_TERM_PATTERNS: tuple[tuple[str, str], ...] = (
    ("活期", r"活期|demand|savings"),
    ("3个月", r"(?:3|三)个月|three[- ]month|3[- ]month"),
    ("6个月", r"半年|(?:6|六)个月|six[- ]month|6[- ]month|half a year"),
    ("1年", r"(?<![\d十])(?:1|一)年|one[- ]year|1[- ]year"),
    ("2年", r"(?<![\d十])(?:2|两|二)年|two[- ]year|2[- ]year"),
    ("3年", r"(?<![\d十])(?:3|三)年|three[- ]year|3[- ]year"),
    ("5年", r"(?<![\d十])(?:5|五)年|five[- ]year|5[- ]year"),
)
_CD_RE = re.compile(r"大额存单|large[- ]denomination|\bCDs?\b", re.I)


def _deposit_matches(kb: KnowledgeBase, text: str) -> list[DepositRate]:
    cd = bool(_CD_RE.search(text))
    terms = [term for term, pat in _TERM_PATTERNS if re.search(pat, text, re.I)]
    if cd:
        pool = [d for d in kb.deposit_rates if d.term.startswith("大额存单")]
        chosen = [d for d in pool if d.term.removeprefix("大额存单") in terms]
        return chosen or pool
    return [d for d in kb.deposit_rates if d.term in terms]


def _deposit_line(d: DepositRate, lang: Lang) -> str:
    if lang == "zh":
        floor = f"，{fmt_num(d.min_amount)}元起存" if d.min_amount else ""
        return f"{d.term}年利率{_pct(d.rate)}{floor}"
    floor = f", from {fmt_num(d.min_amount)} yuan" if d.min_amount else ""
    return f"{d.en}: {_pct(d.rate)} a year{floor}"


def _deposits(kb: KnowledgeBase, ctx: AnswerContext) -> KbAnswer:
    chosen = _deposit_matches(kb, ctx.text) or list(kb.deposit_rates)
    return KbAnswer(fields={"rate_list": _join([_deposit_line(d, ctx.lang) for d in chosen], ctx.lang)})


def _loans(kb: KnowledgeBase, ctx: AnswerContext) -> KbAnswer:
    sep = "：" if ctx.lang == "zh" else ": "
    lines = [f"{r.name.get(ctx.lang)}{sep}{_pct(r.rate)}" for r in kb.loan_rates]
    return KbAnswer(fields={"rate_list": _join(lines, ctx.lang)})


def _faq(kb: KnowledgeBase, ctx: AnswerContext) -> KbAnswer:
    answer = kb.faq_answer(ctx.intent)
    return KbAnswer(fields={"answer": answer.get(ctx.lang) if answer else ""})


# --------------------------------------------------------------------------------------------- hotline

_ORDINALS_ZH = "一二三四五六七八九"


def _procedure(kb: KnowledgeBase, ctx: AnswerContext) -> KbAnswer:
    proc = kb.procedure(ctx.intent)
    if proc is None:
        return KbAnswer(variant="unknown")
    lang = ctx.lang
    if lang == "zh":
        steps = "；".join(f"第{_ORDINALS_ZH[i]}步，{s.zh}" for i, s in enumerate(proc.steps))
        hotlines = "、".join(f"{h.name.zh}{h.number}" for h in proc.hotlines)
    else:
        steps = "; ".join(f"({i + 1}) {s.en}" for i, s in enumerate(proc.steps))
        hotlines = ", ".join(f"{h.name.en} {h.number}" for h in proc.hotlines)
    docs = ("、" if lang == "zh" else ", ").join(d.get(lang) for d in proc.documents)
    district = ctx.memory.get("district")
    clause = ""
    if isinstance(district, str):
        clause = f"（{district}）" if lang == "zh" else f" ({district})"
    return KbAnswer(
        fields={
            "title": proc.title.get(lang),
            "district_clause": clause,
            "steps": steps,
            "documents": docs,
            "hotlines": hotlines,
        }
    )


# ----------------------------------------------------------------------------------------- negotiation


_CLAUSE_SPLIT_RE = re.compile(r"[，。！？,!?；;\n]|\.(?=\s|$)")


def _negotiation(kb: KnowledgeBase, ctx: AnswerContext) -> KbAnswer:
    """Quote the clauses of the user's turn that hold figures (``对方要求降价15%``)."""
    clauses = [c.strip() for c in _CLAUSE_SPLIT_RE.split(ctx.text) if find_numbers(c)]
    if not clauses:
        return KbAnswer(fields={"ask_clause": ""})
    if ctx.lang == "zh":
        return KbAnswer(fields={"ask_clause": "「" + "，".join(clauses) + "」"})
    return KbAnswer(fields={"ask_clause": ' ("' + ", ".join(clauses) + '")'})


def _none(kb: KnowledgeBase, ctx: AnswerContext) -> KbAnswer:
    return KbAnswer()


LOOKUPS: dict[str, Lookup] = {
    "none": _none,
    "faq": _faq,
    "funds": _funds,
    "market": _market,
    "redemption": _redemption,
    "deposits": _deposits,
    "loans": _loans,
    "procedure": _procedure,
    "negotiation": _negotiation,
}

_F = frozenset
#: Each lookup's variants and the fields each variant fills.
VARIANT_FIELDS: dict[str, Mapping[str, frozenset[str]]] = {
    "none": {"default": _F()},
    "faq": {"default": _F({"answer"})},
    "funds": {
        "default": _F({"risk_level", "target_clause", "fund_list"}),
        "above_range": _F({"risk_level", "target_clause", "fund_list", "max_return"}),
        "need_risk": _F({"target_clause"}),
        "no_match": _F({"risk_level", "target_clause"}),
    },
    "market": {"default": _F({"product", "fund_list"}), "general": _F({"product"})},
    "redemption": {"default": _F({"answer"}), "fund": _F({"answer", "fund", "days"})},
    "deposits": {"default": _F({"rate_list"})},
    "loans": {"default": _F({"rate_list"})},
    "procedure": {
        "default": _F({"title", "district_clause", "steps", "documents", "hotlines"}),
        "unknown": _F(),
    },
    "negotiation": {"default": _F({"ask_clause"})},
}
