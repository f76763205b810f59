"""Compliance rules applied to every dialogue reply before it leaves the pipeline.

Three named rules, run in this order by :func:`apply_compliance`; each intervention is returned as an
:class:`Intervention` (rule, action, detail) for metrics and logs. All are pure functions on strings.

1. ``forbidden_promise`` — guaranteed-return wording (保本, 稳赚, 零风险, 保证收益, 稳赚不赔, 无风险,
   100%收益, guaranteed return, risk-free, can't lose, ...). Every sentence holding such a phrase is
   removed (action ``removed``), unless the phrase is negated in its clause (``基金不保本``, ``没有产品能
   保证收益``, ``no investment is risk-free``) or is the technical term 无风险利率 / risk-free rate. When
   the removed sentences are the core of the reply — at least ``core_share`` of its characters, or fewer
   than 6 letters/characters remain — the whole reply is replaced by the pipeline's safe answer (action
   ``replaced``). Sentences are not rewritten: a rewrite could change the meaning, removal cannot add one.
2. ``number_grounding`` — every number of the reply (amounts, rates, dates, clock times, parsed by
   :func:`miaohui.nlp.numbers.numbers_grounded`, so 5万 matches 50000) must occur in the sources: the
   user's words and the knowledge-base facts used for the reply. Line-leading list markers (``1.``,
   ``2)``) are not numbers. Any ungrounded number replaces the reply with the safe answer (``replaced``).
   The safe answer itself is reviewed configuration and is not checked again.
3. ``risk_disclaimer`` — replies to the investment intents carry the disclaimer exactly once, at the end:
   "投资有风险，入市需谨慎" in Chinese sessions, "Investing involves risk; enter the market with caution."
   in English ones. Existing copies and near-variants in either language (市场有风险，投资需谨慎;
   investments carry risk ...) are removed first (action ``deduplicated``); a reply without one gets it
   (``inserted``). A reply already ending with exactly one canonical copy is left alone.

Investment intents (the default of :attr:`ComplianceConfig.disclaimer_intents`): ``fund_recommendation``
and ``market_outlook`` (they recommend or discuss market-linked products) and ``product_redemption``
(redemption is priced at a future net asset value and the reply often touches on timing). Not
``deposit_rates`` (insured deposits at fixed rates), ``loan_inquiry``, or ``risk_assessment`` (the
questionnaire is the suitability step itself and names no product).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miaohui.dialogue.knowledge import Bilingual, Lang
from miaohui.errors import ConfigError
from miaohui.nlp.numbers import numbers_grounded
from miaohui.zoo.intents import LABELS

__all__ = [
    "DISCLAIMER",
    "ComplianceConfig",
    "ComplianceResult",
    "Intervention",
    "apply_compliance",
    "count_disclaimers",
    "enforce_disclaimer",
    "find_forbidden_promises",
    "ground_numbers",
    "remove_forbidden_promises",
]

Rule = Literal["forbidden_promise", "number_grounding", "risk_disclaimer"]
Action = Literal["removed", "replaced", "inserted", "deduplicated"]

DISCLAIMER: dict[str, str] = {
    "zh": "投资有风险，入市需谨慎",
    "en": "Investing involves risk; enter the market with caution.",
}

_DISCLAIMER_VARIANTS_RE = re.compile(
    r"(?:投资|理财|市场|股市|基金投资|入市)有风险[，,、;；\s]*(?:(?:入市|投资|理财|购买|选择)?(?:需|须|要|请|应)?谨慎)?"
    r"[。.!！;；]?"
    r"|(?:investing|investments?|investment products?|the market|markets)"
    r"\s+(?:involves?|carr(?:y|ies)|has|have)\s+risks?"
    r"(?:[;,.]?\s*(?:please\s+)?(?:enter the market|invest|proceed)\s+(?:with\s+caution|cautiously))?"
    r"\s*[.!;]?",
    re.I,
)

_FORBIDDEN_ZH = (
    "稳赚不赔|稳赚不亏|只赚不赔|保本保息|保本|保息|稳赚|包赚|躺赚|零风险|无风险(?!利率)|没有风险|毫无风险"
    "|保证收益|保证本金|保证回报|保证盈利|保证赚|收益有保障|收益保障|刚性兑付|刚兑|100%收益|百分百收益"
    "|一定赚|肯定赚|绝对安全|不会亏"
)
_FORBIDDEN_EN = (
    r"guaranteed\s+(?:returns?|profits?|income|gains?|yields?)|guarantee[sd]?\s+(?:(?:a|an|your|the)\s+)?"
    r"(?:returns?|profits?|income|gains?|yields?)|risk[- ]free(?!\s+rate)|zero[- ]risk|no[- ]risk(?![- ]free)"
    r"|can'?t\s+lose|cannot\s+lose|can\s+not\s+lose|won'?t\s+lose|never\s+lose|100\s*%\s+(?:returns?|safe)"
    r"|sure[- ](?:win|profit|thing)|principal[- ](?:protected|guaranteed)|capital[- ]guaranteed"
)
_FORBIDDEN_RE = re.compile(rf"{_FORBIDDEN_ZH}|{_FORBIDDEN_EN}", re.I)
#: Negators that, before the phrase in the same clause, turn it into a warning.
_NEG_ZH_RE = re.compile(r"不|没|无法|并非|非|未|禁止|谨防|警惕|别|勿|杜绝")
_NOT_NEG_ZH_RE = re.compile(r"不仅|不但|不光|不只|不用|不必|不需要|不怕|不错|没问题|别担心|不担心")
_NEG_EN_RE = re.compile(r"\b(?:no|not|never|nothing|none|nobody|without|nor|neither|beware|avoid|cannot)\b|n't\b", re.I)
_CLAUSE_SPLIT_RE = re.compile(r"[，,、；;：:]")
_SENTENCE_RE = re.compile(r"[^。！？!?；;\n]+?(?:[。！？!?；;]+|\.(?=\s|$)|\n+|$)|\n+", re.S)
_MEANINGFUL_RE = re.compile(r"[\u4e00-\u9fffA-Za-z0-9]")
_LIST_MARKER_RE = re.compile(r"(?m)^\s*(?:\d{1,2}|[一二三四五六七八九十])\s*[.、)）]\s*")
_ENDS_WITH_STOP_RE = re.compile(r"[。！？!?.…]$")


class Intervention(BaseModel):
    """One change a compliance rule made to a reply."""

    model_config = ConfigDict(frozen=True)

    rule: Rule
    """Which rule fired."""
    action: Action
    """What it did."""
    detail: str
    """What it found (the phrases, the ungrounded numbers, how many disclaimers)."""


class ComplianceConfig(BaseModel):
    """A pipeline's compliance settings (its YAML's ``compliance:`` block)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    disclaimer_intents: tuple[str, ...] = ("fund_recommendation", "market_outlook", "product_redemption")
    """Intents whose replies carry the risk disclaimer exactly once."""
    forbid_promises: bool = True
    """Remove guaranteed-return wording (rule ``forbidden_promise``)."""
    ground_numbers: bool = True
    """Replace replies with numbers found in neither the user's words nor the knowledge base."""
    core_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """Removing forbidden sentences that make up at least this share of the reply replaces it instead."""
    safe_reply: Bilingual = Bilingual(
        zh="抱歉，这个问题我暂时无法给出准确答复，建议您咨询人工客服。",
        en="Sorry, I cannot give a reliable answer to that; please ask one of our human agents.",
    )
    """What replaces a non-compliant reply (trusted text: not checked by the rules)."""

    @field_validator("disclaimer_intents")
    @classmethod
    def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [i for i in v if i not in LABELS]
        if unknown:
            raise ConfigError(
                f"disclaimer_intents has unknown intent label(s) {unknown}",
                "list labels of shared/INTENTS.md, e.g. [fund_recommendation, market_outlook]",
            )
        return v

    @field_validator("safe_reply")
    @classmethod
    def _safe(cls, v: Bilingual) -> Bilingual:
        langs: tuple[Lang, Lang] = ("zh", "en")
        for lang in langs:
            found = find_forbidden_promises(v.get(lang))
            if found:
                raise ConfigError(
                    f"safe_reply.{lang} holds forbidden wording {found}: {v.get(lang)!r}",
                    "write a safe answer without guaranteed-return phrases",
                )
        return v


