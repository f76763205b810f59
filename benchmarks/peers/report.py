"""Results of ``bench_peers_cpu.py``: environment, ratios miaohui/peer, JSON, PNG and the printed table."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from miaohui.bench.report import git_commit

GEN_METRICS = {  # metric name → (path into a row, "lower" or "higher" is better)
    "ttft_p50_ms": (("ttft_ms", "p50"), "lower"),
    "ttft_p99_ms": (("ttft_ms", "p99"), "lower"),
    "tpot_p50_ms": (("tpot_ms", "p50"), "lower"),
    "tpot_p99_ms": (("tpot_ms", "p99"), "lower"),
    "tokens_per_s": (("tokens_per_s",), "higher"),
}
INTENT_METRICS = {
    "req_per_s": (("req_per_s",), "higher"),
    "p50_ms": (("latency_ms", "p50"), "lower"),
    "p99_ms": (("latency_ms", "p99"), "lower"),
}


def _get(row: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = row
    for key in path:
        value = value[key]
    return float(value)


def cpu_model() -> str:
    """``lscpu``'s "Model name" (or /proc/cpuinfo's, or the platform's processor)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def environment(root: Path, argv: list[str], install: dict[str, Any], project_versions: dict[str, str]) -> dict:
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = sorted(
                    set(line.split(":", 1)[1].split()) & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "fma"}
                )
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": git_commit() or "unknown",
        "cpu": cpu_model(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_flags": flags,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *argv]),
        "project_versions": project_versions,
        "peers_installed": install,
    }


def ratios(rows: list[dict[str, Any]], level_key: str, metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """For every miaohui row and every peer row at the same level: miaohui / peer per metric.

    Latency ratios below 1 and throughput ratios above 1 mean miaohui is better; ``miaohui_better`` says which."""
    out = []
    ours = [r for r in rows if r["server"].startswith("miaohui") and "error" not in r]
    peers = [r for r in rows if not r["server"].startswith("miaohui") and "error" not in r]
    for m in ours:
        for p in peers:
            if p[level_key] != m[level_key]:
                continue
            entry: dict[str, Any] = {"miaohui": m["server"], "peer": p["server"], level_key: m[level_key]}
            for name, (path, better) in metrics.items():
                a, b = _get(m, path), _get(p, path)
                r = a / b if b else float("nan")
                entry[name] = {"ratio": r, "miaohui_better": (r < 1) if better == "lower" else (r > 1)}
            out.append(entry)
    return out


def write(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def generation_table(doc: dict[str, Any]) -> str:
    head = (
        f"{'server':<26}{'streams':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
        f"{'tok/s':>8}{'load':>6}  gate"
    )
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        if "error" in r:
            lines.append(f"{r['server']:<26}{r['streams']:>8}  error: {r['error'][:60]}")
            continue
        lines.append(
            f"{r['server']:<26}{r['streams']:>8}{r['ttft_ms']['p50']:>10.1f}{r['ttft_ms']['p99']:>10.1f}"
            f"{r['tpot_ms']['p50']:>10.1f}{r['tpot_ms']['p99']:>10.1f}{r['tokens_per_s']:>8.1f}"
            f"{r['loadavg_1m_before']:>6.1f}  {_gate(r)}"
        )
    return "\n".join(lines)


def _gate(row: dict[str, Any]) -> str:
    gate = row.get("gate")
    if not gate:
        return "n/a"
    verdict = "pass" if gate["gate_passed"] else "FAIL"
    return f"{verdict} (exact {gate['exact_match']:.0%}, TF {gate['teacher_forced']:.1%})"


def intent_table(doc: dict[str, Any]) -> str:
    head = f"{'server':<26}{'c':>4}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>7}{'load':>6}"
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        if "error" in r:
            lines.append(f"{r['server']:<26}{r['concurrency']:>4}  error: {r['error'][:60]}")
            continue
        lines.append(
            f"{r['server']:<26}{r['concurrency']:>4}{r['req_per_s']:>9.1f}{r['latency_ms']['p50']:>9.1f}"
            f"{r['latency_ms']['p99']:>9.1f}{r['errors']:>7}{r['loadavg_1m_before']:>6.1f}"
        )
    return "\n".join(lines)


def ratio_table(entries: list[dict[str, Any]], level_key: str, metrics: dict[str, Any]) -> str:
    head = f"{'miaohui / peer':<44}{level_key:>8}" + "".join(f"{m:>14}" for m in metrics)
    lines = [head, "-" * len(head)]
    for e in entries:
        cells = "".join(f"{e[m]['ratio']:>13.2f}{'+' if e[m]['miaohui_better'] else '-'}" for m in metrics)
        lines.append(f"{e['miaohui'] + ' / ' + e['peer']:<44}{e[level_key]:>8}{cells}")
    lines.append("(+: miaohui better on that metric, -: the peer)")
    return "\n".join(lines)


def _bars(ax: Any, rows: list[dict[str, Any]], level_key: str, path: tuple[str, ...], title: str, log: bool) -> None:
    import numpy as np

    servers = list(dict.fromkeys(r["server"] for r in rows))
    levels = sorted({r[level_key] for r in rows})
    width = 0.8 / max(len(servers), 1)
    x = np.arange(len(levels))
    for i, server in enumerate(servers):
        vals = []
        for lv in levels:
            row = next((r for r in rows if r["server"] == server and r[level_key] == lv and "error" not in r), None)
            vals.append(_get(row, path) if row else float("nan"))
        ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=server)
    ax.set_xticks(x, [f"{level_key} {lv}" for lv in levels])
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.grid(True, axis="y", which="both", alpha=0.3)


def plot(doc: dict[str, Any], path: Path, level_key: str, panels: list[tuple[tuple[str, ...], str, bool]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6), constrained_layout=True)
    for ax, (metric_path, title, log) in zip(axes, panels, strict=True):
        _bars(ax, rows, level_key, metric_path, title, log)
    axes[0].legend(fontsize=7)
    env = doc["environment"]
    loads = [r["loadavg_1m_before"] for r in rows if "loadavg_1m_before" in r]
    fig.suptitle(
        f"{doc['title']} — {env['cpu']}, {env['cores_usable']} cores; 1-min load {min(loads, default=0):.1f}–"
        f"{max(loads, default=0):.1f} (shared machine)",
        fontsize=9,
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)
