"""Tests for miaohui.nlp.slots.extract_slots: exact values, spans and units, Chinese and English."""

from __future__ import annotations

import itertools
import time as _time
from datetime import datetime, timedelta, timezone

import pytest

from miaohui.nlp.slots import Slot, extract_slots

#: A fixed "now": Wednesday 2026-11-25 10:00. Tomorrow is Thu 11-26, Friday is 11-27,
#: next week's Monday is 11-30 and next week's Wednesday is 12-02.
NOW = datetime(2026, 11, 25, 10, 0)

Row = tuple[str, str | float, str, int, str | None]


def _rows(text: str, now: datetime = NOW) -> list[Row]:
    """(name, value, text, start, unit) for every slot, after checking the span invariant."""
    slots = extract_slots(text, now)
    for s in slots:
        assert text[s.start : s.end] == s.text, s
    starts = [s.start for s in slots]
    assert starts == sorted(starts)
    for a, b in itertools.pairwise(slots):
        assert a.end <= b.start, (a, b)  # no overlaps
    return [(s.name, s.value, s.text, s.start, s.unit) for s in slots]


# ------------------------------------------------------------------------------------------------ seeds


def test_seed_fund_recommendation() -> None:
    assert _rows("我想买一只稳健型基金，年化收益5%左右") == [
        ("risk_level", "稳健型", "稳健型", 5, None),
        ("product", "基金", "基金", 8, None),
        ("percent", 5.0, "5%", 15, "%"),
    ]


def test_seed_book_meeting_room() -> None:
    assert _rows("帮我订明天上午九点的会议室") == [
        ("datetime", "2026-11-26T09:00:00", "明天上午九点", 3, None),
    ]


def test_seed_card_loss() -> None:
    assert _rows("我尾号6688的卡丢了") == [("card_tail", "6688", "6688", 3, None)]


def test_seed_transfer() -> None:
    assert _rows("我想转5万到我妈的账户") == [("amount", 50000.0, "5万", 3, "CNY")]


def test_slot_model_fields() -> None:
    (slot,) = extract_slots("我想转5万到我妈的账户", NOW)
    assert slot == Slot(name="amount", value=50000.0, text="5万", start=3, end=5, unit="CNY")


