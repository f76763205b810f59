"""Per-label figures of an intent engine on labelled text, as the server answers: precision and recall per label,
the out-of-scope rate (the model's threshold applied), calibration error before and after its temperature, and a
confusion matrix (a PNG)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel

from miaohui.models.decision import IntentDecision, decide, expected_calibration_error, softmax


class LabelFigures(BaseModel):
    precision: float
    """Of the texts answered with this label, the share that has it (1 when none was)."""
    recall: float
    """Of the texts that have this label, the share answered with it."""
    n: int
    """Texts of this label in the data."""


class DecisionReport(BaseModel):
    """What ``miaohui validate`` prints beside the gate: figures of the answers the server would give."""

    labels: dict[str, LabelFigures]
    out_of_scope_label: str
    out_of_scope_rate: float
    """Share of the texts answered out of scope (the model's own out-of-scope label, or below its threshold)."""
    threshold: float | None
    temperature: float
    ece_before: float
    """Expected calibration error of the plain softmax on these texts."""
    ece_after: float
    """The same with the model's temperature."""
    confusion: list[list[int]]
    """Rows: the data's labels (``confusion_rows``); columns: the answers (``confusion_columns``)."""
    confusion_rows: list[str]
    confusion_columns: list[str]


def decision_report(
    logits: np.ndarray, gold: list[str], labels: list[str], decision: IntentDecision | None
) -> DecisionReport:
    d = decision or IntentDecision()
    answers = [x.intent for x in decide(logits, labels, d)]
    rows = sorted(set(gold) | (set(labels) - {d.oos_label}))
    columns = [*[x for x in labels if x != d.oos_label], d.oos_label]
    matrix = np.zeros((len(rows), len(columns)), dtype=np.int64)
    r_at, c_at = {x: i for i, x in enumerate(rows)}, {x: i for i, x in enumerate(columns)}
    for g, a in zip(gold, answers, strict=True):
        matrix[r_at[g], c_at[a]] += 1
    figures = {}
    for label in sorted(set(gold) | set(labels)):
        said = sum(a == label for a in answers)
        has = sum(g == label for g in gold)
        hit = sum(a == g == label for a, g in zip(answers, gold, strict=True))
        figures[label] = LabelFigures(
            precision=round(hit / said, 4) if said else 1.0, recall=round(hit / has, 4) if has else 1.0, n=has
        )
    known = [i for i, g in enumerate(gold) if g in labels]
    targets = np.array([labels.index(gold[i]) for i in known], dtype=np.int64)
    return DecisionReport(
        labels=figures,
        out_of_scope_label=d.oos_label,
        out_of_scope_rate=round(float(np.mean([a == d.oos_label for a in answers])) if answers else 0.0, 4),
        threshold=d.threshold,
        temperature=d.temperature,
        ece_before=round(expected_calibration_error(softmax(logits[known]), targets), 4),
        ece_after=round(expected_calibration_error(softmax(logits[known], d.temperature), targets), 4),
        confusion=matrix.tolist(),
        confusion_rows=rows,
        confusion_columns=columns,
    )


def plot_confusion(report: DecisionReport, file: Path, title: str) -> Path:
    """The confusion matrix as a PNG: a cell per (label, answer), darker for more texts, counts written in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = np.array(report.confusion)
    size = 2.5 + 0.45 * max(len(report.confusion_columns), len(report.confusion_rows))
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    ax.imshow(m, cmap="Blues")
    ax.set_xticks(range(len(report.confusion_columns)), report.confusion_columns, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(report.confusion_rows)), report.confusion_rows, fontsize=8)
    for (i, j), v in np.ndenumerate(m):
        if v:
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7, color="white" if v > m.max() / 2 else "black")
    ax.set_xlabel("answer")
    ax.set_ylabel("label in the data")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)
    return file
