"""Compliance rules on reply strings: risk disclaimer, forbidden promises, number grounding.

The replies here are hand-written stand-ins for what a generator could say; the rules are pure functions,
so no engine is needed (the e2e tests run them on real engine output).
"""

from __future__ import annotations

import statistics
import time

import pytest

from miaohui.dialogue.compliance import (
    DISCLAIMER,
    ComplianceConfig,
    ComplianceResult,
    apply_compliance,
    count_disclaimers,
    enforce_disclaimer,
    find_forbidden_promises,
    ground_numbers,
    remove_forbidden_promises,
)
from miaohui.dialogue.knowledge import Bilingual, Lang
from miaohui.errors import ConfigError

CFG = ComplianceConfig()
SAFE_ZH = CFG.safe_reply.zh
SAFE_EN = CFG.safe_reply.en
ZH = "投资有风险，入市需谨慎"
EN = "Investing involves risk; enter the market with caution."


def run(
    reply: str, intent: str = "fund_recommendation", lang: Lang = "zh", sources: tuple[str, ...] = ()
) -> ComplianceResult:
    return apply_compliance(reply, intent=intent, lang=lang, sources=list(sources), config=CFG)


# ------------------------------------------------------------------------------------------ disclaimer


def test_disclaimer_inserted_once_zh() -> None:
    result = run("可以关注稳享固收增强混合。")
    assert result.text == f"可以关注稳享固收增强混合。{ZH}。"
    assert result.text.count(ZH) == 1
    assert result.disclaimer
    assert [(i.rule, i.action, i.detail) for i in result.interventions] == [
        ("risk_disclaimer", "inserted", "added (zh)")
    ]


def test_disclaimer_inserted_once_en() -> None:
    result = run("Consider a bond fund", intent="market_outlook", lang="en")
    assert result.text == f"Consider a bond fund. {EN}"
    assert result.text.count(EN) == 1


def test_disclaimer_deduplicated_when_the_llm_wrote_it_twice() -> None:
    reply = f"{ZH}！黄金短期波动较大，建议分批配置。{ZH}。"
    result = run(reply, intent="market_outlook")
    assert result.text == f"黄金短期波动较大，建议分批配置。{ZH}。"
    assert result.interventions[0].action == "deduplicated"
    assert result.interventions[0].detail == "2 disclaimer(s) found, kept one canonical (zh) at the end"


@pytest.mark.parametrize(
    "variant",
    ["市场有风险，投资需谨慎。", "理财有风险，投资须谨慎", "投资有风险，请谨慎。", "投资有风险。"],
)
def test_near_variants_become_the_canonical_disclaimer(variant: str) -> None:
    result = run(f"建议分批配置。{variant}", intent="market_outlook")
    assert result.text == f"建议分批配置。{ZH}。"
    assert count_disclaimers(result.text) == 1


def test_english_variant_and_cross_language_copy() -> None:
    result = run(f"Diversify. Investments carry risks. {ZH}。", intent="market_outlook", lang="en")
    assert result.text == f"Diversify. {EN}"
    assert count_disclaimers(result.text) == 1


def test_already_compliant_reply_is_untouched() -> None:
    reply = f"建议分批配置。{ZH}。"
    assert enforce_disclaimer(reply, "zh") == (reply, None)
    assert run(reply).interventions == []


def test_no_disclaimer_for_non_investment_intents() -> None:
    result = run("3年年利率1.55%。", intent="deposit_rates", sources=("3年 1.55%",))
    assert result.text == "3年年利率1.55%。"
    assert not result.disclaimer
    assert result.interventions == []


# ---------------------------------------------------------------------------------- forbidden promises


def test_forbidden_sentence_removed_rest_kept() -> None:
    reply = "推荐稳享固收增强混合，历史年化3.5%～5.5%。这款产品保本保息，稳赚不赔！"
    result = run(reply, sources=("3.5 5.5",))
    assert result.text == f"推荐稳享固收增强混合，历史年化3.5%～5.5%。{ZH}。"
    assert not result.replaced
    first = result.interventions[0]
    assert (first.rule, first.action, first.detail) == (
        "forbidden_promise",
        "removed",
        "removed ['保本保息', '稳赚不赔']",
    )


def test_forbidden_core_replaces_the_reply() -> None:
    result = run("这只基金保本，零风险，放心买。")
    assert result.text == f"{SAFE_ZH}{ZH}。"
    assert result.replaced
    assert [(i.rule, i.action) for i in result.interventions] == [
        ("forbidden_promise", "replaced"),
        ("risk_disclaimer", "inserted"),
    ]


def test_forbidden_english() -> None:
    result = run("Buy gold now, it is risk-free and you can't lose.", intent="market_outlook", lang="en")
    assert result.text == f"{SAFE_EN} {EN}"
    assert result.interventions[0].detail == "core sentence(s) promised ['risk-free', \"can't lose\"]"