class ComplianceResult(BaseModel):
    """A reply after the rules, with what they did."""

    text: str
    """The reply to send."""
    interventions: list[Intervention] = Field(default_factory=list)
    """Every change, in the order the rules ran."""
    replaced: bool = False
    """True when the reply was replaced by the safe answer."""
    disclaimer: bool = False
    """True when the reply carries the risk disclaimer (investment intents)."""


# ------------------------------------------------------------------------------------- forbidden promises


def _negated(sentence: str, start: int) -> bool:
    """True if the clause before ``start`` holds a negator (``不保本``, ``no investment is risk-free``)."""
    clause = _CLAUSE_SPLIT_RE.split(sentence[:start])[-1]
    zh = _NOT_NEG_ZH_RE.sub("", clause[-8:])
    return bool(_NEG_ZH_RE.search(zh)) or bool(_NEG_EN_RE.search(" ".join(clause.split()[-5:])))


def _promises_in(sentence: str) -> list[str]:
    return [m.group() for m in _FORBIDDEN_RE.finditer(sentence) if not _negated(sentence, m.start())]


def find_forbidden_promises(text: str) -> list[str]:
    """The guaranteed-return phrases of ``text`` that are not negated, in order."""
    return [p for s in _split_sentences(text) for p in _promises_in(s)]


