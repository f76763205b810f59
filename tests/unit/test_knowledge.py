"""The dialogue knowledge base (packaged example data) and the lookups that fill templates from it.

Pure data tests: no engine is involved.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from miaohui.dialogue.answers import LOOKUPS, VARIANT_FIELDS, AnswerContext, KbAnswer
from miaohui.dialogue.knowledge import FUND_TYPES, RISK_LEVELS, load_knowledge
from miaohui.errors import ConfigError
from miaohui.nlp.numbers import numbers_grounded
from miaohui.nlp.slots import extract_slots

KB = load_knowledge()
NOW = datetime(2026, 3, 3, 10, 0)
HOTLINE_INTENTS = (
    "social_insurance",
    "medical_insurance",
    "household_registration",
    "housing_fund",
    "noise_complaint",
    "utilities_outage",
    "traffic_violation",
    "business_license",
)


def lookup(name: str, intent: str, text: str, lang: str = "zh", **memory: str | float) -> KbAnswer:
    slots = tuple(extract_slots(text, NOW))
    mem: dict[str, str | float] = {**memory, **{s.name: s.value for s in slots}}
    answer = LOOKUPS[name](KB, AnswerContext(intent, text, lang, slots, mem, NOW))  # type: ignore[arg-type]
    assert set(answer.fields) == VARIANT_FIELDS[name][answer.variant]
    return answer


def test_catalogue_covers_every_type_and_level() -> None:
    assert len(KB.funds) == 8
    assert {f.type for f in KB.funds} == set(FUND_TYPES)
    assert {f.risk_level for f in KB.funds} == set(RISK_LEVELS)
    assert all(f.code.startswith("MH") for f in KB.funds)
    terms = [d.term for d in KB.deposit_rates]
    assert terms[:7] == ["活期", "3个月", "6个月", "1年", "2年", "3年", "5年"]
    assert KB.deposit_rate("3年") is not None and KB.deposit_rate("3年").rate == 1.55  # type: ignore[union-attr]
    assert KB.deposit_rate("大额存单3年").min_amount == 200000  # type: ignore[union-attr]
    assert any("LPR" in r.name.zh and "示例" in r.name.zh for r in KB.loan_rates)
    assert sorted(KB.procedures) == sorted(HOTLINE_INTENTS)
    assert all(any(h.number == "12345" for h in p.hotlines) for p in KB.procedures.values())
    assert len(KB.rooms) == 5


def test_find_funds_respects_suitability_and_target() -> None:
    funds = KB.find_funds("稳健型", 5.0)
    assert [f.code for f in funds] == ["MH2002", "MH2001", "MH2003"]
    assert all(f.risk_level in ("保守型", "稳健型") for f in funds)
    lo, hi = funds[0].return_range
    assert lo <= 5.0 <= hi
    assert [f.code for f in KB.find_funds("保守型")] == ["MH1001"]
    assert [f.code for f in KB.find_funds("进取型", fund_types=("黄金ETF",))] == ["MH5001"]
    assert KB.find_funds("保守型", fund_types=("股票",)) == []


def test_find_funds_rejects_unknown_level() -> None:
    with pytest.raises(ConfigError) as exc:
        KB.find_funds("激进型")
    assert str(exc.value) == "unknown risk level '激进型' — use one of 保守型, 稳健型, 平衡型, 成长型, 进取型"


def test_find_by_name() -> None:
    assert KB.find_fund_in_text("我想赎回安盈纯债").code == "MH2001"  # type: ignore[union-attr]
    assert KB.find_fund_in_text("sell my gold etf") is not None
    assert KB.find_room("就订青松厅吧").id == "R301"  # type: ignore[union-attr]
    assert KB.find_room("book the Galaxy Room").id == "R501"  # type: ignore[union-attr]
    assert KB.find_room("随便哪间") is None
    with pytest.raises(ConfigError, match="no meeting room with id 'R999'"):
        KB.room("R999")


def test_funds_lookup_variants() -> None:
    seed = lookup("funds", "fund_recommendation", "我想买一只稳健型基金，年化收益5%左右")
    assert seed.variant == "default"
    assert seed.fields["risk_level"] == "稳健型"
    assert seed.fields["target_clause"] == "，目标年化收益约5%"
    assert seed.fields["fund_list"].startswith("稳享固收增强混合（MH2002，混合型，稳健型，历史年化3.5%～5.5%")
    assert lookup("funds", "fund_recommendation", "推荐个基金").variant == "need_risk"
    high = lookup("funds", "fund_recommendation", "保守型，想要年化8%")
    assert (high.variant, high.fields["max_return"]) == ("above_range", "2.2%")
    assert lookup("funds", "fund_recommendation", "保守型，想买股票型基金").variant == "no_match"
    remembered = lookup("funds", "fund_recommendation", "推荐个基金", risk_level="平衡型")
    assert remembered.fields["risk_level"] == "平衡型"
    en = lookup("funds", "fund_recommendation", "a low risk fund around 2%", lang="en")
    assert en.fields["risk_level"] == "Conservative"
    assert "Miaohui Cash Money Market A (MH1001, money market" in en.fields["fund_list"]


def test_deposit_lookup_picks_terms() -> None:
    assert lookup("deposits", "deposit_rates", "三年定期利率多少").fields["rate_list"] == "3年年利率1.55%，50元起存"
    cds = lookup("deposits", "deposit_rates", "大额存单利率").fields["rate_list"]
    assert cds.count("大额存单") == 2
    assert lookup("deposits", "deposit_rates", "存款利率").fields["rate_list"].count("；") == 8
    en = lookup("deposits", "deposit_rates", "what is the 5-year rate", lang="en")
    assert en.fields["rate_list"] == "5-year time deposit: 1.6% a year, from 50 yuan"


def test_procedure_lookup_with_district() -> None:
    answer = lookup("procedure", "noise_complaint", "朝阳区晚上工地施工太吵了")
    assert answer.fields["district_clause"] == "（朝阳区）"
    assert answer.fields["steps"].startswith("第一步，")
    assert "110" in answer.fields["hotlines"] and "12345" in answer.fields["hotlines"]
    assert lookup("procedure", "greeting", "你好").variant == "unknown"


def test_negotiation_lookup_quotes_the_figures() -> None:
    answer = lookup("negotiation", "out_of_scope", "客户说预算只有50万，比我们报价低了20万，怎么谈？")
    assert answer.fields["ask_clause"] == "「客户说预算只有50万，比我们报价低了20万」"
    assert lookup("negotiation", "out_of_scope", "对方很强势").fields["ask_clause"] == ""


@pytest.mark.parametrize(
    ("name", "intent", "text"),
    [
        ("funds", "fund_recommendation", "我想买一只稳健型基金，年化收益5%左右"),
        ("market", "market_outlook", "最近黄金涨得不错，现在入场合适吗？"),
        ("redemption", "product_redemption", "赎回安盈纯债"),
        ("deposits", "deposit_rates", "利率"),
        ("loans", "loan_inquiry", "房贷利率"),
        ("faq", "card_loss", "卡丢了"),
        ("procedure", "social_insurance", "查社保"),
    ],
)
def test_every_quoted_figure_is_a_fact(name: str, intent: str, text: str) -> None:
    answer = lookup(name, intent, text)
    reply = "".join(answer.fields.values())
    assert numbers_grounded(reply, answer.all_facts()) == []


def test_load_knowledge_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="knowledge directory not found"):
        load_knowledge(tmp_path / "nope")
    data = Path(__file__).parents[2] / "src/miaohui/dialogue/data"
    for name in ("bank.yaml", "hotline.yaml", "office.yaml"):
        (tmp_path / name).write_text((data / name).read_text(encoding="utf-8"), encoding="utf-8")
    assert len(load_knowledge(tmp_path).funds) == 8
    bank = (tmp_path / "bank.yaml").read_text(encoding="utf-8")
    (tmp_path / "bank.yaml").write_text(bank.replace("code: MH2001", "code: MH1001"), encoding="utf-8")
    with pytest.raises(ConfigError) as exc:
        load_knowledge(tmp_path)
    assert str(exc.value) == "duplicate fund code(s) ['MH1001'] in the knowledge base — give every fund code once"
    (tmp_path / "bank.yaml").write_text("funds: [", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bank.yaml is not valid YAML"):
        load_knowledge(tmp_path)
