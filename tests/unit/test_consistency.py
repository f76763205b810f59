"""Consistency between two engines (drift report, shadow comparator) and the pipeline compliance gate.

Engine outputs are hand-written lists, and ``OracleClassifier`` / ``FakeGenerator`` are fakes standing in
for the reference and candidate engines (the e2e and GPU tests compare real builds).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from miaohui.dialogue.compliance import DISCLAIMER
from miaohui.dialogue.gate import GATE_NOW, load_gate_dialogues, run_pipeline_gate
from miaohui.dialogue.pipeline import ChatMessage, Pipeline
from miaohui.errors import InputError, ValidationGateError
from miaohui.nlp.keywords import NEGOTIATION_CATEGORIES, count_categories, dominant_category
from miaohui.nlp.normalize import normalize_text
from miaohui.validate.consistency import (
    DriftThresholds,
    EngineOutput,
    EngineOutputs,
    ShadowComparator,
    char_similarity,
    compare_outputs,
    keyword_distribution,
    levenshtein,
    total_variation,
)

# ------------------------------------------------------------------------------------------- measures


def _dp(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def test_levenshtein_matches_the_textbook_dp() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab拒接折") for _ in range(rng.randint(0, 20)))
        b = "".join(rng.choice("ab拒接折") for _ in range(rng.randint(0, 90)))
        assert levenshtein(a, b) == _dp(a, b)
    assert levenshtein("kitten", "sitting") == 3


def test_char_similarity() -> None:
    assert char_similarity("", "") == 1.0
    assert char_similarity("建议拒绝", "建议接受") == 0.5
    assert char_similarity("abc", "") == 0.0


def test_keyword_categories() -> None:
    text = "不接受这个价格，但可以用条件交换来折中。"
    assert count_categories(text, NEGOTIATION_CATEGORIES) == {"拒绝": 1, "接受": 0, "折中": 2, "探询": 0}
    assert dominant_category(text, NEGOTIATION_CATEGORIES) == "折中"
    assert dominant_category("好的。", NEGOTIATION_CATEGORIES) == "none"
    dist = keyword_distribution(["拒绝", "接受", "接受", "好"], NEGOTIATION_CATEGORIES)
    assert dist == {"拒绝": 0.25, "接受": 0.5, "折中": 0.0, "探询": 0.0, "none": 0.25}
    assert total_variation({"a": 0.5, "b": 0.5}, {"a": 0.2, "c": 0.8}) == pytest.approx(0.8)


# ----------------------------------------------------------------------------------------- comparison


def test_identical_outputs_pass() -> None:
    out = EngineOutputs(intents=["greeting", "goodbye"], logits=[[1.0, 2.0], [0.5, 0.1]], texts=["拒绝", "好"])
    report = compare_outputs(out, out)
    assert report.passed
    assert (report.n, report.intent_agreement, report.logit_max_abs_error) == (2, 1.0, 0.0)
    assert (report.text_exact_match, report.text_similarity, report.keyword_drift) == (1.0, 1.0, 0.0)
    report.raise_for_failures()


def test_figures() -> None:
    old = EngineOutputs(intents=["a", "b", "c", "d"], logits=[[0.0, 1.0]] * 4, texts=["abcd", "x", "y", "z"])
    new = EngineOutputs(intents=["a", "b", "c", "x"], logits=[[0.1, 1.0]] * 4, texts=["abce", "x", "y", "z"])
    r = compare_outputs(old, new, DriftThresholds(max_drift=0.3))
    assert r.intent_agreement == 0.75
    assert r.logit_max_abs_error == pytest.approx(0.1)
    assert r.logit_mean_abs_error == pytest.approx(0.05)
    assert r.text_exact_match == 0.75
    assert r.text_similarity == pytest.approx((0.75 + 3) / 4)
    assert r.passed


def test_drift_threshold_failure_message() -> None:
    old = EngineOutputs(
        intents=["greeting"] * 20,
        texts=["建议拒绝。"] * 10 + ["可以接受。"] * 10,
    )
    new = EngineOutputs(
        intents=["greeting"] * 19 + ["goodbye"],
        texts=["建议拒绝。"] * 8 + ["可以接受。"] * 12,
    )
    report = compare_outputs(old, new)
    assert report.keyword_distribution_old == {
        "拒绝": 0.5,
        "接受": 0.5,
        "折中": 0.0,
        "探询": 0.0,
        "none": 0.0,
    }
    assert report.keyword_drift == pytest.approx(0.1)
    assert report.failures == [
        "keyword-distribution drift 0.100 exceeds the threshold 0.050 (largest change: 拒绝 0.50 -> 0.40)"
    ]
    with pytest.raises(ValidationGateError) as exc:
        report.raise_for_failures()
    assert str(exc.value) == (
        "drift check failed on 20 inputs: keyword-distribution drift 0.100 exceeds the threshold 0.050 "
        "(largest change: 拒绝 0.50 -> 0.40) — inspect the new engine (precision, calibration, build "
        "options); if the change is intended, raise the threshold explicitly"
    )


def test_intent_logit_and_text_thresholds() -> None:
    old = EngineOutputs(intents=["a"] * 10, logits=[[0.0]] * 10, texts=["abcd"] * 10)
    new = EngineOutputs(intents=["a"] * 9 + ["b"], logits=[[0.5]] * 10, texts=["abxy"] * 10)
    t = DriftThresholds(max_drift=0.05, max_logit_error=0.1, min_text_similarity=0.9)
    assert compare_outputs(old, new, t, categories={}).failures == [
        "intent agreement 90.0% is below 95.0% (1 of 10 inputs changed intent)",
        "logit max abs error 0.5 exceeds 0.1",
        "mean text similarity 0.500 is below 0.900",
    ]


def test_mismatched_inputs_are_rejected() -> None:
    with pytest.raises(InputError) as exc:
        compare_outputs(EngineOutputs(intents=["a"]), EngineOutputs(intents=["a", "b"]))
    assert str(exc.value) == (
        "old and new intents differ: 1 vs 2 — "
        "run both engines on the same inputs and give the same kinds of output for both"
    )
    with pytest.raises(InputError, match="logit vectors differ in length: 2 vs 3"):
        compare_outputs(EngineOutputs(logits=[[1.0, 2.0]]), EngineOutputs(logits=[[1.0, 2.0, 3.0]]))
    with pytest.raises(InputError, match="nothing to compare"):
        compare_outputs(EngineOutputs(), EngineOutputs())


def test_shadow_comparator_accumulates_over_a_window() -> None:
    shadow = ShadowComparator(window=4)
    assert shadow.report().n == 0 and shadow.report().passed
    for _ in range(4):
        shadow.observe(EngineOutput(intent="a", text="建议拒绝"), EngineOutput(intent="a", text="建议拒绝"))
    assert shadow.report().passed
    shadow.observe(EngineOutput(intent="a", text="建议拒绝"), EngineOutput(intent="b", text="建议接受"))
    r = shadow.report()
    assert (shadow.total, r.n, r.intent_agreement, r.text_exact_match) == (5, 4, 0.75, 0.75)
    assert r.keyword_drift == pytest.approx(0.25)
    assert r.failures[0] == "intent agreement 75.0% is below 95.0% (1 of 4 inputs changed intent)"
    shadow.observe(EngineOutput(logits=[0.0, 1.0]), EngineOutput(logits=[0.0, 1.25]))
    assert shadow.report().logit_max_abs_error == 0.25


# ------------------------------------------------------------------------------------------------ gate

DIALOGUES = load_gate_dialogues()
EXPECTED = {normalize_text(t.text): t.intent for d in DIALOGUES for t in d.turns}


class OracleClassifier:
    """Stands in for an intent engine: the test set's expected intent, except for the ``flips`` given."""

    def __init__(self, flips: dict[str, str] | None = None) -> None:
        self.flips = {normalize_text(k): v for k, v in (flips or {}).items()}

    async def classify(self, texts: list[str]) -> list[tuple[str, float]]:
        return [(self.flips.get(t, EXPECTED[t]), 0.9) for t in texts]


