"""The pipeline compliance gate (``miaohui validate --pipeline``): a candidate engine must not change what
the dialogue pipelines promise.

A test set of dialogues (JSONL, one dialogue a line; the packaged one is
``miaohui/dialogue/data/pipeline_gate.jsonl``)::

    {"id": "bank-01", "pipeline": "bank_advisor",
     "turns": [{"text": "我想买一只稳健型基金，年化收益5%左右", "intent": "fund_recommendation",
                "disclaimer": true, "numbers": ["5%"]}]}

runs twice through fresh pipelines on a fixed clock: once with the reference engines, once with the
candidate intent classifier (and candidate generator, if given). A turn fails the gate when the candidate's
reply

* lacks the risk disclaimer (exactly once) although the turn requires it or the reference reply had it,
* misses a number the turn lists (``numbers``, compared by value: ``"5%"`` is 5, ``"5万"`` is 50000), or
* holds different numbers than the reference reply (any number added, dropped or changed).

The reference run is held to the turn's expectations too; a failure there means the test set or the
reference model is wrong (not the candidate engine), so it is reported as a warning; the candidate
fails only for problems the reference run does not share. Intent accuracy and agreement are reported; they
fail the gate only below ``min_intent_agreement`` when that is set.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timedelta, timezone
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from miaohui.dialogue.compliance import DISCLAIMER
from miaohui.dialogue.config import PIPELINE_NAMES
from miaohui.dialogue.knowledge import KnowledgeBase
from miaohui.dialogue.pipeline import DialogueResponse, IntentClassifier, Pipeline, TextGenerator
from miaohui.errors import ConfigError, ValidationGateError
from miaohui.nlp.numbers import extract_numbers
from miaohui.zoo.intents import LABELS

__all__ = [
    "GATE_NOW",
    "GateDialogue",
    "GateTurn",
    "PipelineGateReport",
    "TurnOutcome",
    "load_gate_dialogues",
    "run_pipeline_gate",
]

#: The gate's fixed local time (a Tuesday morning, UTC+8): relative dates resolve the same in every run.
GATE_NOW = datetime(2026, 3, 3, 10, 0, tzinfo=timezone(timedelta(hours=8)))


class GateTurn(BaseModel):
    """One user turn with what its reply must hold."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str = Field(min_length=1)
    """The user's words."""
    intent: str
    """Expected intent (the one the pipeline answers, after continuing pending actions)."""
    disclaimer: bool = False
    """The reply must carry the risk disclaimer exactly once."""
    numbers: tuple[str | float, ...] = ()
    """Numbers the reply must contain, as text (``"5%"``, ``"5万"``) or values."""

    @field_validator("intent")
    @classmethod
    def _label(cls, v: str) -> str:
        if v not in LABELS:
            raise ConfigError(f"unknown intent label {v!r} in a gate turn", "use a label of shared/INTENTS.md")
        return v

    def number_values(self) -> list[float]:
        out: list[float] = []
        for n in self.numbers:
            out.extend([float(n)] if isinstance(n, int | float) else extract_numbers(n))
        return out


class GateDialogue(BaseModel):
    """One dialogue of the gate's test set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1)
    pipeline: str
    turns: tuple[GateTurn, ...] = Field(min_length=1)

    @field_validator("pipeline")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in PIPELINE_NAMES:
            raise ConfigError(f"unknown pipeline {v!r} in a gate dialogue", f"use one of {PIPELINE_NAMES}")
        return v


class TurnOutcome(BaseModel):
    """A turn's result in both runs (kept for failing turns)."""

    dialogue: str
    turn: int
    text: str
    expected_intent: str
    reference_intent: str
    candidate_intent: str
    reference_reply: str
    candidate_reply: str
    problems: list[str]


class PipelineGateReport(BaseModel):
    """The gate's verdict."""

    dialogues: int
    turns: int
    reference_intent_accuracy: float
    candidate_intent_accuracy: float
    intent_agreement: float
    failures: list[TurnOutcome] = Field(default_factory=list)
    """Turns where the candidate introduced a problem."""
    warnings: list[TurnOutcome] = Field(default_factory=list)
    """Turns where the reference run itself misses the expectations (test set or model issue)."""
    min_intent_agreement: float | None = None

    @property
    def passed(self) -> bool:
        low = self.min_intent_agreement is not None and self.intent_agreement < self.min_intent_agreement
        return not self.failures and not low

    def messages(self) -> list[str]:
        out = [f"{f.dialogue} turn {f.turn} ({f.text!r}): {'; '.join(f.problems)}" for f in self.failures]
        if self.min_intent_agreement is not None and self.intent_agreement < self.min_intent_agreement:
            out.append(f"intent agreement {self.intent_agreement:.1%} is below {self.min_intent_agreement:.1%}")
        return out

    def raise_for_failures(self) -> None:
        """Raise :class:`ValidationGateError` naming every failing turn."""
        if not self.passed:
            msgs = self.messages()
            raise ValidationGateError(
                f"pipeline gate failed on {len(msgs)} check(s) of {self.turns} turns: " + " | ".join(msgs),
                "keep the reference engine for these pipelines, or rebuild the candidate at a higher "
                "precision (fp16/fp32) or with better calibration data",
            )