# ----------------------------------------------------------------------------------------------- amount


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("五万块", [("amount", 50000.0, "五万块", 0, "CNY")]),
        ("¥2,000", [("amount", 2000.0, "¥2,000", 0, "CNY")]),
        ("转账￥２，０００", [("amount", 2000.0, "￥２，０００", 2, "CNY")]),
        ("2000元", [("amount", 2000.0, "2000元", 0, "CNY")]),
        ("3千块钱", [("amount", 3000.0, "3千块钱", 0, "CNY")]),
        ("大概2k吧", [("amount", 2000.0, "2k", 2, "CNY")]),
        ("1.5w左右", [("amount", 15000.0, "1.5w", 0, "CNY")]),
        ("$300", [("amount", 300.0, "$300", 0, "USD")]),
        ("RMB 5,000", [("amount", 5000.0, "RMB 5,000", 0, "CNY")]),
        ("RMB5000", [("amount", 5000.0, "RMB5000", 0, "CNY")]),
        ("USD200", [("amount", 200.0, "USD200", 0, "USD")]),
        ("HK$100", [("amount", 100.0, "HK$100", 0, "HKD")]),
        ("US$ 1,000", [("amount", 1000.0, "US$ 1,000", 0, "USD")]),
        ("10 thousand yuan", [("amount", 10000.0, "10 thousand yuan", 0, "CNY")]),
        ("two thousand", [("amount", 2000.0, "two thousand", 0, "CNY")]),
        ("five hundred dollars", [("amount", 500.0, "five hundred dollars", 0, "USD")]),
        ("我要把1万块转给张三", [("amount", 10000.0, "1万块", 3, "CNY")]),
        ("我想转一万五给他", [("amount", 15000.0, "一万五", 3, "CNY")]),
        ("月薪两万五", [("amount", 25000.0, "两万五", 2, "CNY")]),
        ("我想存50万", [("amount", 500000.0, "50万", 3, "CNY")]),
        ("二十万", [("amount", 200000.0, "二十万", 0, "CNY")]),
        ("一千二百块", [("amount", 1200.0, "一千二百块", 0, "CNY")]),
        ("一百块钱", [("amount", 100.0, "一百块钱", 0, "CNY")]),
        ("三块五", [("amount", 3.5, "三块五", 0, "CNY")]),
        ("五毛钱", [("amount", 0.5, "五毛钱", 0, "CNY")]),
        ("转账1000美元", [("amount", 1000.0, "1000美元", 2, "USD")]),
        ("帮我换500港币", [("amount", 500.0, "500港币", 3, "HKD")]),
        ("买200欧元", [("amount", 200.0, "200欧元", 1, "EUR")]),
        ("300刀", [("amount", 300.0, "300刀", 0, "USD")]),
        ("I want to transfer $500 to my mom", [("amount", 500.0, "$500", 19, "USD")]),
        ("transfer 5,000 RMB", [("amount", 5000.0, "5,000 RMB", 9, "CNY")]),
        ("1.5亿", [("amount", 150_000_000.0, "1.5亿", 0, "CNY")]),
        ("工资5万一个月", [("amount", 50000.0, "5万", 2, "CNY")]),
        ("3到5万", [("amount", 30000.0, "3", 0, "CNY"), ("amount", 50000.0, "5万", 2, "CNY")]),
        ("300-500元", [("amount", 300.0, "300", 0, "CNY"), ("amount", 500.0, "500元", 4, "CNY")]),
    ],
)
def test_amount(text: str, expected: list[Row]) -> None:
    assert _rows(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "5万人参加了活动",
        "每天走3万步",
        "我们一块去吧",
        "两块屏幕",
        "有三千人",
        "元旦快乐",
        "月供八千多",  # no currency and no 万: not claimed as an amount
        "我有2个账户",
    ],
)
def test_amount_negatives(text: str) -> None:
    assert [r for r in _rows(text) if r[0] == "amount"] == []


# ---------------------------------------------------------------------------------------------- percent


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("年化5%", [("percent", 5.0, "5%", 2, "%")]),
        ("5%", [("percent", 5.0, "5%", 0, "%")]),
        ("年化５％左右", [("percent", 5.0, "５％", 2, "%")]),
        ("百分之四", [("percent", 4.0, "百分之四", 0, "%")]),
        ("收益百分之三点五", [("percent", 3.5, "百分之三点五", 2, "%")]),
        ("4.5个点", [("percent", 4.5, "4.5个点", 0, "%")]),
        ("降了0.25个百分点", [("percent", 0.25, "0.25个百分点", 2, "%")]),
        ("3.5 percent", [("percent", 3.5, "3.5 percent", 0, "%")]),
        ("about 4 per cent", [("percent", 4.0, "4 per cent", 6, "%")]),
        ("千分之五的手续费", [("percent", 0.5, "千分之五", 0, "%")]),
        ("年化三点五", [("percent", 3.5, "三点五", 2, "%")]),
        ("收益率3.8左右", [("percent", 3.8, "3.8", 3, "%")]),
        ("年化收益率大概4.2%", [("percent", 4.2, "4.2%", 7, "%")]),
        ("百分百保本吗", [("percent", 100.0, "百分百", 0, "%")]),
        ("3-5%", [("percent", 3.0, "3", 0, "%"), ("percent", 5.0, "5%", 2, "%")]),
        ("3%到5%之间", [("percent", 3.0, "3%", 0, "%"), ("percent", 5.0, "5%", 3, "%")]),
        (
            "三年期大额存单利率3.1%",
            [("product", "大额存单", "大额存单", 3, None), ("percent", 3.1, "3.1%", 9, "%")],
        ),
    ],
)
def test_percent(text: str, expected: list[Row]) -> None:
    assert _rows(text) == expected