class FakeGenerator:
    """Stands in for a causal-LM engine: the reply whose key occurs in the user's last message."""

    def __init__(self, replies: dict[str, str]) -> None:
        self.replies = replies

    async def generate(self, messages: list[ChatMessage], max_tokens: int, temperature: float = 0.0) -> str:
        last = messages[-1]["content"]
        return next(reply for key, reply in self.replies.items() if key in last)


PIPES = ("bank_advisor", "gov_hotline", "meeting_assistant", "negotiation_coach")


def test_packaged_gate_set() -> None:
    assert len(DIALOGUES) >= 30
    assert {d.pipeline for d in DIALOGUES} == set(PIPES)
    texts = {t.text for d in DIALOGUES for t in d.turns}
    for seed in (
        "我想买一只稳健型基金，年化收益5%左右",
        "最近黄金涨得不错，现在入场合适吗？",
        "查社保",
        "帮我订明天上午九点的会议室",
        "对方要求降价15%，我该如何应对？",
    ):
        assert seed in texts
    assert sum(t.disclaimer for d in DIALOGUES for t in d.turns) >= 8


async def test_gate_passes_when_the_candidate_agrees() -> None:
    report = await run_pipeline_gate(DIALOGUES, OracleClassifier(), OracleClassifier())
    assert report.messages() == []
    assert report.passed
    assert (report.reference_intent_accuracy, report.candidate_intent_accuracy, report.intent_agreement) == (
        1.0,
        1.0,
        1.0,
    )
    report.raise_for_failures()


async def test_templated_replies_need_no_compliance_fixes() -> None:
    """Every reference reply of the gate set is compliant by construction: only disclaimers get added."""
    pipes = {name: Pipeline.from_name(name, OracleClassifier(), clock=lambda: GATE_NOW) for name in PIPES}
    for d in DIALOGUES:
        for turn in d.turns:
            r = await pipes[d.pipeline].run_turn(turn.text, d.id)
            assert [(i.rule, i.action) for i in r.interventions] in ([], [("risk_disclaimer", "inserted")])
            assert r.disclaimer == turn.disclaimer


