"""The rules by which timings become tuning entries (``scripts/gpu/tune.py``): an entry is written only where the
kernel was measured faster than what runs without it, by at least the margin below."""

from __future__ import annotations

from typing import Any

from miaohui.models.tuning import AttnConfig, SkinnyConfig

MIN_ATTN_GAIN = 0.10
"""An attention shape gets an entry only if its best configuration is at least this much faster than the SDPA form
(smaller gains did not survive the whole engine)."""

MIN_LN_SPLIT_GAIN = 0.05
"""A forced split gets an entry only if its fused pair (GEMM, add + LayerNorm, GEMM) is at least this much faster
than the unfused pair."""

MIN_LT_GAIN = 0.03
"""A cuBLASLt algorithm gets an entry only if it is at least this much faster than torch's call, taken as the faster
of two timings of it (before and after the candidates)."""


def attention_entries(best: list[dict[str, Any]]) -> dict[tuple[int, int], AttnConfig]:
    """Per (batch, seq) the fastest configuration (``config``, ``us``) against the SDPA form (``sdpa_us``) →
    (batch, seq) → configuration, where it passes :data:`MIN_ATTN_GAIN`."""
    return {
        (int(e["batch"]), int(e["seq"])): tuple(int(v) for v in e["config"])  # type: ignore[misc]
        for e in best
        if float(e["us"]) <= (1 - MIN_ATTN_GAIN) * float(e["sdpa_us"])
    }


def skinny_entries(chains: dict[int, dict[str, Any]]) -> dict[int, dict[str, SkinnyConfig]]:
    """rows → {``configs``: GEMM → configuration, ``us``: the chain of skinny GEMMs, ``cublas_us``: cuBLAS's chain}
    → rows → GEMM → configuration, at the rows where the skinny chain was faster."""
    return {
        rows: {g: tuple(int(v) for v in cfg) for g, cfg in c["configs"].items()}  # type: ignore[misc]
        for rows, c in sorted(chains.items())
        if float(c["us"]) < float(c["cublas_us"])
    }


def ln_split_entries(pairs: list[dict[str, Any]]) -> dict[int, dict[str, SkinnyConfig]]:
    """Timed pairs (``rows``, ``gemm`` the first product, ``piece`` ``unfused`` or a forced split with its
    ``config``, ``us``) → rows → first GEMM → its fastest forced split, where that pair beats the unfused one by
    :data:`MIN_LN_SPLIT_GAIN`."""
    best: dict[tuple[int, str], tuple[float, SkinnyConfig]] = {}
    unfused: dict[tuple[int, str], float] = {}
    for row in pairs:
        key = (int(row["rows"]), str(row["gemm"]))
        if row["piece"] == "unfused":
            unfused[key] = float(row["us"])
        elif "config" in row and float(row["us"]) < best.get(key, (float("inf"),))[0]:
            best[key] = (float(row["us"]), tuple(int(v) for v in row["config"]))  # type: ignore[assignment]
    out: dict[int, dict[str, SkinnyConfig]] = {}
    for (rows, gemm), (us, cfg) in sorted(best.items()):
        if us <= (1 - MIN_LN_SPLIT_GAIN) * unfused.get((rows, gemm), 0.0):
            out.setdefault(rows, {})[gemm] = cfg
    return out


def lt_entries(best: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    """Per (``m`` rows, ``gemm``) the fastest candidate (``best_us``, ``hex``) against torch's call (``torch_us``,
    ``torch_again_us``) → rows → GEMM → algorithm hex, where it passes :data:`MIN_LT_GAIN`."""
    out: dict[int, dict[str, str]] = {}
    for e in best:
        torch_us = min(float(e["torch_us"]), float(e.get("torch_again_us", e["torch_us"])))
        if float(e["best_us"]) <= (1 - MIN_LT_GAIN) * torch_us:
            out.setdefault(int(e["m"]), {})[str(e["gemm"])] = str(e["hex"])
    return out