def _split_sentences(text: str) -> list[str]:
    """Sentences with their closing punctuation; joined back they give ``text``."""
    return [m.group() for m in _SENTENCE_RE.finditer(text) if m.group()]


def _meaningful(text: str) -> int:
    return len(_MEANINGFUL_RE.findall(text))


def remove_forbidden_promises(text: str, safe_reply: str, core_share: float = 0.5) -> tuple[str, Intervention | None]:
    """Drop the sentences with forbidden promises, or return ``safe_reply`` when they were the core."""
    kept: list[str] = []
    phrases: list[str] = []
    for sentence in _split_sentences(text):
        found = _promises_in(sentence)
        if found:
            phrases.extend(found)
        else:
            kept.append(sentence)
    if not phrases:
        return text, None
    rest = "".join(kept).strip()
    body = _DISCLAIMER_VARIANTS_RE.sub("", rest)
    total = max(_meaningful(_DISCLAIMER_VARIANTS_RE.sub("", text)), 1)
    if _meaningful(body) < 6 or 1 - _meaningful(body) / total >= core_share:
        return safe_reply, Intervention(
            rule="forbidden_promise", action="replaced", detail=f"core sentence(s) promised {phrases}"
        )
    return rest, Intervention(rule="forbidden_promise", action="removed", detail=f"removed {phrases}")


# ------------------------------------------------------------------------------------------- numbers


def ground_numbers(text: str, sources: Sequence[str], safe_reply: str) -> tuple[str, Intervention | None]:
    """``text`` unchanged when all its numbers occur in ``sources``; else ``safe_reply`` and a record."""
    ungrounded = numbers_grounded(_LIST_MARKER_RE.sub("", text), list(sources))
    if not ungrounded:
        return text, None
    shown = ", ".join(f"{v:g}" for v in ungrounded)
    return safe_reply, Intervention(
        rule="number_grounding",
        action="replaced",
        detail=f"numbers not in the user's words or the knowledge base: {shown}",
    )


# ---------------------------------------------------------------------------------------- disclaimer


def count_disclaimers(text: str) -> int:
    """How many disclaimers (canonical or near-variant, either language) ``text`` holds."""
    return len(_DISCLAIMER_VARIANTS_RE.findall(text))


def enforce_disclaimer(text: str, lang: Lang) -> tuple[str, Intervention | None]:
    """``text`` with the ``lang`` disclaimer exactly once, at the end."""
    canonical = DISCLAIMER[lang]
    found = _DISCLAIMER_VARIANTS_RE.findall(text)
    stripped = text.rstrip()
    if len(found) == 1 and stripped.rstrip("。").endswith(canonical):
        return text, None
    body = _DISCLAIMER_VARIANTS_RE.sub("", text).strip()
    if lang == "zh":
        sep = "" if not body or _ENDS_WITH_STOP_RE.search(body) else "。"
        result = f"{body}{sep}{canonical}。"
    else:
        sep = "" if not body or _ENDS_WITH_STOP_RE.search(body) else "."
        result = f"{body}{sep} {canonical}".strip()
    if not found:
        return result, Intervention(rule="risk_disclaimer", action="inserted", detail=f"added ({lang})")
    return result, Intervention(
        rule="risk_disclaimer",
        action="deduplicated",
        detail=f"{len(found)} disclaimer(s) found, kept one canonical ({lang}) at the end",
    )


# ------------------------------------------------------------------------------------------- all rules


def apply_compliance(
    reply: str,
    *,
    intent: str,
    lang: Lang,
    sources: Sequence[str],
    config: ComplianceConfig,
) -> ComplianceResult:
    """Run the three rules on ``reply`` (see the module docstring).

    ``sources`` are the texts numbers may come from: the user's words and the knowledge-base facts used
    for this reply.
    """
    text = reply.strip()
    records: list[Intervention] = []
    safe = config.safe_reply.get(lang)
    replaced = False
    if config.forbid_promises:
        text, record = remove_forbidden_promises(text, safe, config.core_share)
        if record is not None:
            records.append(record)
            replaced = record.action == "replaced"
    if config.ground_numbers and not replaced:
        text, record = ground_numbers(text, sources, safe)
        if record is not None:
            records.append(record)
            replaced = True
    disclaimer = intent in config.disclaimer_intents
    if disclaimer:
        text, record = enforce_disclaimer(text, lang)
        if record is not None:
            records.append(record)
    return ComplianceResult(text=text, interventions=records, replaced=replaced, disclaimer=disclaimer)