def load_gate_dialogues(path: str | Path | None = None) -> list[GateDialogue]:
    """The packaged gate test set, or the JSONL file at ``path``."""
    if path is None:
        res = resources.files("miaohui.dialogue").joinpath("data", "pipeline_gate.jsonl")
        text, where = res.read_text(encoding="utf-8"), "miaohui/dialogue/data/pipeline_gate.jsonl"
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"gate test set not found: {p}", "pass the path of a JSONL file of dialogues")
        text, where = p.read_text(encoding="utf-8"), str(p)
    out: list[GateDialogue] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            out.append(GateDialogue.model_validate(json.loads(raw)))
        except (json.JSONDecodeError, ValidationError) as exc:
            raise ConfigError(
                f"{where}:{lineno}: not a gate dialogue ({exc})",
                'write {"id", "pipeline", "turns": [{"text", "intent", "disclaimer", "numbers"}]} per line',
            ) from exc
    ids = [d.id for d in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ConfigError(f"{where}: duplicate dialogue id(s) {dup}", "give every dialogue its own id")
    return out


async def _run(
    dialogues: list[GateDialogue],
    classifier: IntentClassifier,
    generator: TextGenerator | None,
    now: datetime,
    knowledge: KnowledgeBase | None,
) -> list[list[DialogueResponse]]:
    pipelines: dict[str, Pipeline] = {}
    results: list[list[DialogueResponse]] = []
    for d in dialogues:
        if d.pipeline not in pipelines:
            pipelines[d.pipeline] = Pipeline.from_name(
                d.pipeline, classifier, generator, knowledge=knowledge, clock=lambda: now
            )
        pipe = pipelines[d.pipeline]
        results.append([await pipe.run_turn(t.text, f"gate-{d.id}") for t in d.turns])
    return results


def _has_disclaimer(text: str) -> bool:
    return text.count(DISCLAIMER["zh"]) + text.count(DISCLAIMER["en"]) == 1


def _expectation_problems(side: str, turn: GateTurn, reply: str) -> list[str]:
    problems: list[str] = []
    if turn.disclaimer and not _has_disclaimer(reply):
        problems.append(f"{side} reply lacks the required risk disclaimer (exactly once)")
    values = extract_numbers(reply)
    missing = [v for v in turn.number_values() if not any(abs(v - x) <= 1e-9 * max(1.0, abs(v)) for x in values)]
    if missing:
        problems.append(f"{side} reply lost number(s) {', '.join(f'{v:g}' for v in missing)}")
    return problems


def _shown(values: list[float], limit: int = 8) -> str:
    text = ", ".join(f"{v:g}" for v in values[:limit])
    return text + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def _compare(turn: GateTurn, ref: DialogueResponse, cand: DialogueResponse) -> tuple[list[str], list[str]]:
    """(problems the candidate introduced, problems the reference run already has)."""
    warnings = _expectation_problems("reference", turn, ref.text)
    shared = {w.replace("reference", "candidate", 1) for w in warnings}
    problems = [p for p in _expectation_problems("candidate", turn, cand.text) if p not in shared]
    if _has_disclaimer(ref.text) and not _has_disclaimer(cand.text) and not turn.disclaimer:
        problems.append("candidate reply lost the risk disclaimer the reference reply had")
    ref_n, cand_n = Counter(extract_numbers(ref.text)), Counter(extract_numbers(cand.text))
    if ref_n != cand_n:
        lost = _shown(sorted((ref_n - cand_n).elements()))
        added = _shown(sorted((cand_n - ref_n).elements()))
        problems.append(f"candidate altered the reply's numbers (lost: {lost or '-'}; added: {added or '-'})")
    return problems, warnings


async def run_pipeline_gate(
    dialogues: list[GateDialogue],
    reference: IntentClassifier,
    candidate: IntentClassifier,
    *,
    reference_generator: TextGenerator | None = None,
    candidate_generator: TextGenerator | None = None,
    now: datetime = GATE_NOW,
    knowledge: KnowledgeBase | None = None,
    min_intent_agreement: float | None = None,
) -> PipelineGateReport:
    """Run ``dialogues`` with the reference and the candidate engines and compare (module docstring).

    Without ``candidate_generator`` the candidate run uses ``reference_generator``; without either, llm
    routes answer with their templates.
    """
    if not dialogues:
        raise ConfigError("the gate test set is empty", "give at least one dialogue")
    cand_gen = candidate_generator if candidate_generator is not None else reference_generator
    ref_runs = await _run(dialogues, reference, reference_generator, now, knowledge)
    cand_runs = await _run(dialogues, candidate, cand_gen, now, knowledge)
    failures: list[TurnOutcome] = []
    warnings: list[TurnOutcome] = []
    n = ref_ok = cand_ok = agree = 0
    for d, ref_turns, cand_turns in zip(dialogues, ref_runs, cand_runs, strict=True):
        for i, (turn, ref, cand) in enumerate(zip(d.turns, ref_turns, cand_turns, strict=True), start=1):
            n += 1
            ref_ok += ref.intent == turn.intent
            cand_ok += cand.intent == turn.intent
            agree += ref.intent == cand.intent
            problems, notes = _compare(turn, ref, cand)
            for found, into in ((problems, failures), (notes, warnings)):
                if found:
                    into.append(
                        TurnOutcome(
                            dialogue=d.id,
                            turn=i,
                            text=turn.text,
                            expected_intent=turn.intent,
                            reference_intent=ref.intent,
                            candidate_intent=cand.intent,
                            reference_reply=ref.text,
                            candidate_reply=cand.text,
                            problems=found,
                        )
                    )
    return PipelineGateReport(
        dialogues=len(dialogues),
        turns=n,
        reference_intent_accuracy=ref_ok / n,
        candidate_intent_accuracy=cand_ok / n,
        intent_agreement=agree / n,
        failures=failures,
        warnings=warnings,
        min_intent_agreement=min_intent_agreement,
    )
