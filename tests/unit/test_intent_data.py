"""The hand-written intent dataset: coverage, balance, no train/dev leakage, and loader errors; users' own
labelled files for ``train-intent --data`` (any labels): parsing, exact errors, the stratified hold-out."""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from miaohui.errors import ConfigError
from miaohui.zoo.intents import (
    BUSINESS_LINE,
    LABELS,
    IntentExample,
    load_jsonl,
    load_split,
    load_train_data,
    load_user_jsonl,
)

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


# ------------------------------------------------------------------------------------------ your own data


def _own(tmp_path, lines: list[str], name: str = "own.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def _rows(table: dict[str, int]) -> list[str]:
    return [
        json.dumps({"text": f"{label} example {i}", "intent": label}) for label, n in table.items() for i in range(n)
    ]


def test_own_data_any_labels_lang_optional_extra_keys_ignored(tmp_path) -> None:
    lines = [
        json.dumps({"text": "my phone has no signal", "intent": "no_signal", "lang": "en", "id": 7}),
        "",
        json.dumps({"text": "话费怎么这么多", "intent": "bill_question"}),
    ]
    rows = load_user_jsonl(_own(tmp_path, lines))
    assert [(r.text, r.intent, r.lang) for r in rows] == [
        ("my phone has no signal", "no_signal", "en"),
        ("话费怎么这么多", "bill_question", None),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "no signal", "intent": "no_signal"', "not valid JSON (Expecting ',' delimiter at column 44)"),
        ('["no signal", "no_signal"]', "expected a JSON object, got list"),
        ('{"intent": "no_signal"}', "missing 'text' in"),
        ('{"text": "no signal"}', "missing 'intent' in"),
        ('{"lang": "en"}', "missing 'text' and 'intent' in"),
        ('{"text": "  ", "intent": "no_signal"}', "empty 'text' ('  ')"),
        ('{"text": "no signal", "intent": 3}', "'intent' must be a non-empty string, got 3"),
        ('{"text": "no signal", "intent": "no_signal", "lang": ""}', "'lang' must be a language code"),
    ],
)
def test_own_data_malformed_line_names_file_line_and_what(tmp_path, line: str, message: str) -> None:
    good = json.dumps({"text": "bill too high", "intent": "bill_question"})
    path = _own(tmp_path, [good, "", line])
    with pytest.raises(ConfigError) as info:
        load_user_jsonl(path)
    assert info.value.message.startswith(f"{path}:3: {message}")
    assert info.value.fix


def test_own_data_exact_messages(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        load_train_data(tmp_path / "missing.jsonl")
    assert info.value.message == f"intent data file not found: {tmp_path / 'missing.jsonl'}"

    empty = _own(tmp_path, ["", "   "], "empty.jsonl")
    with pytest.raises(ConfigError) as info:
        load_train_data(empty)
    assert info.value.message == f"{empty} is empty: no examples"

    few = _own(tmp_path, _rows({"no_signal": 5, "bill_question": 1, "roaming": 0, "sim_swap": 1}), "few.jsonl")
    with pytest.raises(ConfigError) as info:
        load_train_data(few)
    assert info.value.message == f"{few}: label(s) with fewer than 2 examples: 'bill_question' (1), 'sim_swap' (1)"

    one = _own(tmp_path, _rows({"no_signal": 6}), "one.jsonl")
    with pytest.raises(ConfigError) as info:
        load_train_data(one)
    assert (
        info.value.message == f"{one}: all 6 examples have the label 'no_signal'; a classifier needs 2 labels or more"
    )

    train = _own(tmp_path, _rows({"no_signal": 4, "bill_question": 4}), "train.jsonl")
    dev = _own(tmp_path, _rows({"no_signal": 1, "roaming": 1, "sim_swap": 1}), "dev.jsonl")
    with pytest.raises(ConfigError) as info:
        load_train_data(train, dev)
    assert info.value.message == f"{dev}: label(s) ['roaming', 'sim_swap'] are not in the training file {train}"

    with pytest.raises(ConfigError) as info:
        load_train_data(None, dev)
    assert info.value.message == "--dev was given without --data"


def test_stratified_hold_out_keeps_every_label_on_both_sides(tmp_path) -> None:
    path = _own(tmp_path, _rows({"a": 2, "b": 3, "c": 10, "d": 12}))
    data = load_train_data(path, seed=0)
    assert data.labels == ("a", "b", "c", "d")
    held = Counter(r.intent for r in data.dev)
    kept = Counter(r.intent for r in data.train)
    assert held == {"a": 1, "b": 1, "c": 2, "d": 2}  # round(20 %), at least 1, at most n - 1
    assert kept == {"a": 1, "b": 2, "c": 8, "d": 10}
    assert not {r.text for r in data.dev} & {r.text for r in data.train}
    assert data.dev_source == f"held out 20% of each label of {path} (seed 0)"
    again = load_train_data(path, seed=0)
    assert again.dev == data.dev  # a fixed seed: the same split every run
    assert load_train_data(path, seed=1).dev != data.dev


def test_project_data_is_the_default() -> None:
    data = load_train_data(None)
    assert data.labels == LABELS and data.source == "project"
    assert [r.text for r in data.train] == [r.text for r in load_split("train")]
    assert [r.text for r in data.dev] == [r.text for r in load_split("dev")]


def test_load_texts_takes_any_labels_and_txt(tmp_path: Path) -> None:
    """Calibration and comparison text: JSONL with a text field (labels of any set, or none), or a .txt file."""
    from miaohui.zoo.intents import load_texts

    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text('{"text": "renew my book", "intent": "renewal"}\n\n{"text": "hello"}\n', encoding="utf-8")
    assert load_texts(jsonl) == ["renew my book", "hello"]
    txt = tmp_path / "calib.txt"
    txt.write_text("first\n\n second \n", encoding="utf-8")
    assert load_texts(txt) == ["first", "second"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"intent": "x"}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_texts(bad)
    assert info.value.message == f"{bad}:1: no non-empty 'text' in " + repr('{"intent": "x"}')
