"""The hand-written intent dataset: coverage, balance, no train/dev leakage, and loader errors."""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from importlib import resources

import pytest

from miaohui.errors import ConfigError
from miaohui.zoo.intents import BUSINESS_LINE, LABELS, IntentExample, load_jsonl, load_split

MIN_TRAIN = {"total": 60, "zh": 42, "en": 16}
MIN_DEV = {"total": 22, "zh": 15, "en": 6}
NEAR_DUP_JACCARD = 0.8
CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
# Seed examples quoted in shared/INTENTS.md: they belong to dev only.
SEEDS = (
    "我想买一只稳健型基金，年化收益5%左右",
    "最近黄金涨得不错，现在入场合适吗？",
    "帮我订明天上午九点的会议室",
)


def _norm(text: str) -> str:
    """Lower-case, drop punctuation, symbols and whitespace."""
    return "".join(c for c in text.lower() if not (c.isspace() or unicodedata.category(c)[0] in ("P", "S", "Z")))


def _bigrams(text: str) -> frozenset[str]:
    n = _norm(text)
    return frozenset(n[i : i + 2] for i in range(len(n) - 1)) or frozenset({n})


@pytest.fixture(scope="module")
def train() -> list[IntentExample]:
    return load_split("train")


@pytest.fixture(scope="module")
def dev() -> list[IntentExample]:
    return load_split("dev")


def test_label_table() -> None:
    assert len(LABELS) == 24
    assert len(set(LABELS)) == 24
    assert set(BUSINESS_LINE) == set(LABELS)
    assert set(BUSINESS_LINE.values()) == {"bank", "hotline", "office", "all"}


@pytest.mark.parametrize(("split", "minimum"), [("train", MIN_TRAIN), ("dev", MIN_DEV)])
def test_every_label_meets_minimums(split: str, minimum: dict[str, int]) -> None:
    rows = load_split(split)  # type: ignore[arg-type]
    by_label = Counter(r.intent for r in rows)
    by_label_lang = Counter((r.intent, r.lang) for r in rows)
    assert set(by_label) == set(LABELS)
    short = [
        f"{label}: total={by_label[label]} zh={by_label_lang[label, 'zh']} en={by_label_lang[label, 'en']}"
        for label in LABELS
        if by_label[label] < minimum["total"]
        or by_label_lang[label, "zh"] < minimum["zh"]
        or by_label_lang[label, "en"] < minimum["en"]
    ]
    assert not short, f"{split}: below {minimum}: {short}"


@pytest.mark.parametrize("split", ["train", "dev"])
def test_no_duplicates_within_split(split: str) -> None:
    rows = load_split(split)  # type: ignore[arg-type]
    exact = [t for t, n in Counter(r.text for r in rows).items() if n > 1]
    assert not exact, f"{split}: exact duplicates {exact}"
    normed = [t for t, n in Counter(_norm(r.text) for r in rows).items() if n > 1]
    assert not normed, f"{split}: duplicates after normalization {normed}"


def test_no_leakage_between_train_and_dev(train: list[IntentExample], dev: list[IntentExample]) -> None:
    train_norm = {_norm(r.text): r.text for r in train}
    shared = [(r.text, train_norm[_norm(r.text)]) for r in dev if _norm(r.text) in train_norm]
    assert not shared, f"texts in both splits (after normalization): {shared}"

    train_grams = [(r.text, _bigrams(r.text)) for r in train]
    near = []
    for d in dev:
        dg = _bigrams(d.text)
        for t, tg in train_grams:
            inter = len(dg & tg)
            if inter and inter / len(dg | tg) >= NEAR_DUP_JACCARD:
                near.append((d.text, t, round(inter / len(dg | tg), 2)))
    assert not near, f"near-duplicates across splits (bigram Jaccard >= {NEAR_DUP_JACCARD}): {near}"


@pytest.mark.parametrize("split", ["train", "dev"])
def test_lang_matches_script(split: str) -> None:
    rows = load_split(split)  # type: ignore[arg-type]
    wrong = [(r.text, r.lang) for r in rows if (r.lang == "zh") != bool(CJK.search(r.text))]
    assert not wrong, f"{split}: lang does not match the script: {wrong}"


def test_seed_examples_only_in_dev(train: list[IntentExample], dev: list[IntentExample]) -> None:
    train_norm = {_norm(r.text) for r in train}
    dev_norm = {_norm(r.text) for r in dev}
    for seed in SEEDS:
        assert _norm(seed) not in train_norm
        assert _norm(seed) in dev_norm


@pytest.mark.parametrize("split", ["train", "dev"])
def test_packaged_files_are_utf8_not_escaped(split: str) -> None:
    raw = resources.files("miaohui.zoo").joinpath("data", f"intents_{split}.jsonl").read_text("utf-8")
    assert "\\u" not in raw
    for line in raw.splitlines():
        assert set(json.loads(line)) == {"text", "intent", "lang"}


def test_load_split_rejects_unknown_split() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        load_split("bogus")  # type: ignore[arg-type]


def _write(tmp_path, lines: list[str]):
    p = tmp_path / "intents.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


GOOD = json.dumps({"text": "查余额", "intent": "account_balance", "lang": "zh"}, ensure_ascii=False)


def test_load_jsonl_reads_a_valid_file(tmp_path) -> None:
    en = json.dumps({"text": "check my balance", "intent": "account_balance", "lang": "en"})
    rows = load_jsonl(_write(tmp_path, [GOOD, "", en]))
    assert [r.text for r in rows] == ["查余额", "check my balance"]
    assert all(r.intent == "account_balance" for r in rows)


@pytest.mark.parametrize(
    ("bad_line", "needle"),
    [
        ('{"text": "转人工", "intent": "human_agent", "lang": "zh"', "not valid JSON"),
        ('{"text": "转人工", "lang": "zh"}', "'intent'"),
        ('{"text": "转人工", "intent": "talk_to_human", "lang": "zh"}', "'talk_to_human'"),
        ('{"text": "转人工", "intent": "human_agent", "lang": "cn"}', "'cn'"),
        ('["转人工", "human_agent", "zh"]', "JSON object"),
        ('{"text": "", "intent": "human_agent", "lang": "zh"}', "'text'"),
    ],
)
def test_load_jsonl_errors_name_file_line_and_value(tmp_path, bad_line: str, needle: str) -> None:
    path = _write(tmp_path, [GOOD, GOOD.replace("查余额", "余额"), bad_line])
    with pytest.raises(ConfigError) as info:
        load_jsonl(path)
    err = info.value
    assert f"{path}:3" in err.message
    assert needle in err.message
    assert err.fix


def test_load_jsonl_unknown_label_fix_lists_labels(tmp_path) -> None:
    path = _write(tmp_path, ['{"text": "hi", "intent": "hello", "lang": "en"}'])
    with pytest.raises(ConfigError) as info:
        load_jsonl(path)
    assert f"{path}:1" in info.value.message
    assert "'hello'" in info.value.message
    assert info.value.fix is not None and "greeting" in info.value.fix


def test_load_jsonl_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl")
