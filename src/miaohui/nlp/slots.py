"""Rule-based slot extraction for the bank / 12345 hotline / office dialogue services.

:func:`extract_slots` finds the slots of ``/work/shared/INTENTS.md`` where a rule can be exact:

* ``amount`` — money. ``value`` is the amount as a float, ``unit`` the ISO currency (``CNY`` unless the
  text says otherwise: ``$``/美元/美金/刀/dollars → ``USD``, 港币/HK$ → ``HKD``, 欧元/€ → ``EUR``, 日元 →
  ``JPY``, 英镑/£ → ``GBP``). A number is an amount when it carries a currency (¥2,000, 2000元, 3千块钱,
  $300, RMB 5,000, 10 thousand yuan) or a 万/亿/k/w/thousand/million multiplier (5万, 2k, 1.5w), unless
  a counted noun follows (5万人, 3万步). ``三块五`` → 3.5. Ranges share the unit: ``3到5万`` → 30000, 50000.
* ``percent`` — ``value`` is the percent number (年化5% → 5.0, 百分之四 → 4.0, 4.5个点 → 4.5, 3.5 percent
  → 3.5, 千分之五 → 0.5), ``unit`` is ``"%"``. A bare number right after 年化/收益率/利率/回报率 counts too
  (年化三点五 → 3.5).
* ``datetime`` — ``value`` is ISO-8601 resolved against ``now``: ``YYYY-MM-DD`` when only a date is given,
  ``YYYY-MM-DDTHH:MM:SS`` (plus the UTC offset when ``now`` is aware) with a clock time; a clock time
  alone is on ``now``'s date. 上午/早上/凌晨 keep the hour; 下午/晚上/傍晚 add 12; 中午 1–3 → 13–15;
  晚上/夜里 1–4 and 12 are after midnight (next day). Days without a month (15号), month-days without a
  year (3月5日) and bare weekdays (周五, Friday) resolve to the next occurrence on or after ``now``'s date;
  这周/本周 is the current Monday-based week, 下周/next is the following one, 上周 the previous one.
* ``product`` — canonical Chinese names: 基金, 货币基金, 债券基金, 指数基金, 股票型基金, 混合型基金, 黄金,
  定期, 活期, 大额存单, 结构性存款, 存款, 理财, 股票, 国债, 债券, 外汇, 保险, 房贷, 车贷, 消费贷, 经营贷,
  贷款, 信用卡, 借记卡. ``稳健型基金`` gives product 基金 plus risk_level 稳健型.
* ``risk_level`` — the five levels of the bank questionnaire (C1–C5): 保守型, 稳健型, 平衡型, 成长型,
  进取型. 谨慎型/低风险/conservative/low risk → 保守型; 中低风险 → 稳健型; 中风险/balanced/medium risk →
  平衡型; 中高风险 → 成长型; 激进型/高风险/aggressive/high risk → 进取型.
* ``district`` — a curated list of districts of the big cities (with or without the 区 suffix for the
  unambiguous ones, and their pinyin + "District"), plus a generic ``XX区`` / ``XX县`` / ``XX新区`` rule that
  rejects common nouns (社区, 小区, 地区, 景区, 园区, 市区, 开发区 ...). ``value`` is the full name (海淀区).
* ``card_tail`` — exactly four digits after 尾号/尾数/后四位/末四位 or "ending in"/"last four digits"
  (Chinese digit readings such as 尾号六六八八 too); phone-number tails (手机尾号) are not cards.

Spans (``text``/``start``/``end``) index the caller's original string. A percent span is the number with
its sign (``5%``), a card_tail span is the four digits. Slots never overlap; where two rules claim the same
characters the more specific wins (card_tail > percent > amount > datetime > risk_level > product >
district). Results are ordered by ``start``.

The rules live by what they find: :mod:`.slots_amounts` (card_tail, percent, amount), :mod:`.slots_datetime`,
:mod:`.slots_products` (product, risk_level), :mod:`.slots_districts`; :mod:`.slots_base` has their candidate type.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from miaohui.nlp.normalize import fold_with_offsets
from miaohui.nlp.numbers import mask_non_quantities
from miaohui.nlp.slots_amounts import amounts, card_tails, percents
from miaohui.nlp.slots_base import Candidate, SlotName
from miaohui.nlp.slots_datetime import datetimes
from miaohui.nlp.slots_districts import districts
from miaohui.nlp.slots_products import products, risk_levels

__all__ = ["Slot", "SlotName", "extract_slots"]

_PRIORITY: dict[str, int] = {
    "card_tail": 0,
    "percent": 1,
    "amount": 2,
    "datetime": 3,
    "risk_level": 4,
    "product": 5,
    "district": 6,
}


class Slot(BaseModel):
    """One extracted slot. ``text``/``start``/``end`` is the span in the original string."""

    model_config = ConfigDict(frozen=True)

    name: SlotName
    value: str | float
    text: str
    start: int
    end: int
    #: Currency code for ``amount`` (CNY, USD, ...), ``"%"`` for ``percent``, None otherwise.
    unit: str | None = None


def _resolve_overlaps(cands: list[Candidate]) -> list[Candidate]:
    """Keep non-overlapping candidates: higher priority first, then longer, then earlier."""
    chosen: list[Candidate] = []
    ranked = sorted(cands, key=lambda c: (_PRIORITY[c.name], -(c.end - c.start), c.start))
    for cand in ranked:
        if all(cand.end <= c.start or c.end <= cand.start for c in chosen):
            chosen.append(cand)
    return sorted(chosen, key=lambda c: (c.start, c.end))


def extract_slots(text: str, now: datetime | None = None) -> list[Slot]:
    """Extract amount, percent, datetime, product, risk_level, district and card_tail slots from ``text``.

    ``now`` anchors relative dates (default: ``datetime.now()``). See the module docstring for the rules.
    """
    now = now or datetime.now()
    folded, offsets = fold_with_offsets(text)
    masked = mask_non_quantities(folded)
    cands = [
        *card_tails(folded),
        *percents(masked),
        *amounts(masked),
        *datetimes(folded, now),
        *risk_levels(folded),
        *products(folded),
        *districts(folded),
    ]
    slots: list[Slot] = []
    for c in _resolve_overlaps(cands):
        start, end = offsets[c.start], offsets[c.end - 1] + 1
        slots.append(Slot(name=c.name, value=c.value, text=text[start:end], start=start, end=end, unit=c.unit))
    return slots
