"""The intent taxonomy (shared/INTENTS.md), the project's own hand-written intent dataset, and users' own
labelled files for ``train-intent --data`` (:func:`load_train_data`).

The packaged splits live in ``miaohui/zoo/data/intents_{train,dev}.jsonl``: one JSON object a line,
``{"text": ..., "intent": <label>, "lang": "zh" | "en"}``, UTF-8.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from miaohui.errors import ConfigError

LABELS: tuple[str, ...] = (
    "fund_recommendation",
    "market_outlook",
    "risk_assessment",
    "account_balance",
    "transfer_money",
    "card_loss",
    "loan_inquiry",
    "deposit_rates",
    "product_redemption",
    "complaint",
    "social_insurance",
    "medical_insurance",
    "household_registration",
    "housing_fund",
    "noise_complaint",
    "utilities_outage",
    "traffic_violation",
    "business_license",
    "book_meeting_room",
    "cancel_booking",
    "greeting",
    "goodbye",
    "human_agent",
    "out_of_scope",
)

BUSINESS_LINE: dict[str, str] = {
    "fund_recommendation": "bank",
    "market_outlook": "bank",
    "risk_assessment": "bank",
    "account_balance": "bank",
    "transfer_money": "bank",
    "card_loss": "bank",
    "loan_inquiry": "bank",
    "deposit_rates": "bank",
    "product_redemption": "bank",
    "complaint": "bank",
    "social_insurance": "hotline",
    "medical_insurance": "hotline",
    "household_registration": "hotline",
    "housing_fund": "hotline",
    "noise_complaint": "hotline",
    "utilities_outage": "hotline",
    "traffic_violation": "hotline",
    "business_license": "hotline",
    "book_meeting_room": "office",
    "cancel_booking": "office",
    "greeting": "all",
    "goodbye": "all",
    "human_agent": "all",
    "out_of_scope": "all",
}

LANGS: tuple[str, ...] = ("zh", "en")
_FIELDS = ("text", "intent", "lang")
_LABEL_SET = frozenset(LABELS)


class IntentExample(BaseModel):
    """One labelled utterance."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str
    intent: str
    lang: Literal["zh", "en"]


def _parse_line(raw: str, where: str) -> IntentExample:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}): {raw[:80]!r}",
            'write one JSON object per line, e.g. {"text": "查余额", "intent": "account_balance", "lang": "zh"}',
        ) from exc
    if not isinstance(obj, dict):
        raise ConfigError(
            f"{where}: expected a JSON object, got {type(obj).__name__}: {raw[:80]!r}",
            'write one JSON object per line with the keys "text", "intent" and "lang"',
        )
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise ConfigError(
            f"{where}: missing field(s) {', '.join(repr(m) for m in missing)} in {raw[:80]!r}",
            'every line needs "text", "intent" and "lang"',
        )
    extra = sorted(set(obj) - set(_FIELDS))
    if extra:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(repr(e) for e in extra)}",
            'keep only the keys "text", "intent" and "lang"',
        )
    text, intent, lang = obj["text"], obj["intent"], obj["lang"]
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(
            f"{where}: 'text' must be a non-empty string, got {text!r}",
            "put the utterance as a non-empty string in 'text'",
        )
    if intent not in _LABEL_SET:
        raise ConfigError(
            f"{where}: unknown intent label {intent!r}",
            f"use one of the 24 labels of shared/INTENTS.md: {', '.join(LABELS)}",
        )
    if lang not in LANGS:
        raise ConfigError(
            f"{where}: bad lang {lang!r}",
            "set 'lang' to 'zh' (Chinese) or 'en' (English)",
        )
    return IntentExample(text=text, intent=intent, lang=lang)


def _parse_lines(lines: list[str], source: str) -> list[IntentExample]:
    out: list[IntentExample] = []
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        out.append(_parse_line(raw, f"{source}:{lineno}"))
    return out


