"""Keyword categories of a reply, e.g. 拒绝 / 接受 / 折中 / 探询 for the negotiation coach.

A category is a list of keywords (Chinese and English, matched case-insensitively as substrings).
:func:`count_categories` counts the hits per category; :func:`dominant_category` names the category a
reply expresses most (ties go to the earlier category; ``"none"`` when no keyword occurs). The consistency
checks compare the distribution of dominant categories between two engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["NEGOTIATION_CATEGORIES", "NONE_CATEGORY", "count_categories", "dominant_category"]

NONE_CATEGORY = "none"

#: The negotiation coach's default categories.
NEGOTIATION_CATEGORIES: dict[str, tuple[str, ...]] = {
    "拒绝": ("拒绝", "不接受", "不能接受", "无法接受", "不同意", "坚持原价", "守住底线", "说不", "reject",
           "decline", "refuse", "say no", "hold firm", "walk away"),
    "接受": ("接受", "同意", "答应", "成交", "让步到位", "accept", "agree", "take the deal", "go along"),
    "折中": ("折中", "各让一步", "条件交换", "交换条件", "分阶段", "阶梯", "换取", "打包", "compromise",
           "meet halfway", "trade-off", "in exchange", "middle ground", "split the difference"),
    "探询": ("了解原因", "问清", "询问", "为什么", "底线是", "需求", "ask why", "find out",
           "understand their", "what they need", "clarify"),
}  # fmt: skip


def count_categories(text: str, categories: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Keyword hits per category (every category present, 0 when none of its keywords occur).

    The longest keywords are matched first, across all categories, and their characters masked: ``不接受``
    counts once for 拒绝 and not also for 接受.
    """
    low = text.lower()
    pairs = sorted(
        ((kw.lower(), cat) for cat, kws in categories.items() for kw in kws if kw),
        key=lambda p: len(p[0]),
        reverse=True,
    )
    counts = dict.fromkeys(categories, 0)
    for kw, cat in pairs:
        hits = low.count(kw)
        if hits:
            counts[cat] += hits
            low = low.replace(kw, "\0" * len(kw))
    return counts


def dominant_category(text: str, categories: Mapping[str, Sequence[str]]) -> str:
    """The category with the most hits (the earlier one on a tie), or ``"none"``."""
    counts = count_categories(text, categories)
    best = max(counts.values(), default=0)
    if best == 0:
        return NONE_CATEGORY
    return next(cat for cat, n in counts.items() if n == best)
