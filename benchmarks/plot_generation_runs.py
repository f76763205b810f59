"""Several 1.5B generation-server runs (``bench_generation_gpu.py --server-only``) side by side: output tokens/s and
TTFT p99 per run, one bar each, against the issue's goal lines (≥ 25,000 tok/s, TTFT p99 ≤ 50 ms).

    python benchmarks/plot_generation_runs.py RUN.json [RUN.json ...] --labels a,b,... [--highlight PREFIX] \
        --out runs.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GOAL_TOKENS_PER_S = 25_000.0
GOAL_TTFT_P99_MS = 50.0


def load_run(file: Path) -> tuple[float, float]:
    """(output tokens/s, TTFT p99 ms) of the run's first model."""
    server = json.loads(file.read_text())["models"][0]["server"]
    return float(server["tokens_per_s"]), float(server["ttft_ms_p99"])


def plot(runs: list[tuple[float, float]], labels: list[str], title: str, out: Path, highlight: str = "mixed") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(runs) + 4), 4))
    xs = range(len(runs))
    for ax, values, goal, name in (
        (tps, [r[0] for r in runs], GOAL_TOKENS_PER_S, "output tokens/s"),
        (ttft, [r[1] for r in runs], GOAL_TTFT_P99_MS, "TTFT p99 (ms)"),
    ):
        colors = ["tab:orange" if label.startswith(highlight) else "tab:gray" for label in labels]
        ax.bar(xs, values, color=colors)
        ax.axhline(goal, color="tab:red", linestyle="--", linewidth=1, label=f"goal {goal:,.0f}")
        ax.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--labels", required=True, help="comma-separated, one per run")
    ap.add_argument("--title", default="qwen1.5b-shaped server, 64 streams, H200")
    ap.add_argument("--highlight", default="mixed", help="runs whose label starts with this are drawn in orange")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    labels = args.labels.split(",")
    if len(labels) != len(args.runs):
        ap.error(f"{len(labels)} labels for {len(args.runs)} runs")
    plot([load_run(f) for f in args.runs], labels, args.title, args.out, args.highlight)


if __name__ == "__main__":
    main()
