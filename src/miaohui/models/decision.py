"""How an intent model's logits become an answer: temperature scaling (a calibrated confidence) and an out-of-scope
threshold, both fitted on dev data by ``train-intent`` and stored in the checkpoint (``ModelMeta.decision``), copied
into every engine built from it (``manifest.extra["decision"]``) and applied where the server answers.

Pure numpy: the server imports it without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

ECE_BINS = 15
"""Equal-width confidence bins of the expected calibration error (the usual 15 of Guo et al., 2017)."""
DEFAULT_OOS_LABEL = "out_of_scope"
OosScore = Literal["max_softmax", "energy"]
"""What the out-of-scope threshold is applied to (higher = more in-domain): the calibrated top probability, or the
energy score ``T·logsumexp(z/T)`` of the logits ``z`` (Liu et al., 2020), which keeps the logits' magnitude that the
softmax throws away: an off-topic text with small logits everywhere scores low even when one of them stands out."""


class IntentDecision(BaseModel):
    """Temperature and out-of-scope threshold of an intent model, with the dev figures they were fitted on."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, gt=0)
    """Logits are divided by it before the softmax; fitted on dev (minimum negative log-likelihood), so a
    confidence of 0.9 is right about 90 % of the time."""
    threshold: float | None = None
    """A :attr:`score` below it answers :attr:`oos_label` (the best label is kept as the candidate); None: never out
    of scope."""
    score: OosScore = "max_softmax"
    """What :attr:`threshold` applies to (:data:`OosScore`). ``max_softmax`` here, since artifacts written before
    the field existed hold a confidence threshold; ``train-intent`` chooses it (``TrainConfig.oos_score``)."""
    oos_label: str = DEFAULT_OOS_LABEL
    """The answer when the top confidence is below :attr:`threshold`."""
    target_recall: float | None = None
    """The in-domain recall on dev the threshold was chosen for (share of in-domain dev texts kept)."""
    dev_recall: float | None = None
    """The share of in-domain dev texts the threshold keeps."""
    dev_oos_rejected: float | None = None
    """The share of the dev negatives (``--oos-data``) the threshold rejects; None without negatives."""
    ece_before: float | None = None
    """Expected calibration error on dev with temperature 1."""
    ece_after: float | None = None
    """Expected calibration error on dev with :attr:`temperature`."""

    @model_validator(mode="after")
    def _confidence_threshold_in_range(self) -> IntentDecision:
        if self.score == "max_softmax" and self.threshold is not None and not 0 <= self.threshold <= 1:
            raise ValueError(f"a max_softmax threshold is a probability, got {self.threshold}")
        return self


@dataclass(frozen=True)
class Decided:
    """One text's answer: ``intent`` is the best label or the out-of-scope label; ``candidate`` the best label."""

    intent: str
    confidence: float
    candidate: str
    out_of_scope: bool
    score: float = 0.0
    """The value compared with the threshold (:attr:`IntentDecision.score`; the confidence for ``max_softmax``)."""


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64) / temperature
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


