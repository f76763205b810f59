"""The intent taxonomy (shared/INTENTS.md) and the project's own hand-written intent dataset.

The packaged splits live in ``miaohui/zoo/data/intents_{train,dev}.jsonl``: one JSON object a line,
``{"text": ..., "intent": <label>, "lang": "zh" | "en"}``, UTF-8.
"""

from __future__ import annotations

import json
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


def load_jsonl(path: str | Path) -> list[IntentExample]:
    """Read and validate a user's intent file (JSONL, UTF-8); errors name file:line and the bad value."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"intent data file not found: {p}", "pass the path of an existing JSONL file")
    try:
        content = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{p}: not UTF-8 (byte {exc.start})", "save the file as UTF-8 text, one JSON object a line"
        ) from exc
    return _parse_lines(content.splitlines(), str(p))


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
