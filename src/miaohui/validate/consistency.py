"""Consistency between two engines (versions, precisions, backends) on the same inputs.

Figures, each computed over the pairs that carry it:

* ``intent_agreement`` — share of inputs whose intent label is the same.
* ``logit_max_abs_error`` / ``logit_mean_abs_error`` — over all logits of all inputs.
* ``text_exact_match`` — share of generated texts that are identical; ``text_similarity`` — mean
  character-level similarity, ``1 - levenshtein(a, b) / max(len(a), len(b))`` (1.0 for two empty texts).
* ``keyword_drift`` — total-variation distance ``½ Σ |p - q|`` between the distributions of the replies'
  dominant keyword category (:func:`miaohui.nlp.keywords.dominant_category`, with ``none`` for replies
  without a keyword), e.g. 拒绝/接受/折中/探询 for the negotiation coach.
* ``greedy_agreement`` — share of greedy answers (pairs that carry ``tokens``) whose token ids are identical.
* ``keyword_frequency_old`` / ``_new`` — per keyword of a plain list (the chat shadow's ``keywords``), the share
  of each engine's answers that contain it; ``keyword_frequency_drift`` — the largest difference. A keyword whose
  frequencies differ by more than ``max_drift`` fails the check.

:func:`compare_outputs` compares two complete runs (``miaohui compare OLD NEW``); :class:`ShadowComparator`
accumulates the same figures online from (primary, shadow) pairs over a sliding window, for the server's
shadow mode. Both give a :class:`DriftReport`; :meth:`DriftReport.raise_for_failures` raises
:class:`~miaohui.errors.ValidationGateError` when a threshold of :class:`DriftThresholds` is crossed:
intent disagreement or keyword drift above ``max_drift`` (default 5%), and optionally logit error and
text similarity.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from miaohui.errors import InputError, ValidationGateError
from miaohui.nlp.keywords import NEGOTIATION_CATEGORIES, NONE_CATEGORY, dominant_category

__all__ = [
    "DriftReport",
    "DriftThresholds",
    "EngineOutput",
    "EngineOutputs",
    "ShadowComparator",
    "char_similarity",
    "compare_outputs",
    "keyword_distribution",
    "levenshtein",
    "total_variation",
]


class DriftThresholds(BaseModel):
    """When two engines disagree too much."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_drift: float = Field(default=0.05, ge=0.0, le=1.0)
    """Largest allowed intent disagreement rate and keyword-distribution drift (total variation)."""
    max_logit_error: float | None = Field(default=None, gt=0.0)
    """Largest allowed absolute logit difference; None = reported only."""
    min_text_similarity: float | None = Field(default=None, ge=0.0, le=1.0)
    """Smallest allowed mean character similarity of generated texts; None = reported only."""


class EngineOutput(BaseModel):
    """One engine's output for one input; fields an engine does not produce stay None."""

    intent: str | None = None
    logits: list[float] | None = None
    text: str | None = None
    tokens: list[int] | None = None
    """A greedy answer's token ids (None for a sampled answer: its tokens are not expected to agree)."""


class EngineOutputs(BaseModel):
    """One engine's outputs for all comparison inputs, in input order."""

    intents: list[str] | None = None
    logits: list[list[float]] | None = None
    texts: list[str] | None = None

    def __len__(self) -> int:
        sizes = [len(x) for x in (self.intents, self.logits, self.texts) if x is not None]
        return max(sizes, default=0)

    def item(self, i: int) -> EngineOutput:
        return EngineOutput(
            intent=self.intents[i] if self.intents is not None else None,
            logits=self.logits[i] if self.logits is not None else None,
            text=self.texts[i] if self.texts is not None else None,
        )


