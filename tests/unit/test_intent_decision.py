"""Temperature scaling, calibration error, the out-of-scope threshold and the answer they make (numpy only); the
trainer's class-balanced epochs; the validate figures (precision, recall, confusion)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from miaohui.models.decision import (
    IntentDecision,
    choose_threshold,
    decide,
    expected_calibration_error,
    fit_decision,
    fit_temperature,
    oos_scores,
    softmax,
)
from miaohui.models.train import balanced_epoch, epoch_plan
from miaohui.validate.labels import decision_report


def _overconfident(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Logits 4× too sharp: the true class has logit margin m/4 of a calibrated model, scaled by 4."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, 3, n)
    calibrated = rng.normal(0, 1, (n, 3))
    calibrated[np.arange(n), targets] += 1.0
    return calibrated * 4.0, targets


def test_temperature_undoes_overconfidence_and_lowers_the_calibration_error() -> None:
    logits, targets = _overconfident()
    t = fit_temperature(logits, targets)
    assert 3.0 < t < 5.5
    before = expected_calibration_error(softmax(logits), targets)
    after = expected_calibration_error(softmax(logits, t), targets)
    assert after < before / 2


def test_calibration_error_of_a_perfectly_calibrated_bin() -> None:
    probs = np.array([[0.75, 0.25]] * 4)
    assert expected_calibration_error(probs, np.array([0, 0, 0, 1])) == pytest.approx(0.0)
    assert expected_calibration_error(probs, np.array([1, 1, 1, 1])) == pytest.approx(0.75)


def test_threshold_keeps_the_target_share_of_in_domain_texts() -> None:
    conf = np.linspace(0.3, 0.99, 100)
    t = choose_threshold(conf, 0.97)
    assert (conf >= t).sum() == 97
    assert choose_threshold(conf, 1.0) == pytest.approx(0.3)


def test_decide_answers_out_of_scope_below_the_threshold_with_the_candidate() -> None:
    logits = np.array([[4.0, 0.0, 0.0], [0.2, 0.0, 0.1]])
    d = IntentDecision(temperature=1.0, threshold=0.5, oos_label="handoff")
    first, second = decide(logits, ["a", "b", "c"], d)
    assert (first.intent, first.candidate, first.out_of_scope) == ("a", "a", False)
    assert (second.intent, second.candidate, second.out_of_scope) == ("handoff", "a", True)
    assert second.confidence == pytest.approx(float(softmax(logits)[1, 0]))
    own = decide(np.array([[0.0, 5.0]]), ["card_loss", "out_of_scope"], IntentDecision())[0]
    assert own.out_of_scope and own.intent == "out_of_scope"  # the data's own out-of-scope label


def test_fit_decision_reports_its_dev_figures() -> None:
    logits, targets = _overconfident()
    negatives = np.zeros((10, 3))  # flat: confidence 1/3, below any threshold a sharp model gets
    d = fit_decision(logits, targets, 0.9, negatives=negatives)
    assert d.dev_recall is not None and d.dev_recall >= 0.9
    assert d.dev_oos_rejected == 1.0
    assert d.ece_after is not None and d.ece_before is not None and d.ece_after < d.ece_before


def test_an_energy_threshold_rejects_small_logits_that_a_confidence_threshold_keeps() -> None:
    """A text with one logit standing out of small ones (off-topic, flattened by outlier exposure) has a top
    confidence as high as an in-domain text's, but a far lower energy ``T·logsumexp(z/T)``."""
    logits = np.array([[8.0, 0.0, 0.0], [2.0, -7.0, -7.0]])
    conf = softmax(logits).max(-1)
    assert conf[1] > conf[0]  # the confidence ranks the off-topic row higher
    energy = oos_scores(logits, 1.0, "energy")
    assert energy == pytest.approx(np.log(np.exp(logits).sum(-1)))
    kept, rejected = decide(logits, ["a", "b", "c"], IntentDecision(threshold=5.0, score="energy"))
    assert not kept.out_of_scope and kept.score == pytest.approx(energy[0])
    assert rejected.out_of_scope and rejected.candidate == "a" and rejected.confidence == pytest.approx(conf[1])
    by_confidence = decide(logits, ["a", "b", "c"], IntentDecision(threshold=0.9995))
    assert [d.out_of_scope for d in by_confidence] == [True, False]


