"""Several `miaohui bench` runs of one server side by side (an A/B in one device call): requests/s and p99 per
concurrency level, one bar per run, against the issue's goal lines (≥ 5,400 req/s, p99 ≤ 10 ms).

    python benchmarks/plot_server_runs.py RUN.json [RUN.json ...] --labels a,b,... --out runs.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

GOAL_RPS = 5400.0
GOAL_P99_MS = 10.0


def load_runs(files: list[Path]) -> list[dict[int, dict[str, float]]]:
    """Per run: concurrency → requests/s and p99 ms (closed-loop levels with answers only)."""
    runs = []
    for file in files:
        doc = json.loads(file.read_text())
        runs.append(
            {
                int(p["concurrency"]): {"rps": p["throughput_rps"], "p99": p["latency_ms"]["p99"]}
                for p in doc["points"]
                if p.get("concurrency") and p["answered"]
            }
        )
    return runs


def plot(runs: list[dict[int, dict[str, float]]], labels: list[str], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({c for run in runs for c in run})
    width = 0.8 / len(runs)
    fig, (ax_rps, ax_p99) = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(levels))]
        ax_rps.bar(xs, [run.get(c, {}).get("rps", 0.0) for c in levels], width, label=label)
        ax_p99.bar(xs, [run.get(c, {}).get("p99", 0.0) for c in levels], width, label=label)
    for ax, goal, name in ((ax_rps, GOAL_RPS, "requests/s"), (ax_p99, GOAL_P99_MS, "p99 latency (ms)")):
        ax.axhline(goal, color="k", linestyle="--", linewidth=1, label=f"goal {goal:g}")
        ax.set_xticks(range(len(levels)), [f"c={c}" for c in levels])
        ax.set_ylabel(name)
        ax.grid(True, axis="y", alpha=0.3)
    ax_rps.set_title("throughput (goal: at least)")
    ax_p99.set_title("p99 (goal: at most)")
    top = max(run[c]["rps"] for run in runs for c in run)
    ax_rps.set_ylim(0, max(top, GOAL_RPS) * 1.45)  # room for the legend above the bars
    ax_rps.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--labels", help="comma-separated, one per run (default: file names)")
    ap.add_argument("--title", default="intent server runs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [f.stem for f in args.runs]
    if len(labels) != len(args.runs):
        ap.error(f"{len(labels)} labels for {len(args.runs)} runs")
    runs: list[dict[int, Any]] = load_runs(args.runs)
    plot(runs, labels, args.title, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