def oos_scores(logits: np.ndarray, temperature: float, kind: OosScore) -> np.ndarray:
    """Each row's out-of-scope score (:data:`OosScore`; higher = more in-domain)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    if kind == "energy":
        top = z.max(-1)
        out: np.ndarray = temperature * (top + np.log(np.exp(z - top[:, None]).sum(-1)))
        return out
    return softmax(logits, temperature).max(-1)


def nll(logits: np.ndarray, targets: np.ndarray, temperature: float) -> float:
    p = softmax(logits, temperature)[np.arange(len(targets)), targets]
    return float(-np.log(np.clip(p, 1e-12, 1.0)).mean())


def fit_temperature(logits: np.ndarray, targets: np.ndarray) -> float:
    """The temperature in [0.05, 20] of least negative log-likelihood on (logits, targets): a log-spaced grid,
    then a finer one around its best point (one parameter: a grid is exact enough and cannot diverge)."""
    if len(targets) == 0:
        return 1.0
    grid = np.exp(np.linspace(np.log(0.05), np.log(20.0), 121))
    best = min(grid, key=lambda t: nll(logits, targets, float(t)))
    fine = best * np.exp(np.linspace(-0.06, 0.06, 25))
    return round(float(min(fine, key=lambda t: nll(logits, targets, float(t)))), 4)


def expected_calibration_error(probs: np.ndarray, targets: np.ndarray, bins: int = ECE_BINS) -> float:
    """Σ over equal-width bins of the top confidence: (share of texts in the bin) × |accuracy − mean confidence|."""
    if len(targets) == 0:
        return 0.0
    conf = probs.max(-1)
    hit = (probs.argmax(-1) == targets).astype(np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(conf, edges[1:-1], right=True), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.mean() * abs(hit[sel].mean() - conf[sel].mean())
    return float(total)


def choose_threshold(in_domain: np.ndarray, target_recall: float) -> float:
    """The highest threshold that keeps at least ``target_recall`` of the in-domain confidences (the
    confidences below it are rejected): any higher one would reject more in-domain texts than allowed."""
    conf = np.sort(np.asarray(in_domain, dtype=np.float64))
    if len(conf) == 0:
        return 0.0
    allowed = int(np.floor((1.0 - target_recall) * len(conf) + 1e-9))  # in-domain texts that may be rejected
    return float(conf[min(allowed, len(conf) - 1)])


def decide(logits: np.ndarray, labels: Sequence[str], decision: IntentDecision | None) -> list[Decided]:
    """The answer for each row of ``logits``: its best label and calibrated confidence, or the out-of-scope label
    (with that best label as the candidate) when the confidence is below the threshold."""
    d = decision or IntentDecision()
    probs = softmax(logits, d.temperature)
    best = probs.argmax(-1)
    scores = probs.max(-1) if d.score == "max_softmax" else oos_scores(logits, d.temperature, d.score)
    out = []
    for i, b in enumerate(best.tolist()):
        conf, score = float(probs[i, b]), float(scores[i])
        label = labels[b]
        oos = label == d.oos_label or (d.threshold is not None and score < d.threshold)
        intent = d.oos_label if oos else label
        out.append(Decided(intent=intent, confidence=conf, candidate=label, out_of_scope=oos, score=score))
    return out


def fit_decision(
    logits: np.ndarray,
    targets: np.ndarray,
    target_recall: float,
    oos_label: str = DEFAULT_OOS_LABEL,
    oos_class: int | None = None,
    negatives: np.ndarray | None = None,
    score: OosScore = "max_softmax",
    midpoint: bool = False,
) -> IntentDecision:
    """Fit on dev: the temperature (all dev texts), then the threshold that keeps ``target_recall`` of the in-domain
    dev texts (those not labelled ``oos_class``, the data's own out-of-scope label if it has one); ``negatives``:
    logits of off-topic dev texts, to report the share the threshold rejects; ``score``: what the threshold applies
    to (:data:`OosScore`); ``midpoint``: with negatives, the threshold is lowered to halfway between the lowest
    in-domain dev score and the highest negative one where that is lower (a few dozen dev texts are picked by the
    same dev set that chose the checkpoint, so their scores run higher than unseen in-domain text's: a threshold at
    their 97 % point rejects more of it than 3 %, while the negatives show how much room there is below)."""
    if len(targets) == 0:
        return IntentDecision(oos_label=oos_label)
    temperature = fit_temperature(logits, targets)
    before = expected_calibration_error(softmax(logits), targets)
    probs = softmax(logits, temperature)
    inside = targets != (-1 if oos_class is None else oos_class)
    values = oos_scores(logits, temperature, score)[inside]
    threshold = choose_threshold(values, target_recall)
    rejected = None
    if negatives is not None and len(negatives):
        neg_scores = oos_scores(negatives, temperature, score)
        if midpoint and len(values):
            threshold = min(threshold, (float(values.min()) + float(neg_scores.max())) / 2)
        own = negatives.argmax(-1) == (-1 if oos_class is None else oos_class)
        rejected = float(((neg_scores < threshold) | own).mean())
    kept = float((values >= threshold).mean()) if inside.any() else 1.0
    return IntentDecision(
        temperature=temperature,
        threshold=round(threshold, 6),
        score=score,
        oos_label=oos_label,
        target_recall=target_recall,
        dev_recall=round(kept, 4),
        dev_oos_rejected=None if rejected is None else round(rejected, 4),
        ece_before=round(before, 4),
        ece_after=round(expected_calibration_error(probs, targets), 4),
    )
