"""``miaohui compare OLD NEW``: the same inputs through two engine versions, and how far they drift apart.

OLD and NEW are artifact directories or repository names ``name[:version]`` of intent classifiers:

* **intents** — the texts of ``--data`` (the dev split by default) through both engines: intent agreement,
  and logit error when both have the same labels
  (:func:`~miaohui.validate.consistency.compare_outputs`).
* **pipelines** — the dialogues of the pipeline gate test set (``miaohui/dialogue/data/pipeline_gate.jsonl``)
  through each pipeline twice on a fixed clock, once with each engine as the classifier: agreement of the
  intents answered, of the reply texts (exact and character similarity), and — for pipelines with
  ``keyword_categories`` (the negotiation coach: 拒绝/接受/折中/探询) — keyword-distribution drift.

OLD and NEW may instead be two causal-LM versions (``name[:version]`` of the repository or version folders, built
by ``miaohui build-llm`` for ONNX Runtime, inductor or llama.cpp): then the negotiation coach's system prompt with
each user turn (the gate set's negotiation turns, or the texts of ``--data``) goes through both with greedy decoding,
each side on its own backend and with its own tokenizer and chat template (the comparator's decoder runners,
:mod:`miaohui.validate.comparator`), and the generated texts are compared (agreement, similarity, keyword drift).

The thresholds (:class:`~miaohui.validate.consistency.DriftThresholds`: intent disagreement and keyword
drift above ``max_drift``, default 5%; optional logit error and text similarity bounds) apply to every
section; :meth:`CompareReport.raise_for_failures` names each crossed one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel, Field

from miaohui.dialogue.config import PIPELINE_NAMES, load_pipeline_config
from miaohui.dialogue.gate import GATE_NOW, GateDialogue, load_gate_dialogues
from miaohui.dialogue.pipeline import ChatMessage, IntentClassifier, Pipeline
from miaohui.engines.store import resolve_artifact
from miaohui.errors import ConfigError, ValidationGateError
from miaohui.models.decision import IntentDecision, oos_scores
from miaohui.validate.comparator import (
    PIPELINE_OOS,
    ArtifactClassifier,
    EncoderRunner,
    decoder_outputs,
    intent_outputs,
    open_decoder,
)
from miaohui.validate.consistency import DriftReport, DriftThresholds, EngineOutputs, compare_outputs
from miaohui.validate.decoder_gate import resolve_causal_lm

__all__ = ["CompareReport", "Section", "compare_decoders", "compare_engines", "compare_intents", "load_texts"]


class Section(BaseModel):
    """One comparison: what was compared, on how many inputs, and the figures."""

    name: str
    """``intents``, ``pipeline <name>`` or ``generation <pipeline>``."""
    inputs: str
    """What went through both engines."""
    report: DriftReport


class CompareReport(BaseModel):
    old: str
    new: str
    sections: list[Section] = Field(default_factory=list)
    thresholds: DriftThresholds = DriftThresholds()

    @property
    def passed(self) -> bool:
        return all(s.report.passed for s in self.sections)

    def failures(self) -> list[str]:
        return [f"{s.name}: {f}" for s in self.sections for f in s.report.failures]

    def raise_for_failures(self) -> None:
        """Raise :class:`ValidationGateError` naming every crossed threshold of every section."""
        if not self.passed:
            raise ValidationGateError(
                f"{self.new} drifts from {self.old}: " + "; ".join(self.failures()),
                "inspect the new engine (precision, calibration, training data); if the change is intended, "
                "raise the threshold explicitly (--max-drift)",
            )


# ---------------------------------------------------------------------------------------------- inputs


def load_texts(data: str) -> list[str]:
    """``dev`` / ``train`` (the packaged splits), a JSONL file with a ``text`` field, or a ``.txt`` file."""
    from miaohui.zoo.intents import load_split
    from miaohui.zoo.intents import load_texts as read_texts

    if data in ("dev", "train") and not Path(data).exists():
        return [x.text for x in load_split(data)]  # type: ignore[arg-type]
    return read_texts(Path(data))


# ---------------------------------------------------------------------------------------------- intents


def _decision(runner: object) -> IntentDecision | None:
    found = getattr(runner, "decision", None)
    return found if isinstance(found, IntentDecision) else None


def compare_intents(
    old: EncoderRunner, new: EncoderRunner, texts: list[str], thresholds: DriftThresholds
) -> DriftReport:
    """Intent agreement (by label name) and, when both have the same labels, logit error and the largest
    difference of the scores the out-of-scope threshold applies to (the calibrated top confidence or the energy,
    each engine with its own temperature)."""
    a, b = intent_outputs([old, new], texts)
    report = compare_outputs(a, b, thresholds, categories={})
    if a.logits is not None and b.logits is not None and a.logits:
        pa = _scores(np.array(a.logits), _decision(old))
        pb = _scores(np.array(b.logits), _decision(new))
        report.confidence_max_abs_error = round(float(np.abs(pa - pb).max()), 6)
    return report


def _scores(logits: np.ndarray, decision: IntentDecision | None) -> np.ndarray:
    d = decision or IntentDecision()
    return oos_scores(logits, d.temperature, d.score)


def _with_scores(turns: list[_Turn], inputs: list[str], runner: object, decision: IntentDecision | None) -> list[_Turn]:
    """``turns`` (the replies to ``inputs``) with the confidence replaced by the score the threshold applies to,
    where that is not the confidence (an energy threshold): from the runner's logits of the inputs."""
    logits = getattr(runner, "logits", None)
    if decision is None or decision.score == "max_softmax" or logits is None or not turns:
        return turns
    scores = _scores(np.asarray(logits(inputs)), decision)
    return [t._replace(confidence=float(s)) for t, s in zip(turns, scores, strict=True)]