@pytest.mark.parametrize("text", ["利率是多少", "利息500元", "收益5万"])
def test_percent_negatives(text: str) -> None:
    assert [r for r in _rows(text) if r[0] == "percent"] == []


# --------------------------------------------------------------------------------------------- datetime


@pytest.mark.parametrize(
    ("text", "value", "span"),
    [
        ("明天上午九点", "2026-11-26T09:00:00", "明天上午九点"),
        ("今天下午3点半", "2026-11-25T15:30:00", "今天下午3点半"),
        ("后天", "2026-11-27", "后天"),
        ("大后天", "2026-11-28", "大后天"),
        ("昨天", "2026-11-24", "昨天"),
        ("15号", "2026-12-15", "15号"),  # the 15th has passed this month: next month
        ("30号", "2026-11-30", "30号"),
        ("31号", "2026-12-31", "31号"),  # November has no 31st
        ("下周三下午两点", "2026-12-02T14:00:00", "下周三下午两点"),
        ("周五", "2026-11-27", "周五"),
        ("周三", "2026-11-25", "周三"),  # today is Wednesday
        ("周一", "2026-11-30", "周一"),
        ("这周一", "2026-11-23", "这周一"),
        ("本周五", "2026-11-27", "本周五"),
        ("下下周一", "2026-12-07", "下下周一"),
        ("上周五", "2026-11-20", "上周五"),
        ("星期天上午", "2026-11-29", "星期天上午"),
        ("礼拜六", "2026-11-28", "礼拜六"),
        ("周末", "2026-11-28", "周末"),
        ("3月5日", "2027-03-05", "3月5日"),
        ("十二月一号", "2026-12-01", "十二月一号"),
        ("2026年12月1日", "2026-12-01", "2026年12月1日"),
        ("2026-12-01 09:00", "2026-12-01T09:00:00", "2026-12-01 09:00"),
        ("2026/12/01", "2026-12-01", "2026/12/01"),
        ("下个月15号上午十点", "2026-12-15T10:00:00", "下个月15号上午十点"),
        ("这个月30号", "2026-11-30", "这个月30号"),
        ("三天后", "2026-11-28", "三天后"),
        ("晚上8点", "2026-11-25T20:00:00", "晚上8点"),
        ("明早8点", "2026-11-26T08:00:00", "明早8点"),
        ("今晚8点半", "2026-11-25T20:30:00", "今晚8点半"),
        ("明天晚上十二点", "2026-11-27T00:00:00", "明天晚上十二点"),
        ("凌晨两点", "2026-11-25T02:00:00", "凌晨两点"),
        ("中午12点", "2026-11-25T12:00:00", "中午12点"),
        ("中午1点", "2026-11-25T13:00:00", "中午1点"),
        ("下午1点", "2026-11-25T13:00:00", "下午1点"),
        ("下午一点开会", "2026-11-25T13:00:00", "下午一点"),
        ("傍晚6点", "2026-11-25T18:00:00", "傍晚6点"),
        ("明天下午三点一刻", "2026-11-26T15:15:00", "明天下午三点一刻"),
        ("下午三点四十", "2026-11-25T15:40:00", "下午三点四十"),
        ("下午3点05分", "2026-11-25T15:05:00", "下午3点05分"),
        ("15时30分", "2026-11-25T15:30:00", "15时30分"),
        ("9:30", "2026-11-25T09:30:00", "9:30"),
        ("三点钟", "2026-11-25T03:00:00", "三点钟"),  # no period: the hour is taken literally
        ("明天下午", "2026-11-26", "明天下午"),  # a period without a clock time: date only
        ("帮我订15号下午的会议室", "2026-12-15", "15号下午"),
        ("晚上十点以后还在施工", "2026-11-25T22:00:00", "晚上十点"),
        ("每天晚上跳到十点", "2026-11-25T22:00:00", "十点"),  # the clause's 晚上 applies
        ("tomorrow at 9am", "2026-11-26T09:00:00", "tomorrow at 9am"),
        ("next Monday 3pm", "2026-11-30T15:00:00", "next Monday 3pm"),
        ("this Friday", "2026-11-27", "this Friday"),
        ("Book a room for tomorrow at 2:30 pm", "2026-11-26T14:30:00", "tomorrow at 2:30 pm"),
        ("Can I book a room on Friday afternoon?", "2026-11-27", "Friday afternoon"),
        ("tomorrow morning at 9", "2026-11-26T09:00:00", "tomorrow morning at 9"),
        ("Reserve room for Dec 3rd at 10am", "2026-12-03T10:00:00", "Dec 3rd at 10am"),
        ("on 3 December 2026", "2026-12-03", "3 December 2026"),
        ("at 9am tomorrow", "2026-11-26T09:00:00", "9am tomorrow"),
        ("tonight at 8", "2026-11-25T20:00:00", "tonight at 8"),
        ("the day after tomorrow", "2026-11-27", "the day after tomorrow"),
        ("at noon", "2026-11-25T12:00:00", "noon"),
        ("Friday at 3", "2026-11-27T03:00:00", "Friday at 3"),
        ("tomorrow evening at 7", "2026-11-26T19:00:00", "tomorrow evening at 7"),
    ],
)
def test_datetime(text: str, value: str, span: str) -> None:
    rows = [r for r in _rows(text) if r[0] == "datetime"]
    assert rows == [("datetime", value, span, text.index(span), None)]