def _read_text(path: str | Path, what: str) -> tuple[Path, list[str]]:
    """The lines of a UTF-8 file the user names; a missing or non-UTF-8 file is an error naming it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file not found: {p}", "pass the path of an existing file")
    try:
        return p, p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 (byte {exc.start})", "save the file as UTF-8 text") from exc


def load_jsonl(path: str | Path) -> list[IntentExample]:
    """Read and validate a user's intent file (JSONL, UTF-8); errors name file:line and the bad value."""
    p, lines = _read_text(path, "intent data")
    return _parse_lines(lines, str(p))


def load_split(split: Literal["train", "dev"]) -> list[IntentExample]:
    """The packaged hand-written split ``train`` or ``dev``."""
    if split not in ("train", "dev"):
        raise ConfigError(f"unknown intent split {split!r}", "use split='train' or split='dev'")
    name = f"intents_{split}.jsonl"
    res = resources.files("miaohui.zoo").joinpath("data", name)
    if not res.is_file():
        raise ConfigError(
            f"packaged intent data missing: miaohui/zoo/data/{name}",
            "reinstall miaohui (pip install -e .) so the package data is present",
        )
    content = res.read_text(encoding="utf-8")
    return _parse_lines(content.splitlines(), f"miaohui/zoo/data/{name}")


# ------------------------------------------------------------------------------------------ your own data

DEV_FRACTION = 0.2
"""Share of each label held out for dev when no ``--dev`` file is given: the usual 80/20 split, which on a
dozen examples a label still leaves ~10 to train on and 2-3 to measure with (at least one of each)."""
MIN_PER_LABEL = 2
"""Examples a label needs in a training file: one to train on and one to hold out for dev."""
_USER_FIX = 'write one JSON object a line, e.g. {"text": "my card was stolen", "intent": "card_loss"} ("lang" optional)'


class LabelledText(BaseModel):
    """One utterance of a user's own data set: any label, ``lang`` optional (any code, e.g. ``en``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str
    intent: str
    lang: str | None = None


class TrainData(BaseModel):
    """What ``train-intent`` trains and measures on: the label set (sorted, from the data), train and dev rows."""

    model_config = ConfigDict(frozen=True)

    labels: tuple[str, ...]
    train: list[LabelledText]
    dev: list[LabelledText]
    source: str
    """Where the rows came from: ``project`` (the packaged 24-label splits) or the training file's path."""
    dev_source: str
    """``project``, the ``--dev`` file's path, or ``held out <fraction> of <file> (seed <n>)``."""


def _parse_user_line(raw: str, where: str) -> LabelledText:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}): {raw[:80]!r}", _USER_FIX
        ) from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}: {raw[:80]!r}", _USER_FIX)
    missing = [f for f in ("text", "intent") if f not in obj]
    if missing:
        raise ConfigError(f"{where}: missing {' and '.join(repr(m) for m in missing)} in {raw[:80]!r}", _USER_FIX)
    text, intent, lang = obj["text"], obj["intent"], obj.get("lang")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: empty 'text' ({text!r})", "give every line a non-empty utterance in 'text'")
    if not isinstance(intent, str) or not intent.strip():
        raise ConfigError(f"{where}: 'intent' must be a non-empty string, got {intent!r}", "name the label in 'intent'")
    if lang is not None and (not isinstance(lang, str) or not lang.strip()):
        raise ConfigError(f"{where}: 'lang' must be a language code such as 'en', got {lang!r}", "fix or drop 'lang'")
    return LabelledText(text=text, intent=intent.strip(), lang=lang)


def load_user_jsonl(path: str | Path) -> list[LabelledText]:
    """A user's labelled file (JSONL, UTF-8, ``{"text", "intent", "lang"?}`` a line; other keys are ignored);
    errors name file:line and what is wrong. Blank lines are skipped; a file without examples is an error."""
    p, lines = _read_text(path, "intent data")
    rows = [_parse_user_line(raw, f"{p}:{n}") for n, raw in enumerate(lines, 1) if raw.strip()]
    if not rows:
        raise ConfigError(f"{p} is empty: no examples", _USER_FIX)
    return rows


