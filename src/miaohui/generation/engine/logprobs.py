"""Log-probabilities of generated tokens (OpenAI's ``logprobs`` / ``top_logprobs``).

A token's log-probability is the log-softmax of the model's logits for that step, before any constraint mask,
temperature or top-p (what the model assigns, as vLLM's default ``raw_logprobs``), computed in float64 from the
engine's logits. ``top`` holds the ``k`` most likely tokens of the step, most likely first (ties by lower id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit for ``top_logprobs``."""


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the step's most likely alternatives."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) of the ``k`` most likely tokens, most likely first."""


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top_k: Sequence[int]) -> list[TokenLogprobs]:
    """For each row of [rows, vocab] ``logits``: the log-probability of ``tokens[i]`` and the ``top_k[i]`` best."""
    x = np.asarray(logits, dtype=np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    peak = x.max(axis=-1, keepdims=True)
    logz = peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))
    lp = x - logz
    out = []
    for i, (tok, k) in enumerate(zip(tokens, top_k, strict=True)):
        row = lp[i]
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            k = min(k, row.shape[0])
            idx = np.argpartition(-row, k - 1)[:k]
            idx = idx[np.lexsort((idx, -row[idx]))]
            top = tuple((int(t), float(row[t])) for t in idx)
        out.append(TokenLogprobs(float(row[int(tok)]), top))
    return out