def test_datetime_range_inherits_date_and_period() -> None:
    assert _rows("明天下午两点到四点") == [
        ("datetime", "2026-11-26T14:00:00", "明天下午两点", 0, None),
        ("datetime", "2026-11-26T16:00:00", "四点", 7, None),
    ]


def test_datetime_with_aware_now_keeps_the_offset() -> None:
    now = datetime(2026, 11, 25, 10, 0, tzinfo=timezone(timedelta(hours=8)))
    (slot,) = extract_slots("明天上午九点", now)
    assert slot.value == "2026-11-26T09:00:00+08:00"


def test_datetime_defaults_to_now() -> None:
    before = datetime.now().date()
    (slot,) = extract_slots("明天")
    after = datetime.now().date()
    assert slot.value in {(d + timedelta(days=1)).isoformat() for d in (before, after)}


@pytest.mark.parametrize(
    "text",
    [
        "帮我订3号会议室",
        "坐地铁1号线",
        "便宜一点",
        "晚一点再说",
        "早点休息",
        "我有两点建议",
        "一周五天班",
        "第三季度",
        "3月份的账单",
        "2月30日",
        "三点五",
        "一日游",
    ],
)
def test_datetime_negatives(text: str) -> None:
    assert [r for r in _rows(text) if r[0] == "datetime"] == []