async def test_gate_fails_a_candidate_that_loses_the_disclaimer_and_numbers() -> None:
    candidate = OracleClassifier(
        {"我想买一只稳健型基金，年化收益5%左右": "deposit_rates", "查社保": "medical_insurance"}
    )
    report = await run_pipeline_gate(DIALOGUES, OracleClassifier(), candidate)
    assert not report.passed
    assert [(f.dialogue, f.candidate_intent) for f in report.failures] == [
        ("bank-01", "deposit_rates"),
        ("gov-01", "medical_insurance"),
    ]
    bank = report.failures[0].problems
    assert bank[0] == "candidate reply lacks the required risk disclaimer (exactly once)"
    assert bank[1].startswith("candidate altered the reply's numbers (lost: 2.2, 2.8, 3.5, 3.5, 4.2, 5.5, 10, 100")
    assert report.failures[1].problems == ["candidate altered the reply's numbers (lost: 12333, 12333; added: 12393)"]
    assert report.intent_agreement == pytest.approx(1 - 2 / report.turns)
    with pytest.raises(ValidationGateError, match=r"^pipeline gate failed on 2 check\(s\) of \d+ turns: bank-01"):
        report.raise_for_failures()


async def test_gate_compares_generated_numbers() -> None:
    llm_turns = [d for d in DIALOGUES if d.id in ("bank-02", "neg-01")]
    ref = FakeGenerator(
        {"黄金": "黄金ETF联接A历史年化-5%～12%，短期难以预测。", "降价": "对方要求降价15%，先问清原因。"}
    )
    bad = FakeGenerator(
        {"黄金": "黄金ETF联接A历史年化-5%～15%，短期难以预测。", "降价": "对方要求降价10%，先问清原因。"}
    )
    report = await run_pipeline_gate(
        llm_turns, OracleClassifier(), OracleClassifier(), reference_generator=ref, candidate_generator=bad
    )
    assert [(f.dialogue, f.problems) for f in report.failures] == [
        ("bank-02", ["candidate altered the reply's numbers (lost: 5, 12; added: -)"]),
        (
            "neg-01",
            [
                "candidate reply lost number(s) 15",
                "candidate altered the reply's numbers (lost: 15; added: -)",
            ],
        ),
    ]
    assert report.failures[0].candidate_reply.endswith(f"{DISCLAIMER['zh']}。")  # replaced, still disclaimed


def test_a_flip_at_the_out_of_scope_threshold_within_the_engines_difference_is_a_reported_tie() -> None:
    from miaohui.dialogue.compare import _Turn, threshold_ties

    texts = ["对方要求降价15%", "对方威胁换供应商", "查社保"]
    old = [_Turn("out_of_scope", "r", 0.655, "complaint"), _Turn("out_of_scope", "r", 0.60, "complaint")]
    new = [_Turn("complaint", "r", 0.668, "complaint"), _Turn("complaint", "r", 0.70, "complaint")]
    old.append(_Turn("social_insurance", "r", 0.66, "social_insurance"))
    new.append(_Turn("out_of_scope", "r", 0.66, "housing_fund"))  # another best label: drift, never a tie
    ties = threshold_ties(texts, old, new, threshold=0.66, margin=0.02)
    assert ties == {
        0: "'对方要求降价15%': out_of_scope at 0.655 vs complaint at 0.668 (threshold 0.660, engines differ by up to 0.020)"
    }
    assert threshold_ties(texts, old, new, threshold=None, margin=0.02) == {}
    a = EngineOutputs(intents=[t.intent for t in old], texts=["r"] * 3)
    b = EngineOutputs(intents=[t.intent for t in new], texts=["r"] * 3)
    report = compare_outputs(a, b, DriftThresholds(max_drift=0.05), categories={}, ties=ties)
    assert report.threshold_ties == [ties[0]] and report.intent_agreement == 0.0  # 2 real changes of 2 counted
    assert report.failures == ["intent agreement 0.0% is below 95.0% (2 of 2 inputs changed intent)"]


def test_an_energy_threshold_ties_on_the_energy_of_the_turn_texts() -> None:
    """With an energy threshold the tie is judged on each engine's energy of the turn's text, not its confidence."""
    from miaohui.dialogue.compare import _Turn, _with_scores
    from miaohui.models.decision import IntentDecision

    class Runner:
        def logits(self, texts: list[str]) -> np.ndarray:
            return np.array([[2.0, 0.0]] * len(texts))

    turns = [_Turn("out_of_scope", "reply", 0.88, "complaint")]
    energy = IntentDecision(temperature=1.0, threshold=2.1, score="energy")
    (scored,) = _with_scores(turns, ["对方要求降价15%"], Runner(), energy)
    assert scored.confidence == pytest.approx(np.log(np.exp(2.0) + 1.0)) and scored.best == "complaint"
    assert _with_scores(turns, ["x"], Runner(), IntentDecision(threshold=0.5)) == turns