@pytest.mark.parametrize(
    "text",
    [
        "基金不保本，没有任何产品能保证收益。",
        "任何投资都并非零风险。",
        "No investment is risk-free, and nothing can guarantee returns.",
        "The risk-free rate fell, and 无风险利率 has come down.",
        "Beware of anyone promising guaranteed returns.",
    ],
)
def test_negated_or_technical_phrases_are_allowed(text: str) -> None:
    assert find_forbidden_promises(text) == []


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("这款理财100%收益，绝对安全。", ["100%收益", "绝对安全"]),
        ("这个产品不仅保本，收益还高。", ["保本"]),
        ("It offers guaranteed returns with zero risk.", ["guaranteed returns", "zero risk"]),
        ("别担心，稳赚。", ["稳赚"]),
    ],
)
def test_promises_found(text: str, found: list[str]) -> None:
    assert find_forbidden_promises(text) == found


def test_remove_forbidden_without_promises_is_identity() -> None:
    assert remove_forbidden_promises("建议分批买入。", SAFE_ZH) == ("建议分批买入。", None)


# --------------------------------------------------------------------------------------------- numbers


def test_ungrounded_number_replaces_reply() -> None:
    result = run("您存5万元3年期，利率2.75%。", intent="deposit_rates", sources=("我有5万", "3年年利率1.55%"))
    assert result.text == SAFE_ZH
    assert result.replaced
    record = result.interventions[0]
    assert (record.rule, record.action, record.detail) == (
        "number_grounding",
        "replaced",
        "numbers not in the user's words or the knowledge base: 2.75",
    )


def test_grounded_numbers_kept_across_notations() -> None:
    reply = "您的5万元存3年，年利率1.55%。"
    result = run(reply, intent="deposit_rates", sources=("我有50000元", "3年年利率1.55%"))
    assert result.text == reply
    assert result.interventions == []
    assert ground_numbers("两万五千元", ["25000"], SAFE_ZH) == ("两万五千元", None)


def test_dates_and_times_must_be_grounded() -> None:
    facts = ("2026-03-04 09:00–10:00",)
    assert run("已预订2026-03-04 09:00–10:00。", intent="book_meeting_room", sources=facts).replaced is False
    assert run("已预订2026-03-05 09:00–10:00。", intent="book_meeting_room", sources=facts).replaced is True


def test_list_markers_are_not_numbers() -> None:
    reply = "1. 先问清对方的理由\n2. 再用条件交换"
    assert run(reply, intent="out_of_scope").text == reply


def test_safe_reply_is_not_checked_again() -> None:
    cfg = ComplianceConfig(safe_reply=Bilingual(zh="请拨打12345咨询。", en="Please call 12345."))
    result = apply_compliance("利率是9%。", intent="out_of_scope", lang="zh", sources=[], config=cfg)
    assert result.text == "请拨打12345咨询。"
    assert len(result.interventions) == 1


def test_rules_can_be_switched_off() -> None:
    cfg = ComplianceConfig(forbid_promises=False, ground_numbers=False, disclaimer_intents=())
    result = apply_compliance("保本，年化9%。", intent="fund_recommendation", lang="zh", sources=[], config=cfg)
    assert result.text == "保本，年化9%。"
    assert result.interventions == []


# -------------------------------------------------------------------------------------------- config


def test_config_rejects_unknown_intent() -> None:
    with pytest.raises(ConfigError) as exc:
        ComplianceConfig(disclaimer_intents=("fund_recommendations",))
    assert str(exc.value) == (
        "disclaimer_intents has unknown intent label(s) ['fund_recommendations'] — "
        "list labels of shared/INTENTS.md, e.g. [fund_recommendation, market_outlook]"
    )


def test_config_rejects_unsafe_safe_reply() -> None:
    with pytest.raises(ConfigError) as exc:
        ComplianceConfig(safe_reply=Bilingual(zh="我们的产品保本。", en="Sorry."))
    assert str(exc.value) == (
        "safe_reply.zh holds forbidden wording ['保本']: '我们的产品保本。' — "
        "write a safe answer without guaranteed-return phrases"
    )


def test_disclaimer_constants() -> None:
    assert DISCLAIMER == {"zh": ZH, "en": EN}


def test_typical_reply_takes_under_a_millisecond() -> None:
    reply = "根据您的稳健型风险偏好，推荐稳享固收增强混合（MH2002，历史年化3.5%～5.5%，1000元起购）。这款产品稳赚。"
    sources = [
        "我想买一只稳健型基金，年化收益5%左右",
        "稳享固收增强混合（MH2002，历史年化3.5%～5.5%，1000元起购）",
    ]
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        run(reply, sources=tuple(sources))
        times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 1e-3
