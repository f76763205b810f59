"""Tests for miaohui.nlp.numbers: number extraction and the grounding check used by compliance."""

from __future__ import annotations

import pytest

from miaohui.nlp.numbers import extract_numbers, find_numbers, numbers_grounded, parse_english_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the seeds and bank phrasing
        ("我想买一只稳健型基金，年化收益5%左右", [5.0]),
        ("我想转5万到我妈的账户", [50000.0]),
        ("这款产品年化3.5%，5万起投，期限一年", [3.5, 50000.0, 1.0]),
        ("起投金额50,000元", [50000.0]),
        ("年化5%左右，5万起投", [5.0, 50000.0]),
        ("三年期大额存单利率3.1%，20万起存", [3.0, 3.1, 200000.0]),
        ("存款利率下调了0.25个百分点", [0.25]),
        ("收益百分之三点五", [3.5]),
        ("百分之四", [4.0]),
        ("4.5个点", [4.5]),
        ("千分之五的手续费", [0.5]),
        ("百分百保本", [100.0]),
        ("五万块", [50000.0]),
        ("三点五", [3.5]),
        ("零点五", [0.5]),
        ("一百零五", [105.0]),
        ("月薪两万五", [25000.0]),
        ("三万五千", [35000.0]),
        ("1.5亿", [150_000_000.0]),
        ("5千万", [50_000_000.0]),
        ("一千万元", [10_000_000.0]),
        ("1.5w", [15000.0]),
        ("2k", [2000.0]),
        ("¥2,000", [2000.0]),
        ("1,234,567.89", [1234567.89]),
        ("三块五", [3.5]),
        ("一共十二块五毛", [12.5]),
        ("幺三八", [138.0]),
        ("５万", [50000.0]),
        ("１２３４５", [12345.0]),
        ("全额5\u200b万", [50000.0]),
        ("工资5万一个月", [50000.0]),
        # ranges share the multiplier / percent
        ("3到5万", [30000.0, 50000.0]),
        ("3万到5万", [30000.0, 50000.0]),
        ("3-5%", [3.0, 5.0]),
        ("300-500元", [300.0, 500.0]),
        ("五到一千", [5.0, 1000.0]),
        ("给我推荐两三只基金", [2.0, 3.0]),
        ("最近三五万的理财有哪些", [30000.0, 50000.0]),
        # dates and clock times
        ("2026年3月5日", [2026.0, 3.0, 5.0]),
        ("二〇二六年三月五号", [2026.0, 3.0, 5.0]),
        ("2026-12-01", [2026.0, 12.0, 1.0]),
        ("明天9:30见", [9.0, 30.0]),
        ("下午三点五十到会议室", [3.0, 50.0]),
        ("3点05分", [3.0, 5.0]),
        ("下午一点", [1.0]),
        ("一点钟", [1.0]),
        ("周一", [1.0]),
        ("15号", [15.0]),
        ("十分钟后", [10.0]),
        # lone 一 counts before a unit
        ("一年期", [1.0]),
        ("一个月", [1.0]),
        ("一元", [1.0]),
        # signs are ignored
        ("跌了3.5%", [3.5]),
        ("-3%", [3.0]),
        ("负增长3%", [3.0]),
        ("零风险", [0.0]),
        # identifiers and codes
        ("尾号6688", [6688.0]),
        ("12345热线", [12345.0]),
        ("请拨打95588", [95588.0]),
        ("5G网络", [5.0]),
        ("10km", [10.0]),
        # English
        ("10 thousand yuan", [10000.0]),
        ("1.5 million dollars", [1_500_000.0]),
        ("3.5 percent", [3.5]),
        ("two thousand", [2000.0]),
        ("twenty-five", [25.0]),
        ("two thousand five hundred", [2500.0]),
        ("one hundred and five", [105.0]),
        ("fifty percent", [50.0]),
        ("one year deposit", [1.0]),
        ("I want to transfer $500", [500.0]),
        ("RMB5000", [5000.0]),
        ("USD200", [200.0]),
    ],
)
def test_extract_numbers(text: str, expected: list[float]) -> None:
    assert extract_numbers(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "你好",
        "谢谢",
        "稍等一下，我帮您查一下",
        "我需要一个账户",
        "我们一起去",
        "便宜一点",
        "多一点点",
        "万一亏了呢",
        "千万不要买",
        "十分满意",
        "五险一金",
        "四川成都",
        "零钱通",
        "第一步，打开APP",
        "第3季度",
        "一、开户 二、转账",
        "1、登录",
        "(1)首先",
        "（一）首先",
        "H200显卡",
        "iPhone15",
        "i like this one",
        "万无一失",
        "",
    ],
)
def test_extract_numbers_finds_nothing(text: str) -> None:
    assert extract_numbers(text) == []