def test_fit_decision_with_the_energy_score_keeps_the_target_share() -> None:
    logits, targets = _overconfident()
    d = fit_decision(logits, targets, 0.9, negatives=np.zeros((10, 3)) - 5.0, score="energy")
    assert d.score == "energy" and d.threshold is not None and d.threshold > 1  # not a probability
    values = oos_scores(logits, d.temperature, "energy")
    assert d.dev_recall is not None and d.dev_recall >= 0.9
    assert d.dev_recall == pytest.approx(float((values >= d.threshold).mean()), abs=1e-4)
    assert d.dev_oos_rejected == 1.0


def test_the_midpoint_lowers_the_threshold_towards_well_separated_negatives() -> None:
    logits, targets = _overconfident()
    negatives = np.zeros((10, 3)) - 5.0  # energy about -3.9, far below any in-domain text's
    plain = fit_decision(logits, targets, 0.9, negatives=negatives, score="energy")
    mid = fit_decision(logits, targets, 0.9, negatives=negatives, score="energy", midpoint=True)
    values = oos_scores(logits, mid.temperature, "energy")
    neg = oos_scores(negatives, mid.temperature, "energy")
    assert mid.threshold == pytest.approx((values.min() + neg.max()) / 2, abs=1e-5)
    assert plain.threshold is not None and mid.threshold < plain.threshold
    assert mid.dev_recall == 1.0 and mid.dev_oos_rejected == 1.0
    overlapping = fit_decision(logits, targets, 0.9, negatives=logits[:5], score="energy", midpoint=True)
    assert overlapping.threshold == plain.threshold  # never above the recall target's threshold
    assert fit_decision(logits, targets, 0.9, score="energy", midpoint=True).threshold == plain.threshold


def test_a_decision_without_a_score_is_a_confidence_threshold() -> None:
    """Artifacts written before the score existed hold a confidence threshold (a probability)."""
    old = IntentDecision.model_validate({"temperature": 0.65, "threshold": 0.62})
    assert old.score == "max_softmax"
    with pytest.raises(ValueError, match="probability"):
        IntentDecision(threshold=3.0)
    assert IntentDecision(threshold=-3.0, score="energy").threshold == -3.0


def test_balanced_epochs_repeat_small_labels_up_to_the_largest() -> None:
    targets = [0] * 10 + [1] * 3 + [-1] * 8
    sizes = epoch_plan(targets, 2, balanced=True, n_negative=8)
    assert sizes == [10, 10, 6]
    groups = [[i for i, t in enumerate(targets) if t == k] for k in (0, 1, -1)]
    rows = balanced_epoch(groups, sizes, random.Random(0))
    assert sorted(rows[:10]) == list(range(10))
    small = rows[10:20]
    assert set(small) == {10, 11, 12} and all(small.count(i) >= 3 for i in (10, 11, 12))
    assert len(rows[20:]) == 6 and len(set(rows[20:])) == 6
    assert epoch_plan(targets, 2, balanced=False, n_negative=8) == [10, 3, 8]


def test_validate_figures_precision_recall_and_confusion() -> None:
    logits = np.array([[5.0, 0.0], [5.0, 0.0], [0.0, 5.0], [0.1, 0.0]])
    d = IntentDecision(threshold=0.6)
    report = decision_report(logits, ["a", "b", "b", "a"], ["a", "b"], d)
    assert report.labels["a"].precision == 0.5 and report.labels["a"].recall == 0.5
    assert report.labels["b"].precision == 1.0 and report.labels["b"].recall == 0.5
    assert report.out_of_scope_rate == 0.25
    assert report.confusion_columns == ["a", "b", "out_of_scope"]
    assert report.confusion == [[1, 0, 1], [1, 1, 0]]


def test_the_score_is_energy_with_negatives_and_the_confidence_without() -> None:
    """``oos_score: auto`` (the default): energy where ``--oos-data`` taught negatives, the top confidence where
    none were given (the project's model); an explicit choice is kept."""
    from miaohui.models.train import TrainConfig

    assert TrainConfig().resolved_oos_score(negatives=True) == "energy"
    assert TrainConfig().resolved_oos_score(negatives=False) == "max_softmax"
    assert TrainConfig(oos_score="energy").resolved_oos_score(negatives=False) == "energy"