# ---------------------------------------------------------------------------------------------- product


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("最近黄金涨得不错，现在入场合适吗？", ["黄金"]),
        ("我想办一张信用卡", ["信用卡"]),
        ("房贷利率现在是多少", ["房贷"]),
        ("一年期定期利率是多少", ["定期"]),
        ("活期存款利率", ["活期"]),
        ("大额存单20万起存吗", ["大额存单"]),
        ("货币基金和债券基金哪个好", ["货币基金", "债券基金"]),
        ("余额宝安全吗", ["货币基金"]),
        ("买点股票型基金", ["股票型基金"]),
        ("稳健型基金", ["基金"]),
        ("我想理财", ["理财"]),
        ("有什么理财产品推荐", ["理财"]),
        ("想买点国债", ["国债"]),
        ("外汇牌价", ["外汇"]),
        ("重疾险怎么买", ["保险"]),
        ("炒股亏了", ["股票"]),
        ("按揭贷款还款", ["房贷"]),
        ("消费贷利率", ["消费贷"]),
        ("结构性存款保本吗", ["结构性存款"]),
        ("Is now a good time to buy gold?", ["黄金"]),
        ("What's the rate on a time deposit?", ["定期"]),
        ("I want a bond fund", ["债券基金"]),
        ("Any money market funds?", ["货币基金"]),
        ("Should I buy stocks or a CD?", ["股票", "大额存单"]),
        ("my mortgage and credit card", ["房贷", "信用卡"]),
    ],
)
def test_product(text: str, values: list[str]) -> None:
    assert [r[1] for r in _rows(text) if r[0] == "product"] == values


@pytest.mark.parametrize(
    "text",
    [
        "定期检查身体",
        "黄金周去哪玩",
        "保险起见还是问一下",
        "社会保险怎么交",
        "理财经理是谁",
        "I have a cd player",
        "基金会捐款",
        "公积金贷款怎么办",
    ],
)
def test_product_negatives(text: str) -> None:
    assert [r for r in _rows(text) if r[0] == "product"] == []


# ------------------------------------------------------------------------------------------- risk_level


@pytest.mark.parametrize(
    ("text", "value", "span"),
    [
        ("我是保守型投资者", "保守型", "保守型"),
        ("谨慎型", "保守型", "谨慎型"),
        ("稳健一点的", "稳健型", "稳健"),
        ("平衡型", "平衡型", "平衡型"),
        ("成长型", "成长型", "成长型"),
        ("进取型", "进取型", "进取型"),
        ("激进型", "进取型", "激进型"),
        ("低风险的产品", "保守型", "低风险"),
        ("中低风险", "稳健型", "中低风险"),
        ("中风险", "平衡型", "中风险"),
        ("中高风险", "成长型", "中高风险"),
        ("高风险高收益", "进取型", "高风险"),
        ("我的风险等级是C3", "平衡型", "C3"),
        ("推荐了一款R2的产品", "稳健型", "R2"),
        ("I'm a conservative investor", "保守型", "conservative"),
        ("something low risk", "保守型", "low risk"),
        ("low-to-medium risk please", "稳健型", "low-to-medium risk"),
        ("a balanced portfolio", "平衡型", "balanced"),
        ("I am aggressive", "进取型", "aggressive"),
        ("high-risk products", "进取型", "high-risk"),
    ],
)
def test_risk_level(text: str, value: str, span: str) -> None:
    rows = [r for r in _rows(text) if r[0] == "risk_level"]
    assert rows == [("risk_level", value, span, text.index(span), None)]


@pytest.mark.parametrize("text", ["C1驾照怎么考", "我的风险等级是多少", "风险高不高"])
def test_risk_level_negatives(text: str) -> None:
    assert [r for r in _rows(text) if r[0] == "risk_level"] == []


# --------------------------------------------------------------------------------------------- district


@pytest.mark.parametrize(
    ("text", "value", "span"),
    [
        ("我在海淀区", "海淀区", "海淀区"),
        ("我要投诉朝阳区的施工噪音", "朝阳区", "朝阳区"),
        ("我家在上海市徐汇区漕河泾", "徐汇区", "徐汇区"),
        ("住在浦东新区", "浦东新区", "浦东新区"),
        ("我在浦东", "浦东新区", "浦东"),
        ("西湖区文三路停电了", "西湖区", "西湖区"),
        ("郑州市金水区", "金水区", "金水区"),
        ("我家在金水区", "金水区", "金水区"),
        ("投诉金水区的物业", "金水区", "金水区"),
        ("我在顺德区", "顺德区", "顺德区"),
        ("请问高新区怎么走", "高新区", "高新区"),
        ("余姚县的户口", "余姚县", "余姚县"),
        ("雄安新区", "雄安新区", "雄安新区"),
        ("天津滨海新区", "滨海新区", "滨海新区"),
        ("成都高新区", "高新区", "高新区"),
        ("I live in Haidian District", "海淀区", "Haidian District"),
    ],
)
def test_district(text: str, value: str, span: str) -> None:
    rows = [r for r in _rows(text) if r[0] == "district"]
    assert rows == [("district", value, span, text.index(span), None)]


