"""Tests for miaohui.nlp.normalize: model-input normalization, offset-preserving folding, Chinese numerals."""

from __future__ import annotations

import pytest

from miaohui.nlp.normalize import cn_to_number, fold_with_offsets, normalize_text


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("你好", "你好"),
        ("  你好  ", "你好"),
        ("ｈｅｌｌｏ　ｗｏｒｌｄ", "hello world"),
        ("我想转５万", "我想转5万"),
        ("年化５％左右", "年化5%左右"),
        ("ＡＢＣ１２３", "ABC123"),
        ("好的，谢谢！", "好的,谢谢!"),  # full-width ASCII punctuation becomes ASCII
        ("你好。请问、什么时候？", "你好。请问、什么时候?"),  # 。、 are not in FF01–FF5E: kept
        ("“稳健型”《基金》【理财】", "“稳健型”《基金》【理财】"),
        ("转账￥２，０００", "转账¥2,000"),
        ("尾号\u200b6688", "尾号6688"),
        ("\ufeff帮我订会议室", "帮我订会议室"),
        ("明天\u200d上午", "明天上午"),
        ("a\t\tb\n\nc", "a b c"),
        ("第一行\r\n第二行", "第一行 第二行"),
        ("多个   空格", "多个 空格"),
        ("Hello World", "Hello World"),  # case is kept
        ("\x00控制\x07字符", "控制 字符"),
        ("", ""),
        ("   ", ""),
        ("①号窗口", "1号窗口"),
        ("\u2f08", "人"),  # Kangxi radical → ordinary ideograph
        ("ｶﾀｶﾅ", "カタカナ"),
        ("5\u00a0000", "5 000"),
    ],
)
def test_normalize_text(raw: str, expected: str) -> None:
    assert normalize_text(raw) == expected


def test_normalize_text_is_idempotent() -> None:
    samples = ["ｈｅｌｌｏ　５万，好的。", " 尾号\u200b６６８８ ", "a\t b"]
    for s in samples:
        once = normalize_text(s)
        assert normalize_text(once) == once


@pytest.mark.parametrize(
    ("raw", "folded"),
    [
        ("你好", "你好"),
        ("５万", "5万"),
        ("尾号\u200b6688", "尾号6688"),
        ("a\tb", "a b"),
        ("转账￥２，０００元", "转账¥2,000元"),
        ("plain ascii", "plain ascii"),
    ],
)
def test_fold_with_offsets_text(raw: str, folded: str) -> None:
    out, offsets = fold_with_offsets(raw)
    assert out == folded
    assert len(offsets) == len(out) + 1
    assert offsets[-1] == len(raw)


def test_fold_with_offsets_maps_back_across_removed_characters() -> None:
    raw = "尾号\u200b6688"
    folded, offsets = fold_with_offsets(raw)
    start = folded.index("6688")
    assert offsets[start] == 3
    assert raw[offsets[start] : offsets[start + 3] + 1] == "6688"


def test_fold_with_offsets_maps_expanding_characters() -> None:
    raw = "约…5万"  # "…" folds to "..." (three characters from one)
    folded, offsets = fold_with_offsets(raw)
    assert folded == "约...5万"
    assert offsets == [0, 1, 1, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("五", 5.0),
        ("十", 10.0),
        ("十五", 15.0),
        ("二十三", 23.0),
        ("一十一", 11.0),
        ("一百", 100.0),
        ("一百零五", 105.0),
        ("一百一十五", 115.0),
        ("一百五", 150.0),
        ("两百五", 250.0),
        ("两千", 2000.0),
        ("两千五", 2500.0),
        ("一千二", 1200.0),
        ("一千零五十", 1050.0),
        ("三万五", 35000.0),
        ("三万五千", 35000.0),
        ("一万零五百", 10500.0),
        ("二十万", 200000.0),
        ("五千万", 50_000_000.0),
        ("一亿二千万", 120_000_000.0),
        ("三亿五千万", 350_000_000.0),
        ("一亿五", 150_000_000.0),
        ("一万亿", 1e12),
        ("5万", 50000.0),
        ("1.5亿", 150_000_000.0),
        ("1.1万", 11000.0),
        ("2000万", 20_000_000.0),
        ("1万5", 15000.0),
        ("3千5百", 3500.0),
        ("2,000", 2000.0),
        ("1,234,567.89", 1234567.89),
        ("2k", 2000.0),
        ("1.5w", 15000.0),
        ("3.5", 3.5),
        ("三点五", 3.5),
        ("零点五", 0.5),
        ("二十三点五", 23.5),
        ("三点五万", 35000.0),
        ("一点二亿", 120_000_000.0),
        ("3点5", 3.5),
        ("点五", 0.5),
        ("百分之四", 4.0),
        ("百分之三点五", 3.5),
        ("百分之十五", 15.0),
        ("百分之一百", 100.0),
        ("千分之五", 0.5),
        ("千分之三点五", 0.35),
        ("万分之五", 0.05),
        ("5%", 5.0),
        ("0.07%", 0.07),
        ("两", 2.0),
        ("〇", 0.0),
        ("零", 0.0),
        ("幺", 1.0),
        ("幺三八", 138.0),
        ("二零二六", 2026.0),
        ("一二三四", 1234.0),
        ("幺零", 10.0),
        ("壹万贰仟", 12000.0),
        ("叁佰", 300.0),
        ("负三", -3.0),
        ("-2.5", -2.5),
        ("５万", 50000.0),  # full-width digits
        (" 5 万 ", 50000.0),
    ],
)
def test_cn_to_number(text: str, value: float) -> None:
    assert cn_to_number(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "万",
        "百",
        "千万",
        "点",
        "百分之",
        "两三",  # an approximate range (2–3), not 23
        "三五万",  # 3–5万
        "三十百",
        "三点五十",  # a clock time, not a decimal
        "三点五点六",
        "五块",
        "hello",
        "123abc",
        "3.5.1",
        "5五",
        "几",
    ],
)
def test_cn_to_number_rejects(text: str) -> None:
    assert cn_to_number(text) is None


def test_fold_with_offsets_fast_path_agrees_with_the_per_character_fold() -> None:
    """The ``str.translate`` fast path gives what folding one character at a time gives, whether or not a
    character in the text folds to zero or several characters (seen before or for the first time)."""
    import random

    from miaohui.nlp.normalize import _fold_char, _is_plain

    def reference(text: str) -> tuple[str, list[int]]:
        out, offsets = [], []
        for i, ch in enumerate(text):
            f = ch if _is_plain(ch) else _fold_char(ch)
            out.append(f)
            offsets.extend([i] * len(f))
        return "".join(out), [*offsets, len(text)]

    rng = random.Random(1)
    pool = "ａｂＣ１２３，。？！　\u200b\u00a0\t\nﬁ㍱①²½Åé가中文理财 abc\u2028\U0001f600"
    for _ in range(3000):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 24)))
        assert fold_with_offsets(text) == reference(text), repr(text)
