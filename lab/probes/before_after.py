"""Before/after of one CPU benchmark: result JSONs of the same script run on two trees, side by side with ratios.

    python lab/probes/before_after.py generation --out benchmarks/results/generation_cpu_before_after.json \\
        --before-commit b4807a7 --after-commit 7b0c281 \\
        --pair /tmp/b1/generation_cpu.json /tmp/a1/generation_cpu.json --pair /tmp/b2/… /tmp/a2/…

``generation``: ``bench_generation_cpu.py`` outputs, rows keyed by (engine, streams): TTFT and TPOT medians and
tokens/s. ``intent``: ``bench_intent_cpu.py`` outputs, rows keyed by (engine, batch, seq): median and p99 ms. Each
``--pair`` is one before run and one after run taken back to back; ratios are after / before (below 1 for times
and above 1 for tokens/s mean the after tree is faster). Writes the JSON and a PNG of the ratios beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

KINDS = ("generation", "intent")


def _rows(kind: str, doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for r in doc.get("results") or doc.get("rows") or []:
        if kind == "generation":
            key = f"{r['engine']} × {r['streams']}"
            out[key] = {
                "ttft_ms_median": r["ttft_ms"]["median"],
                "tpot_ms_median": r["tpot_ms"]["median"],
                "tokens_per_s": r["tokens_per_s"],
            }
        else:
            key = f"{r['engine']} b{r['batch']} s{r['seq']}"
            out[key] = {"median_ms": r["median_ms"], "p99_ms": r["p99_ms"]}
    return out


def compare(kind: str, pairs: list[tuple[Path, Path]]) -> list[dict[str, Any]]:
    """One entry per pair: both runs' figures and after / before per row and metric."""
    entries = []
    for before_path, after_path in pairs:
        before, after = (json.loads(p.read_text()) for p in (before_path, after_path))
        b, a = _rows(kind, before), _rows(kind, after)
        ratios = {key: {m: a[key][m] / v for m, v in b[key].items() if v} for key in b if key in a}
        entries.append(
            {
                "before": {"file": str(before_path), "environment": before.get("environment"), "rows": b},
                "after": {"file": str(after_path), "environment": after.get("environment"), "rows": a},
                "after_over_before": ratios,
            }
        )
    return entries


def summary(entries: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per row and metric: the median of the pairs' after / before."""
    keys = entries[0]["after_over_before"].keys()
    return {
        k: {
            m: statistics.median(e["after_over_before"][k][m] for e in entries if k in e["after_over_before"])
            for m in entries[0]["after_over_before"][k]
        }
        for k in keys
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = doc["after_over_before_median"]
    metrics = sorted({m for v in med.values() for m in v})
    keys = list(med)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 4))
    width = 0.8 / len(metrics)
    for i, m in enumerate(metrics):
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [med[k].get(m, float("nan")) for k in keys], width, label=m)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("after / before (median of pairs)")
    ax.set_title(f"{doc['kind']} CPU before/after ({doc['before_commit']} → {doc['after_commit']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--pair", nargs=2, type=Path, action="append", required=True, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--before-commit", required=True)
    ap.add_argument("--after-commit", required=True)
    ap.add_argument("--note", default="", help="what the reader must know (load, order of the runs)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    entries = compare(args.kind, [(b, a) for b, a in args.pair])
    doc = {
        "schema": "miaohui-before-after/1",
        "kind": args.kind,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "before_commit": args.before_commit,
        "after_commit": args.after_commit,
        "note": args.note,
        "pairs": entries,
        "after_over_before_median": summary(entries),
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, args.out.with_suffix(".png"))
    for key, ms in doc["after_over_before_median"].items():
        print(f"{key:<32}" + "  ".join(f"{m} {v:.2f}" for m, v in ms.items()))


if __name__ == "__main__":
    main()