@pytest.mark.parametrize(
    "text",
    [
        "我住在小区里",
        "我们社区",
        "我们小区停电了，什么时候来电",
        "景区门票多少钱",
        "园区里的公司",
        "市区限行吗",
        "东部地区",
        "开发区管委会",
        "保税区怎么走",
        "上海自贸区",
        "这片区域经常停水",
        "这两个有什么区别",
        "每个区的政策不一样",
        "本县的户籍",
        "我们县里",
        "去县城",
        "在天河机场",
        "西湖边散步",
        "A区停车场",
        "校区",
    ],
)
def test_district_negatives(text: str) -> None:
    assert [r for r in _rows(text) if r[0] == "district"] == []


# -------------------------------------------------------------------------------------------- card_tail


@pytest.mark.parametrize(
    ("text", "value", "span"),
    [
        ("我尾号6688的卡丢了", "6688", "6688"),
        ("尾数是6688", "6688", "6688"),
        ("卡号后四位 8899", "8899", "8899"),
        ("尾号为1234的储蓄卡", "1234", "1234"),
        ("尾号：5566", "5566", "5566"),
        ("尾号是六六八八", "6688", "六六八八"),
        ("尾号幺二三四", "1234", "幺二三四"),
        ("my card ending in 4321", "4321", "4321"),
        ("My card ending with 8899 was stolen", "8899", "8899"),
        ("last four digits 1234", "1234", "1234"),
        ("the last 4 digits are 5678", "5678", "5678"),
    ],
)
def test_card_tail(text: str, value: str, span: str) -> None:
    rows = [r for r in _rows(text) if r[0] == "card_tail"]
    assert rows == [("card_tail", value, span, text.index(span), None)]


@pytest.mark.parametrize("text", ["手机尾号1234", "尾号12345", "尾号123", "ending in 12345"])
def test_card_tail_negatives(text: str) -> None:
    assert [r for r in _rows(text) if r[0] == "card_tail"] == []


# ---------------------------------------------------------------------------------------------- mixing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "我是保守型投资者，想买点国债",
            [("risk_level", "保守型", "保守型", 2, None), ("product", "国债", "国债", 12, None)],
        ),
        (
            "信用卡额度5万",
            [("product", "信用卡", "信用卡", 0, None), ("amount", 50000.0, "5万", 5, "CNY")],
        ),
        (
            "transfer 5,000 RMB to account ending in 1234",
            [("amount", 5000.0, "5,000 RMB", 9, "CNY"), ("card_tail", "1234", "1234", 40, None)],
        ),
        (
            "我要投诉朝阳区的施工噪音，晚上十点以后还在施工",
            [
                ("district", "朝阳区", "朝阳区", 4, None),
                ("datetime", "2026-11-25T22:00:00", "晚上十点", 13, None),
            ],
        ),
        (
            "帮我把明天下午三点的会议取消",
            [("datetime", "2026-11-26T15:00:00", "明天下午三点", 3, None)],
        ),
        (
            "尾号6688的卡明天下午3点前转5万，年化4%的理财",
            [
                ("card_tail", "6688", "6688", 2, None),
                ("datetime", "2026-11-26T15:00:00", "明天下午3点", 8, None),
                ("amount", 50000.0, "5万", 16, "CNY"),
                ("percent", 4.0, "4%", 21, "%"),
                ("product", "理财", "理财", 24, None),
            ],
        ),
        (
            "I'm a conservative investor looking for a balanced fund",
            [
                ("risk_level", "保守型", "conservative", 6, None),
                ("risk_level", "平衡型", "balanced", 42, None),
                ("product", "基金", "fund", 51, None),
            ],
        ),
        (
            "帮我查一下15号转的2000元",
            [
                ("datetime", "2026-12-15", "15号", 5, None),
                ("amount", 2000.0, "2000元", 10, "CNY"),
            ],
        ),
    ],
)
def test_mixed(text: str, expected: list[Row]) -> None:
    assert _rows(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "你好",
        "谢谢",
        "再见",
        "我住在小区里",
        "我要转人工",
        "你们的服务太差了，手续费乱收",
        "请帮我查一下余额",
        "我想查一下我的社保缴费记录",
        "身份证丢了怎么补办",
        "营业执照注销要多久",
        "闯红灯扣几分",
        "12345热线",
        "我的手机号是13812345678",
        "hello",
        "thanks, bye",
        "",
    ],
)
def test_no_slots(text: str) -> None:
    assert _rows(text) == []


