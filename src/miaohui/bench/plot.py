"""The PNG: latency percentiles against achieved throughput (one marker per load level), and throughput
against the load level. Matplotlib's Agg backend; no display needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miaohui.bench.report import level_label


def plot_points(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    points = [p for p in doc["points"] if p["answered"]]
    fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    tput = [p["throughput_rps"] for p in points]
    for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-"), ("max", "x:")):
        ax_lat.plot(tput, [p["latency_ms"][q] for p in points], style, label=q)
    for p in points:
        ax_lat.annotate(
            level_label(p),
            (p["throughput_rps"], p["latency_ms"]["p99"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax_lat.set(
        xlabel="throughput (answered requests/s)", ylabel="latency (ms)", yscale="log", title="latency vs throughput"
    )
    ax_lat.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_lat.yaxis.set_major_formatter(ScalarFormatter())
    ax_lat.yaxis.set_minor_formatter(NullFormatter())
    ax_lat.grid(True, which="both", alpha=0.3)
    ax_lat.legend()

    closed = all(p["mode"] == "closed" for p in doc["points"])
    levels = [p["concurrency"] if closed else p["rate"] for p in doc["points"]]
    ax_tp.plot(levels, [p["throughput_rps"] for p in doc["points"]], "o-", label="answered/s")
    errs = [p["error_count"] / p["window_s"] if p["window_s"] else 0.0 for p in doc["points"]]
    if any(errs):
        ax_tp.plot(levels, errs, "x--", color="tab:red", label="errors/s")
    if not closed:
        ax_tp.plot(levels, levels, ":", color="gray", label="offered")
    ax_tp.set(xlabel="concurrency" if closed else "offered rate (requests/s)", ylabel="requests/s", title="throughput")
    if len(levels) > 1 and min(levels) > 0 and max(levels) / min(levels) >= 8:
        ax_tp.set_xscale("log", base=2)
        ax_tp.set_xticks(levels, [f"{v:g}" for v in levels])
    ax_tp.grid(True, alpha=0.3)
    ax_tp.legend()
    cfg = doc.get("config", {})
    fig.suptitle(
        f"miaohui bench · target {cfg.get('target')} · model {cfg.get('model')} · {doc['environment'].get('cpu', '')}",
        fontsize=9,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