class DriftReport(BaseModel):
    """How far two engines' outputs are apart, and which thresholds they cross."""

    n: int
    """Input pairs compared."""
    intent_agreement: float | None = None
    logit_max_abs_error: float | None = None
    logit_mean_abs_error: float | None = None
    text_exact_match: float | None = None
    text_similarity: float | None = None
    keyword_distribution_old: dict[str, float] | None = None
    """Share of replies per dominant keyword category, old (primary) engine."""
    keyword_distribution_new: dict[str, float] | None = None
    """The same for the new (shadow) engine."""
    keyword_drift: float | None = None
    """Total-variation distance between the two keyword distributions."""
    confidence_max_abs_error: float | None = None
    """Largest difference of the two engines' out-of-scope score over the inputs (intent engines): the calibrated top
    confidence, or the energy where the threshold applies to it (``IntentDecision.score``)."""
    threshold_ties: list[str] = Field(default_factory=list)
    """Inputs whose intents differ only by the out-of-scope decision, with both confidences within the engines'
    measured confidence difference of the threshold (a coin toss between the engines, not drift): reported here
    and left out of ``intent_agreement``."""
    greedy_pairs: int = 0
    """Pairs of greedy answers compared token by token."""
    greedy_agreement: float | None = None
    """Share of greedy answer pairs whose token ids are identical."""
    keyword_frequency_old: dict[str, float] | None = None
    """Per keyword, the share of the old (primary) engine's answers that contain it."""
    keyword_frequency_new: dict[str, float] | None = None
    """The same for the new (shadow) engine."""
    keyword_frequency_drift: float | None = None
    """The largest difference of one keyword's frequencies."""
    thresholds: DriftThresholds = DriftThresholds()
    failures: list[str] = Field(default_factory=list)
    """One sentence per crossed threshold; empty when the check passes."""

    @property
    def passed(self) -> bool:
        return not self.failures

    def raise_for_failures(self) -> None:
        """Raise :class:`ValidationGateError` listing every crossed threshold."""
        if self.failures:
            raise ValidationGateError(
                f"drift check failed on {self.n} inputs: " + "; ".join(self.failures),
                "inspect the new engine (precision, calibration, build options); if the change is intended, "
                "raise the threshold explicitly",
            )