def check_label_counts(rows: list[LabelledText], where: str) -> tuple[str, ...]:
    """The sorted label set of a training file: at least 2 labels, each with at least :data:`MIN_PER_LABEL` rows."""
    counts = Counter(r.intent for r in rows)
    if len(counts) == 1:
        raise ConfigError(
            f"{where}: all {len(rows)} examples have the label {rows[0].intent!r}; a classifier needs 2 labels or more",
            "add examples of the other intents the model must tell apart",
        )
    few = sorted((label, n) for label, n in counts.items() if n < MIN_PER_LABEL)
    if few:
        listed = ", ".join(f"{label!r} ({n})" for label, n in few)
        raise ConfigError(
            f"{where}: label(s) with fewer than {MIN_PER_LABEL} examples: {listed}",
            f"give every label at least {MIN_PER_LABEL} examples (more is better: ~10+), or drop its lines",
        )
    return tuple(sorted(counts))


def stratified_split(
    rows: list[LabelledText], fraction: float = DEV_FRACTION, seed: int = 0
) -> tuple[list[LabelledText], list[LabelledText]]:
    """(train, dev): from each label ``round(fraction * n)`` rows, at least 1 and at most ``n - 1``, drawn with
    a fixed seed; file order is kept inside each part."""
    rng = random.Random(seed)
    by_label: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_label[row.intent].append(i)
    held: set[int] = set()
    for label in sorted(by_label):
        idx = by_label[label]
        k = min(len(idx) - 1, max(1, round(fraction * len(idx))))
        held.update(rng.sample(idx, k))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def load_train_data(
    data: str | Path | None, dev: str | Path | None = None, seed: int = 0, fraction: float = DEV_FRACTION
) -> TrainData:
    """The project's 24-label splits (``data`` None), or a user's file with its own label set: ``dev`` given →
    its labels must be a subset of the training file's; else a stratified ``fraction`` is held out."""
    if data is None:
        if dev is not None:
            raise ConfigError("--dev was given without --data", "pass --data TRAIN.jsonl with --dev, or neither")
        train = [LabelledText.model_validate(x.model_dump()) for x in load_split("train")]
        held = [LabelledText.model_validate(x.model_dump()) for x in load_split("dev")]
        return TrainData(labels=LABELS, train=train, dev=held, source="project", dev_source="project")
    rows = load_user_jsonl(data)
    labels = check_label_counts(rows, str(data))
    if dev is None:
        train, held = stratified_split(rows, fraction, seed)
        how = f"held out {fraction:.0%} of each label of {data} (seed {seed})"
        return TrainData(labels=labels, train=train, dev=held, source=str(data), dev_source=how)
    held = load_user_jsonl(dev)
    unknown = sorted({r.intent for r in held} - set(labels))
    if unknown:
        raise ConfigError(
            f"{dev}: label(s) {unknown} are not in the training file {data}",
            "add training examples of those labels to --data, or remove them from --dev",
        )
    return TrainData(labels=labels, train=rows, dev=held, source=str(data), dev_source=str(dev))


def load_texts(path: str | Path) -> list[str]:
    """Unlabelled text for calibration and comparisons: a ``.txt`` file (a text a line) or JSONL whose objects have a
    ``"text"`` (any other keys, any labels, are ignored); errors name file:line."""
    p, lines = _read_text(path, "text")
    if p.suffix == ".txt":
        texts = [line.strip() for line in lines if line.strip()]
    else:
        texts = []
        for n, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{p}:{n}: not valid JSON ({exc.msg} at column {exc.colno}): {raw[:80]!r}",
                    'write one JSON object a line with a "text" field, or pass a .txt file (a text a line)',
                ) from exc
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise ConfigError(f"{p}:{n}: no non-empty 'text' in {raw[:80]!r}", 'give every line a "text" string')
            texts.append(text)
    if not texts:
        raise ConfigError(f"{p} is empty: no texts", "write one text a line (.txt) or one JSON object a line")
    return texts