def test_find_numbers_spans_index_the_original_text() -> None:
    text = "年化５％，起投５万元"
    mentions = find_numbers(text)
    assert [(m.value, m.text, m.start, m.end, m.percent) for m in mentions] == [
        (5.0, "５％", 2, 4, True),
        (50000.0, "５万", 7, 9, False),
    ]
    for m in mentions:
        assert text[m.start : m.end] == m.text


def test_find_numbers_percent_prefix_span() -> None:
    (m,) = find_numbers("收益百分之三点五")
    assert (m.value, m.text, m.start, m.end, m.percent) == (3.5, "百分之三点五", 2, 8, True)


def test_find_numbers_multiplier() -> None:
    (m,) = find_numbers("5万")
    assert m.multiplier == 10000.0


@pytest.mark.parametrize(
    ("words", "value"),
    [
        ("zero", 0.0),
        ("seven", 7.0),
        ("twenty-one", 21.0),
        ("one hundred and five", 105.0),
        ("two thousand", 2000.0),
        ("three million two hundred thousand", 3_200_000.0),
        ("hundred", None),
        ("thousand", None),
        ("banana", None),
        ("", None),
    ],
)
def test_parse_english_number(words: str, value: float | None) -> None:
    assert parse_english_number(words) == value


@pytest.mark.parametrize(
    ("reply", "sources", "ungrounded"),
    [
        ("年化收益率约5%，起投金额5万元", ["我想买年化5%的基金", "起投金额50000元"], []),
        ("起投5万", ["起投金额50,000元"], []),
        ("起投50000元", ["五万起投"], []),
        ("年化三点五", ["年化3.5%"], []),
        ("年化收益率约3.5%，起投5万", ["三点五"], [50000.0]),
        ("这款产品年化8%，保本", ["年化5%左右"], [8.0]),
        ("利率为0.05", ["利率5%"], [0.05]),  # percents are not converted to fractions
        ("您好，请问有什么可以帮您？", [], []),
        ("好的，稍等一下", ["你好"], []),
        ("已为您预订明天上午9点的会议室", ["帮我订明天上午九点的会议室"], []),
        ("转账5万元到尾号6688的账户", ["我想转五万到尾号6688的卡"], []),
        ("转账5万元到尾号6688的账户", ["我想转五万"], [6688.0]),
        ("年化4%，期限3年，最低5万", ["年化4%"], [3.0, 50000.0]),
        ("3%、3%、7%", ["3%"], [7.0]),  # each ungrounded number once
        ("预计收益10万", [], [100000.0]),
        ("预计收益10万", ["KB: 收益上限100000元", "用户：随便"], []),
    ],
)
def test_numbers_grounded(reply: str, sources: list[str], ungrounded: list[float]) -> None:
    assert numbers_grounded(reply, sources) == ungrounded


def test_numbers_grounded_tolerance() -> None:
    assert numbers_grounded("约3.3333%", ["3.33333%"]) == [3.3333]
    assert numbers_grounded("约3.3333%", ["3.33333%"], rel_tol=1e-3) == []
