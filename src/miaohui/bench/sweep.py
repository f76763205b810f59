"""A benchmark = texts + a target + one or more load levels; each level measured with a /metrics scrape
around its window. Library entry point of ``miaohui bench``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from miaohui.bench.chat_report import summarize_chat
from miaohui.bench.load import LoadPlan, run_processes
from miaohui.bench.report import summarize
from miaohui.bench.scrape import Snapshot, breakdown, fetch_metrics
from miaohui.bench.targets import TargetSpec
from miaohui.errors import ConfigError


def load_texts(path: Path | None = None) -> list[str]:
    """The project's dev split (default), a ``.txt`` file (one text a line) or a JSONL file (``text``)."""
    if path is None:
        from miaohui.zoo.intents import load_split

        return [x.text for x in load_split("dev")]
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"text file {path} does not exist", "pass --texts with an existing .txt or .jsonl file")
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if path.suffix != ".jsonl":
        return lines
    texts = []
    for i, line in enumerate(lines, 1):
        try:
            texts.append(str(json.loads(line)["text"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(
                f"{path}:{i} is not a JSON object with a 'text' field", 'write one {"text": "..."} object a line'
            ) from None
    return texts


def fit_token_range(
    texts: list[str], count_tokens: Callable[[list[str]], list[int]], lo: int, hi: int, seed: int = 0
) -> list[str]:
    """Texts whose token count (special tokens included) lies in ``[lo, hi]``: those that already fit,
    plus as many again made by joining random texts up to a length drawn uniformly from ``[lo, hi]``, so
    the lengths spread over the whole range (real utterances are mostly short)."""
    if not 1 <= lo <= hi:
        raise ConfigError(f"token range {lo}-{hi} is empty", "give --tokens MIN-MAX with 1 ≤ MIN ≤ MAX, e.g. 8-64")
    lengths = count_tokens(texts)
    fits = [t for t, n in zip(texts, lengths, strict=True) if lo <= n <= hi]
    parts = [t for t, n in zip(texts, lengths, strict=True) if n < hi]
    rng = np.random.default_rng(seed)
    made: list[str] = []
    for _ in range(len(texts) * 4 if parts else 0):
        if len(made) >= len(texts):
            break
        goal, cand = int(rng.integers(lo, hi + 1)), ""
        while True:
            longer = f"{cand} {parts[int(rng.integers(len(parts)))]}".strip()
            n = count_tokens([longer])[0]
            if n > hi:
                break
            cand = longer
            if n >= goal:
                made.append(cand)
                break
    out = fits + made
    if not out:
        raise ConfigError(
            f"no text of {lo}-{hi} tokens could be found or composed",
            "widen --tokens, or pass --texts with longer texts",
        )
    return out


def tokenizer_counter(artifact: Path) -> Callable[[list[str]], list[int]]:
    """Token counts with the tokenizer shipped in an engine artifact."""
    from miaohui.engines.store import read_manifest
    from miaohui.nlp.tokenizer import TextTokenizer

    manifest = read_manifest(artifact)
    if not manifest.tokenizer_file:
        raise ConfigError(f"{artifact} ships no tokenizer", "pass --engine with a text model's artifact")
    tok = TextTokenizer.from_file(artifact / manifest.tokenizer_file, manifest.max_length or 512)
    return lambda texts: [len(ids) for ids in tok.token_ids(texts)]


def measure(spec: TargetSpec, texts: list[str], plan: LoadPlan, metrics_url: str | None) -> dict[str, Any]:
    """Run one load level; with ``metrics_url``, scrape /metrics as the window opens and after it ends."""
    snaps: dict[str, Snapshot | None] = {}

    def before() -> None:
        snaps["before"] = fetch_metrics(metrics_url) if metrics_url else None

    def after() -> None:
        snaps["after"] = fetch_metrics(metrics_url) if metrics_url and snaps.get("before") else None

    raw = run_processes(spec, texts, plan, on_measure=before if metrics_url else None, on_done=after)
    if spec.kind == "chat":
        return summarize_chat(raw, plan)
    server = None
    b, a = snaps.get("before"), snaps.get("after")
    if b is not None and a is not None:
        start = raw.first_send if raw.status else plan.warmup_s
        server = breakdown(b, a, spec.model, max(raw.last_done - start, 1e-9))
    return summarize(raw, plan, server)


def run_sweep(
    spec: TargetSpec,
    texts: list[str],
    plans: list[LoadPlan],
    metrics_url: str | None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    points = []
    for plan in plans:
        point = measure(spec, texts, plan, metrics_url)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points
