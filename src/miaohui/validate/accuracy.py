"""``miaohui validate``: an engine against a reference on labelled text — accuracy, per-label accuracy,
top-1 agreement, logit error — and a gate that fails with the reason."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from miaohui.engines.base import Engine
from miaohui.nlp.normalize import normalize_text
from miaohui.nlp.tokenizer import TextTokenizer
from miaohui.validate.labels import DecisionReport
from miaohui.zoo.intents import LabelledText

Logits = Callable[[dict[str, np.ndarray]], np.ndarray]


class GateConfig(BaseModel):
    max_accuracy_drop: float = Field(default=1.0, ge=0)
    """Largest allowed accuracy drop vs the reference, in percentage points."""
    min_agreement: float = Field(default=0.98, ge=0, le=1)
    """Smallest allowed fraction of inputs where engine and reference pick the same label."""


class ValidationReport(BaseModel):
    engine: str
    reference: str
    data: str
    n: int
    accuracy: float
    reference_accuracy: float
    accuracy_drop_points: float
    per_label: dict[str, float]
    reference_per_label: dict[str, float]
    agreement: float
    max_logit_error: float
    mean_logit_error: float
    gate: GateConfig
    passed: bool
    failures: list[str]
    answers: DecisionReport | None = None
    """Precision and recall per label, out-of-scope rate, calibration and confusion matrix of the engine's answers."""
    confusion_png: str | None = None
    """Where the confusion matrix was drawn."""


def engine_logits(engine: Engine) -> Logits:
    name = engine.output_names[0]
    return lambda feeds: engine.infer(feeds)[name]


def engine_batch(engine: Engine, default: int = 32) -> int:
    """Rows per validation batch: ``default``, or fewer if the engine's shape profile allows fewer."""
    profile = engine.manifest.inputs[0].profile if engine.manifest.inputs else None
    return min(default, profile.max[0]) if profile is not None else default


def run_logits(fn: Logits, tok: TextTokenizer, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """Logits of every text, batched and padded per batch (sorted by length to limit padding)."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out: list[np.ndarray] = [np.empty(0)] * len(texts)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        ids, mask = tok.encode([normalize_text(texts[i]) for i in rows], truncate=True)
        logits = fn({"input_ids": ids, "attention_mask": mask})
        for r, i in enumerate(rows):
            out[i] = logits[r]
    return np.stack(out)


def _per_label(pred: np.ndarray, gold: list[str], labels: list[str]) -> tuple[float, dict[str, float]]:
    hits: dict[str, list[int]] = defaultdict(list)
    for p, g in zip(pred.tolist(), gold, strict=True):
        hits[g].append(int(labels[p] == g))
    total = sum(sum(v) for v in hits.values()) / max(1, len(gold))
    return total, {k: round(sum(v) / len(v), 4) for k, v in sorted(hits.items())}


def compare(
    logits: np.ndarray,
    ref_logits: np.ndarray,
    data: list[LabelledText],
    labels: list[str],
    gate: GateConfig,
    names: tuple[str, str, str],
    ref_labels: list[str] | None = None,
) -> ValidationReport:
    """Engine vs reference. Agreement compares label names, so models with other label sets compare too;
    the logit error is only defined when both have the same labels (else it is reported as inf)."""
    ref_labels = ref_labels or labels
    pred, ref_pred = logits.argmax(-1), ref_logits.argmax(-1)
    gold = [x.intent for x in data]
    acc, per = _per_label(pred, gold, labels)
    ref_acc, ref_per = _per_label(ref_pred, gold, ref_labels)
    agreement = float(np.mean([labels[a] == ref_labels[b] for a, b in zip(pred, ref_pred, strict=True)]))
    same = labels == ref_labels and logits.shape == ref_logits.shape
    err = np.abs(logits - ref_logits) if same else np.full(1, np.inf)
    drop = (ref_acc - acc) * 100
    failures = []
    if drop > gate.max_accuracy_drop:
        failures.append(
            f"accuracy dropped {drop:.2f} points ({ref_acc:.2%} → {acc:.2%}); the gate allows "
            f"{gate.max_accuracy_drop:.2f}"
        )
    if agreement < gate.min_agreement:
        failures.append(
            f"top-1 agreement with the reference is {agreement:.2%}; the gate requires {gate.min_agreement:.0%}"
        )
    return ValidationReport(
        engine=names[0],
        reference=names[1],
        data=names[2],
        n=len(data),
        accuracy=round(acc, 4),
        reference_accuracy=round(ref_acc, 4),
        accuracy_drop_points=round(drop, 3),
        per_label=per,
        reference_per_label=ref_per,
        agreement=round(agreement, 4),
        max_logit_error=float(err.max()),
        mean_logit_error=float(err.mean()),
        gate=gate,
        passed=not failures,
        failures=failures,
    )


def save_golden(path: Path, texts: list[str], logits: np.ndarray) -> None:
    """Reference outputs of an engine version, for drift checks of later versions."""
    np.savez_compressed(path, logits=logits.astype(np.float32), texts=np.array(texts, dtype=object))


def load_golden(path: Path) -> tuple[list[str], np.ndarray]:
    with np.load(path, allow_pickle=True) as data:
        return [str(t) for t in data["texts"]], data["logits"]
