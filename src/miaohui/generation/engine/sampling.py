"""Choosing the next token from logits: greedy, temperature, top-p, per-request seeded generators.

Numerics: logits are taken to float64, NaN becomes -inf and +inf the largest float; the max is
subtracted before ``exp`` so nothing overflows; a row with no finite logit falls back to argmax of the
cleaned row (token 0 if every value was NaN). Top-p sorts only as many of the most probable tokens as
it needs (``argpartition`` on a growing k), so a 49k vocabulary costs well under a millisecond.
Sampling draws one uniform number per token from the request's own ``numpy.random.Generator`` (inverse
CDF), so a seeded request gives the same tokens whatever else is in its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from miaohui.errors import ShapeError
from miaohui.generation.engine.params import SamplingParams

__all__ = ["SamplingParams", "make_rng", "sample", "sample_batch"]

_FIRST_K = 64


def make_rng(seed: int | None) -> np.random.Generator:
    """The request's generator: seeded when ``seed`` is given, fresh OS entropy otherwise."""
    return np.random.default_rng(seed)


def _clean(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64, copy=True)
    x[np.isnan(x)] = -np.inf
    x[np.isposinf(x)] = np.finfo(np.float64).max
    return x


def _nucleus(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their probabilities) of the smallest most-probable set whose mass reaches top_p."""
    n = probs.shape[0]
    k = min(_FIRST_K, n)
    while True:
        top = np.argpartition(-probs, k - 1)[:k] if k < n else np.arange(n)
        top = top[np.argsort(-probs[top], kind="stable")]
        cum = np.cumsum(probs[top])
        if cum[-1] >= top_p or k == n:
            keep = min(int(np.searchsorted(cum, top_p, side="left")) + 1, k)
            return top[:keep], probs[top[:keep]]
        k = min(k * 8, n)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a [vocab] row of logits."""
    if logits.ndim != 1 or logits.shape[0] == 0:
        raise ShapeError(f"logits of shape {logits.shape} for one token", "pass one [vocab] row")
    x = _clean(logits)
    best = int(np.argmax(x))
    if params.greedy or not np.isfinite(x[best]):
        return best
    z = (x - x[best]) / params.temperature
    probs = np.exp(z)  # the max maps to 1, the rest underflow safely to 0
    probs /= probs.sum()
    if params.top_p < 1.0:
        ids, p = _nucleus(probs, params.top_p)
    else:
        ids, p = np.arange(probs.shape[0]), probs
    cdf = np.cumsum(p)
    u = rng.random() * cdf[-1]
    return int(ids[min(int(np.searchsorted(cdf, u, side="right")), ids.shape[0] - 1)])


def sample_batch(
    logits: np.ndarray, params: Sequence[SamplingParams], rngs: Sequence[np.random.Generator]
) -> list[int]:
    """One token per row of [batch, vocab] logits, each row with its own parameters and generator."""
    if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(rngs):
        raise ShapeError(
            f"logits {logits.shape} for {len(params)} parameter sets and {len(rngs)} generators",
            "pass [batch, vocab] logits with one SamplingParams and one generator per row",
        )
    if all(p.greedy for p in params):  # the common fast path: one vectorised argmax
        return [int(t) for t in np.argmax(np.nan_to_num(logits, nan=-np.inf), axis=-1)]
    return [sample(row, p, g) for row, p, g in zip(logits, params, rngs, strict=True)]