class _Turn(NamedTuple):
    intent: str
    text: str
    confidence: float
    best: str
    """The classifier's best label (the candidate when it answered out of scope)."""


async def _pipeline_replies(name: str, dialogues: Sequence[GateDialogue], classifier: IntentClassifier) -> list[_Turn]:
    pipe = Pipeline.from_name(name, classifier, clock=lambda: GATE_NOW)
    out: list[_Turn] = []
    for d in dialogues:
        for turn in d.turns:
            r = await pipe.run_turn(turn.text, f"compare-{d.id}")
            out.append(_Turn(r.intent, r.text, r.confidence, r.candidate or r.classified_intent))
    return out


def threshold_ties(
    texts: Sequence[str],
    old: Sequence[_Turn],
    new: Sequence[_Turn],
    threshold: float | None,
    margin: float | None,
) -> dict[int, str]:
    """Turns whose answers differ only by the out-of-scope decision (the same best label, rejected by one engine
    and kept by the other) with both confidences within ``margin`` (the engines' largest confidence difference
    measured on the intents section) of ``threshold``: which side of the threshold such a turn lands on is within
    the engines' measured numeric difference, so it is a tie, reported and not counted as drift."""
    if threshold is None or margin is None:
        return {}
    ties = {}
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        one_rejected = (a.intent == PIPELINE_OOS) != (b.intent == PIPELINE_OOS)
        near = all(abs(t.confidence - threshold) <= margin for t in (a, b))
        if a.intent != b.intent and a.best == b.best and one_rejected and near:
            ties[i] = (
                f"{texts[i]!r}: {a.intent} at {a.confidence:.3f} vs {b.intent} at {b.confidence:.3f} "
                f"(threshold {threshold:.3f}, engines differ by up to {margin:.3f})"
            )
    return ties


async def compare_pipelines(
    old: IntentClassifier,
    new: IntentClassifier,
    pipelines: Sequence[str],
    thresholds: DriftThresholds,
    dialogues: Sequence[GateDialogue] | None = None,
    confidence_margin: float | None = None,
) -> list[Section]:
    """Each pipeline's gate dialogues with ``old`` and with ``new`` as the classifier. ``confidence_margin``: the
    engines' largest calibrated confidence difference (the intents section); a turn that only crosses the
    out-of-scope threshold within it is a tie (:func:`threshold_ties`)."""
    da, db = _decision(old), _decision(new)
    same = da is not None and db is not None and da.threshold == db.threshold
    threshold = da.threshold if same and da is not None else None
    pool = list(dialogues) if dialogues is not None else load_gate_dialogues()
    sections: list[Section] = []
    for name in pipelines:
        mine = [d for d in pool if d.pipeline == name]
        if not mine:
            continue
        a = await _pipeline_replies(name, mine, old)
        b = await _pipeline_replies(name, mine, new)
        cats = load_pipeline_config(name).keyword_categories
        inputs = [t.text for d in mine for t in d.turns]
        scored_a, scored_b = _with_scores(a, inputs, old, da), _with_scores(b, inputs, new, db)
        report = compare_outputs(
            EngineOutputs(intents=[t.intent for t in a], texts=[t.text for t in a]),
            EngineOutputs(intents=[t.intent for t in b], texts=[t.text for t in b]),
            thresholds,
            cats,
            ties=threshold_ties(inputs, scored_a, scored_b, threshold, confidence_margin),
        )
        turns = sum(len(d.turns) for d in mine)
        sections.append(
            Section(name=f"pipeline {name}", inputs=f"{len(mine)} gate dialogues, {turns} turns", report=report)
        )
    return sections