def test_overlaps_resolved_by_specificity() -> None:
    # the 5 of 年化5% is a percent, not an amount; 尾号1234 is not an amount; 15号 is a date
    assert [r[0] for r in _rows("年化5%")] == ["percent"]
    assert [r[0] for r in _rows("尾号1234")] == ["card_tail"]
    assert [r[0] for r in _rows("15号")] == ["datetime"]


def test_full_width_and_zero_width_spans() -> None:
    text = "尾号\u200b６６８８，转５万元"
    assert _rows(text) == [
        ("card_tail", "6688", "６６８８", 3, None),
        ("amount", 50000.0, "５万元", 9, "CNY"),
    ]


def test_extraction_is_fast() -> None:
    texts = [
        "我想买一只稳健型基金，年化收益5%左右",
        "帮我订明天上午九点的会议室",
        "我尾号6688的卡丢了",
        "我要投诉朝阳区的施工噪音，晚上十点以后还在施工",
        "Book a meeting room for tomorrow at 2:30 pm",
    ]
    for t in texts:  # warm-up (regex compilation, caches)
        extract_slots(t, NOW)
    rounds = 200
    start = _time.perf_counter()
    for _ in range(rounds):
        for t in texts:
            extract_slots(t, NOW)
    per_call = (_time.perf_counter() - start) / (rounds * len(texts))
    assert per_call < 1e-3


def test_prefilters_never_skip_a_match() -> None:
    """The cheap trigger searches that skip the datetime and risk alternations hit wherever those match (every
    dataset text, plus random mixes of the characters and words they key on)."""
    import random

    from miaohui.nlp import slots_datetime as d
    from miaohui.nlp import slots_products as p
    from miaohui.nlp.normalize import fold_with_offsets
    from miaohui.zoo.intents import load_split

    rng = random.Random(0)
    pool = [*"今明昨天日号月周期拜点时1２七十半刻上下午晚早号保守稳健型中低高风险进取激长衡谨 ",
        " Day ", "tomorrow", "tonight", " noon", "midnight", " monday ", " jan 5", "R3", "c2", "风险等级",
        " conservative ", " growth ", " low-risk ", "balanced", "aggressive", "cautious", "3pm", "10:30"]  # fmt: skip
    texts = [x.text for split in ("train", "dev") for x in load_split(split)]
    texts += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 12))) for _ in range(5000)]
    for text in texts:
        folded = fold_with_offsets(text)[0]
        if d._DATE_RE.search(folded) or d._TIME_RE.search(folded):
            assert d._DATETIME_TRIGGER_RE.search(folded), text
        if p._RISK_RE.search(folded) or p._RISK_CODE_RE.search(folded):
            assert p._RISK_TRIGGER_RE.search(folded), text