# ------------------------------------------------------------------------------------------ measures


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute one character), bit-parallel (Myers/Hyyrö) on Python ints."""
    if len(a) < len(b):
        a, b = b, a
    m = len(b)
    if m == 0:
        return len(a)
    peq: dict[str, int] = {}
    for i, ch in enumerate(b):
        peq[ch] = peq.get(ch, 0) | (1 << i)
    full = (1 << m) - 1
    top = 1 << (m - 1)
    pv, mv, score = full, 0, m
    for ch in a:
        eq = peq.get(ch, 0)
        xv = eq | mv
        xh = (((eq & pv) + pv) ^ pv) | eq
        ph = (mv | ~(xh | pv)) & full
        mh = pv & xh
        if ph & top:
            score += 1
        elif mh & top:
            score -= 1
        ph = ((ph << 1) | 1) & full
        mh = (mh << 1) & full
        pv = (mh | ~(xv | ph)) & full
        mv = ph & xv
    return score


def char_similarity(a: str, b: str) -> float:
    """``1 - levenshtein(a, b) / max(len(a), len(b))``; 1.0 for two empty strings."""
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, b) / longest


def keyword_distribution(texts: Iterable[str], categories: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """Share of texts per dominant category (every category and ``none`` present)."""
    counts = Counter(dominant_category(t, categories) for t in texts)
    total = sum(counts.values())
    keys = [*categories, NONE_CATEGORY]
    return {k: (counts[k] / total if total else 0.0) for k in keys}


def total_variation(p: Mapping[str, float], q: Mapping[str, float]) -> float:
    """``½ Σ |p(k) - q(k)|`` over the keys of both."""
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


# --------------------------------------------------------------------------------------- aggregation


class _Pair(BaseModel):
    """What one (old, new) pair contributes."""

    intent_agree: bool | None = None
    logit_max: float | None = None
    logit_sum: float = 0.0
    logit_count: int = 0
    text_exact: bool | None = None
    text_sim: float | None = None
    cat_old: str | None = None
    cat_new: str | None = None
    tokens_exact: bool | None = None
    kw_old: tuple[bool, ...] | None = None
    kw_new: tuple[bool, ...] | None = None
    tie: bool = False


def _pair(
    old: EngineOutput,
    new: EngineOutput,
    categories: Mapping[str, Sequence[str]],
    keywords: Sequence[str] = (),
    tie: bool = False,
) -> _Pair:
    out = _Pair()
    if old.tokens is not None and new.tokens is not None:
        out.tokens_exact = old.tokens == new.tokens
    if old.intent is not None and new.intent is not None:
        out.intent_agree = old.intent == new.intent
        if tie and not out.intent_agree:
            out.intent_agree, out.tie = None, True
    if old.logits is not None and new.logits is not None:
        if len(old.logits) != len(new.logits):
            raise InputError(
                f"logit vectors differ in length: {len(old.logits)} vs {len(new.logits)}",
                "compare engines with the same output labels",
            )
        diffs = [abs(x - y) for x, y in zip(old.logits, new.logits, strict=True)]
        out.logit_max = max(diffs, default=0.0)
        out.logit_sum, out.logit_count = sum(diffs), len(diffs)
    if old.text is not None and new.text is not None:
        out.text_exact = old.text == new.text
        out.text_sim = 1.0 if out.text_exact else char_similarity(old.text, new.text)
        if categories:
            out.cat_old = dominant_category(old.text, categories)
            out.cat_new = dominant_category(new.text, categories)
        if keywords:
            out.kw_old = tuple(k in old.text for k in keywords)
            out.kw_new = tuple(k in new.text for k in keywords)
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _aggregate(
    pairs: Sequence[_Pair], thresholds: DriftThresholds, categories: Sequence[str], keywords: Sequence[str] = ()
) -> DriftReport:
    agree = [p.intent_agree for p in pairs if p.intent_agree is not None]
    logit_max = [p.logit_max for p in pairs if p.logit_max is not None]
    logit_count = sum(p.logit_count for p in pairs)
    exact = [p.text_exact for p in pairs if p.text_exact is not None]
    report = DriftReport(
        n=len(pairs),
        intent_agreement=_mean([float(a) for a in agree]),
        logit_max_abs_error=max(logit_max) if logit_max else None,
        logit_mean_abs_error=sum(p.logit_sum for p in pairs) / logit_count if logit_count else None,
        text_exact_match=_mean([float(e) for e in exact]),
        text_similarity=_mean([p.text_sim for p in pairs if p.text_sim is not None]),
        thresholds=thresholds,
    )
    cats = [(p.cat_old, p.cat_new) for p in pairs if p.cat_old is not None and p.cat_new is not None]
    if cats:
        keys = [*categories, NONE_CATEGORY]
        old_c, new_c = Counter(c[0] for c in cats), Counter(c[1] for c in cats)
        report.keyword_distribution_old = {k: old_c[k] / len(cats) for k in keys}
        report.keyword_distribution_new = {k: new_c[k] / len(cats) for k in keys}
        report.keyword_drift = total_variation(report.keyword_distribution_old, report.keyword_distribution_new)
    greedy = [p.tokens_exact for p in pairs if p.tokens_exact is not None]
    report.greedy_pairs, report.greedy_agreement = len(greedy), _mean([float(g) for g in greedy])
    kws = [(p.kw_old, p.kw_new) for p in pairs if p.kw_old is not None and p.kw_new is not None]
    if keywords and kws:
        report.keyword_frequency_old = {k: sum(o[i] for o, _ in kws) / len(kws) for i, k in enumerate(keywords)}
        report.keyword_frequency_new = {k: sum(n[i] for _, n in kws) / len(kws) for i, k in enumerate(keywords)}
        old_f, new_f = report.keyword_frequency_old, report.keyword_frequency_new
        report.keyword_frequency_drift = max(abs(old_f[k] - new_f[k]) for k in keywords)
    report.failures = _failures(report, thresholds, len(agree))
    return report


def _failures(r: DriftReport, t: DriftThresholds, n_intents: int) -> list[str]:
    out: list[str] = []
    if r.intent_agreement is not None and 1.0 - r.intent_agreement > t.max_drift + 1e-12:
        changed = round((1.0 - r.intent_agreement) * n_intents)
        out.append(
            f"intent agreement {r.intent_agreement:.1%} is below {1.0 - t.max_drift:.1%} "
            f"({changed} of {n_intents} inputs changed intent)"
        )
    if r.keyword_drift is not None and r.keyword_drift > t.max_drift + 1e-12:
        old, new = r.keyword_distribution_old or {}, r.keyword_distribution_new or {}
        worst = max(old, key=lambda k: abs(old[k] - new.get(k, 0.0)))
        out.append(
            f"keyword-distribution drift {r.keyword_drift:.3f} exceeds the threshold {t.max_drift:.3f} "
            f"(largest change: {worst} {old[worst]:.2f} -> {new.get(worst, 0.0):.2f})"
        )
    old_f, new_f = r.keyword_frequency_old or {}, r.keyword_frequency_new or {}
    for k, old_k in old_f.items():
        diff = abs(new_f[k] - old_k)
        if diff > t.max_drift + 1e-12:
            out.append(
                f"keyword {k!r} is in {new_f[k]:.1%} of the new engine's answers and {old_k:.1%} of the old one's "
                f"(difference {diff:.1%} exceeds {t.max_drift:.1%})"
            )
    if (
        t.max_logit_error is not None
        and r.logit_max_abs_error is not None
        and (r.logit_max_abs_error > t.max_logit_error)
    ):
        out.append(f"logit max abs error {r.logit_max_abs_error:.4g} exceeds {t.max_logit_error:.4g}")
    if (
        t.min_text_similarity is not None
        and r.text_similarity is not None
        and (r.text_similarity < t.min_text_similarity)
    ):
        out.append(f"mean text similarity {r.text_similarity:.3f} is below {t.min_text_similarity:.3f}")
    return out


def compare_outputs(
    old: EngineOutputs,
    new: EngineOutputs,
    thresholds: DriftThresholds | None = None,
    categories: Mapping[str, Sequence[str]] | None = None,
    ties: Mapping[int, str] | None = None,
) -> DriftReport:
    """Compare two engines' outputs on the same inputs; ``categories`` default to the negotiation ones. ``ties``:
    inputs (index → description) whose intent difference is a tie at the out-of-scope threshold
    (:attr:`DriftReport.threshold_ties`)."""
    cats = NEGOTIATION_CATEGORIES if categories is None else categories
    for name in ("intents", "logits", "texts"):
        a, b = getattr(old, name), getattr(new, name)
        if (a is None) != (b is None) or (a is not None and len(a) != len(b)):
            size_a, size_b = (None if x is None else len(x) for x in (a, b))
            raise InputError(
                f"old and new {name} differ: {size_a} vs {size_b}",
                "run both engines on the same inputs and give the same kinds of output for both",
            )
    if len(old) == 0:
        raise InputError("nothing to compare: no intents, logits or texts", "give both engines' outputs")
    tie = ties or {}
    pairs = [_pair(old.item(i), new.item(i), cats, tie=i in tie) for i in range(len(old))]
    report = _aggregate(pairs, thresholds or DriftThresholds(), list(cats))
    report.threshold_ties = [tie[i] for i, p in enumerate(pairs) if p.tie]
    return report


class ShadowComparator:
    """Online drift between a primary engine and a shadow candidate over the last ``window`` pairs."""

    def __init__(
        self,
        thresholds: DriftThresholds | None = None,
        categories: Mapping[str, Sequence[str]] | None = None,
        window: int = 1000,
        keywords: Sequence[str] = (),
    ) -> None:
        """``keywords``: a plain list whose frequencies in the two engines' answers are compared (chat models)."""
        if window < 1:
            raise InputError(f"shadow window {window} < 1", "keep at least one pair, e.g. window=1000")
        self.thresholds = thresholds or DriftThresholds()
        self.categories = dict(NEGOTIATION_CATEGORIES if categories is None else categories)
        self.keywords = tuple(keywords)
        self._pairs: deque[_Pair] = deque(maxlen=window)
        self.total = 0
        """Pairs observed since creation (the window holds the last ``window`` of them)."""

    def observe(self, primary: EngineOutput, shadow: EngineOutput) -> None:
        """Record one (primary, shadow) output pair for the same request."""
        self._pairs.append(_pair(primary, shadow, self.categories, self.keywords))
        self.total += 1

    def report(self) -> DriftReport:
        """Current figures over the window (``n`` = 0 and no figures before the first pair)."""
        return _aggregate(list(self._pairs), self.thresholds, list(self.categories), self.keywords)