def compare_engines(
    old_spec: str,
    new_spec: str,
    repository: Path,
    data: str = "dev",
    thresholds: DriftThresholds | None = None,
    pipelines: Sequence[str] | None = PIPELINE_NAMES,
) -> CompareReport:
    """Compare two intent artifacts (or two causal-LM versions, see :func:`compare_decoders`)."""
    t = thresholds or DriftThresholds()
    old_llm, new_llm = resolve_causal_lm(old_spec, repository), resolve_causal_lm(new_spec, repository)
    if old_llm is not None and new_llm is not None:
        user_turns = None if data == "dev" else load_texts(data)
        return compare_decoders(old_llm, new_llm, t, user_turns=user_turns)
    if old_llm is not None or new_llm is not None:
        which = old_spec if old_llm is not None else new_spec
        raise ConfigError(f"{which!r} is a causal LM and the other is not", "compare two causal LMs or two encoders")
    unknown = [p for p in pipelines or () if p not in PIPELINE_NAMES]
    if unknown:
        raise ConfigError(f"unknown pipeline(s) {unknown}", f"use {', '.join(PIPELINE_NAMES)}, 'all' or 'none'")
    old_path, new_path = resolve_artifact(old_spec, repository), resolve_artifact(new_spec, repository)
    texts = load_texts(data)
    with _classifiers(old_path, new_path) as (old, new):
        report = CompareReport(old=old.name, new=new.name, thresholds=t)
        intents = compare_intents(old, new, texts, t)
        report.sections.append(Section(name="intents", inputs=f"{len(texts)} texts of {data}", report=intents))
        if pipelines:
            margin = intents.confidence_max_abs_error
            report.sections += asyncio.run(compare_pipelines(old, new, list(pipelines), t, confidence_margin=margin))
    return report


@contextlib.contextmanager
def _classifiers(old: Path, new: Path) -> Iterator[tuple[ArtifactClassifier, ArtifactClassifier]]:
    with ArtifactClassifier.open(old) as a, ArtifactClassifier.open(new) as b:
        yield a, b


# ---------------------------------------------------------------------------------------------- decoders


def negotiation_prompts(user_turns: Sequence[str] | None = None) -> list[list[ChatMessage]]:
    """The negotiation coach's system prompt (in each turn's language) with each of ``user_turns``, by
    default the negotiation turns of the gate set."""
    from miaohui.dialogue.language import detect_language

    cfg = load_pipeline_config("negotiation_coach")
    if cfg.llm is None:
        raise ConfigError(
            "negotiation_coach has no llm block", "restore miaohui/dialogue/pipelines/negotiation_coach.yaml"
        )
    if user_turns is None:
        skip = ("greeting", "goodbye", "human_agent")
        dialogues = [d for d in load_gate_dialogues() if d.pipeline == "negotiation_coach"]
        user_turns = [t.text for d in dialogues for t in d.turns if t.intent not in skip]
    prompts: list[list[ChatMessage]] = []
    for text in user_turns:
        lang = detect_language(text) or cfg.default_lang
        prompts.append(
            [{"role": "system", "content": cfg.llm.system_prompt.get(lang)}, {"role": "user", "content": text}]
        )
    return prompts


def compare_decoders(
    old: Path,
    new: Path,
    thresholds: DriftThresholds,
    max_tokens: int = 96,
    user_turns: Sequence[str] | None = None,
) -> CompareReport:
    """Greedy replies of two causal-LM versions (each on its own backend, each prompt encoded with its own tokenizer
    and chat template) to the negotiation prompts (:func:`negotiation_prompts`): text agreement and keyword drift.
    Few prompts make a coarse drift figure (6 prompts: one flip is 17%)."""
    prompts = negotiation_prompts(user_turns)
    with open_decoder(old) as a, open_decoder(new) as b:
        old_out, new_out = decoder_outputs([a, b], prompts, max_tokens)
        old_name, new_name = a.name, b.name
    cats = load_pipeline_config("negotiation_coach").keyword_categories
    report = compare_outputs(old_out, new_out, thresholds, cats)
    section = Section(
        name="generation negotiation_coach",
        inputs=f"{len(prompts)} negotiation prompts, greedy, {max_tokens} new tokens",
        report=report,
    )
    return CompareReport(old=old_name, new=new_name, sections=[section], thresholds=thresholds)
