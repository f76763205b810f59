"""Turn what the load generator measured into the report: percentiles, throughput, error accounting,
client health, and the JSON document (schema ``miaohui-bench/1``) with hardware, versions and command."""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from miaohui.bench.load import LoadPlan, RawRun

SCHEMA = "miaohui-bench/1"
PERCENTILES = (50, 90, 99)
CLIENT_BUSY = 0.85
"""Client CPU share (per process) above which the client itself may limit the measurement."""
CLIENT_LAG_MS = 5.0
"""Event-loop lag (p99) or open-loop send lag (p99) above which the same warning is given."""
_PACKAGES = (
    "miaohui",
    "numpy",
    "httpx",
    "uvicorn",
    "fastapi",
    "grpcio",
    "tritonclient",
    "onnxruntime",
    "torch",
    "uvloop",
)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the smallest value with at least ``q``% of values ≤ it); NaN when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) / 100 - 1e-9))  # tolerance: 99.9% of 1000 is rank 999
    return float(ordered[rank - 1])


def latency_stats(seconds: Sequence[float]) -> dict[str, float]:
    """min, mean, p50, p90, p99, p99.9 and max, in milliseconds (NaN when empty)."""
    ms = sorted(s * 1e3 for s in seconds)
    out = {"n": float(len(ms)), "min": ms[0] if ms else math.nan, "mean": sum(ms) / len(ms) if ms else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(ms, q)
    out["p99.9"] = percentile(ms, 99.9)
    out["max"] = ms[-1] if ms else math.nan
    return out


def error_groups(errors: dict[str, int]) -> dict[str, int]:
    """Error labels folded into the columns of the table: 429, 503, 504, other 4xx, other 5xx, connection,
    timeout, other."""
    out = dict.fromkeys(("429", "503", "504", "4xx", "5xx", "connection", "timeout", "other"), 0)
    for label, n in errors.items():
        if label in out:
            out[label] += n
        elif label.isdigit() and label.startswith("4"):
            out["4xx"] += n
        elif label.isdigit() and label.startswith("5"):
            out["5xx"] += n
        else:
            out["other"] += n
    return out


def summarize(raw: RawRun, plan: LoadPlan, server: dict[str, Any] | None = None) -> dict[str, Any]:
    """One point of the report: what was sent, how each request ended, latency of the successes."""
    counts = Counter(raw.status)
    ok = counts.pop("ok", 0)
    errors = dict(sorted(counts.items()))
    answered_or_failed = ok + sum(errors.values())
    start = raw.first_send if math.isfinite(raw.first_send) else plan.warmup_s
    window = max(raw.last_done - start, 1e-9) if raw.status else 0.0
    ok_lat = [lat for lat, st in zip(raw.latency_s, raw.status, strict=True) if st == "ok"]
    point: dict[str, Any] = {
        "mode": plan.mode,
        "concurrency": int(plan.level) if plan.mode == "closed" else None,
        "rate": plan.level if plan.mode == "open" else None,
        "sent": raw.sent,
        "answered": ok,
        "errors": errors,
        "error_groups": error_groups(errors),
        "error_count": sum(errors.values()),
        "lost": raw.sent - answered_or_failed,
        "window_s": window,
        "throughput_rps": ok / window if window else 0.0,
        "sent_rps": raw.sent / window if window else 0.0,
        "latency_ms": latency_stats(ok_lat),
        "client": client_health(raw, plan, in_process="infer_s" in raw.target_stats),
        "server": server,
    }
    if "infer_s" in raw.target_stats:
        point["engine"] = {
            "backend": raw.target_stats.get("engine_backend"),
            "precision": raw.target_stats.get("engine_precision"),
            "tokenize_ms": latency_stats(raw.target_stats.get("tokenize_s", [])),
            "infer_ms": latency_stats(raw.target_stats["infer_s"]),
        }
    return point


def client_health(raw: RawRun, plan: LoadPlan, in_process: bool = False) -> dict[str, Any]:
    """Is the load generator itself the bottleneck? CPU share per process, loop lag, open-loop send lag.

    ``saturated``: the client's own CPU or its open-loop schedule is behind, so the measured throughput is
    the client's, not the server's. ``contended``: the event loop wakes late although the client is mostly
    idle, i.e. other processes hold the CPU; latencies then include that scheduling delay. ``in_process``
    (target ``engine``): the engine computes in this process, so its CPU is the engine's, not overhead."""
    busy = raw.cpu_s / (raw.wall_s * max(1, raw.processes)) if raw.wall_s else 0.0
    loop_p99 = percentile(raw.loop_lag_s, 99) * 1e3 if raw.loop_lag_s else 0.0
    send_p99 = percentile(raw.send_lag_s, 99) * 1e3 if raw.send_lag_s else 0.0
    reasons: list[str] = []
    if not in_process and busy > CLIENT_BUSY:
        reasons.append(f"client CPU {busy:.0%} of a core per process")
    if not in_process and send_p99 > CLIENT_LAG_MS and busy > CLIENT_BUSY / 2:
        reasons.append(f"open-loop send lag p99 {send_p99:.1f} ms")
    lag = max(loop_p99, send_p99)
    contended = not reasons and not in_process and lag > CLIENT_LAG_MS
    if in_process:
        note = f"engine in this process: {busy:.0%} CPU per process is the engine's (tokenize + infer)"
    elif reasons:
        note = "the client may limit this point (" + "; ".join(reasons) + "): add --processes"
    elif contended:
        note = (
            f"the client's event loop wakes up to {lag:.1f} ms late (p99) at {busy:.0%} client CPU: the "
            "machine is busy with other work, and latencies include that scheduling delay"
        )
    else:
        note = f"client not saturated ({busy:.0%} CPU, loop lag p99 {loop_p99:.1f} ms)"
    return {
        "processes": raw.processes,
        "cpu_busy": busy,
        "cpu_us_per_request": raw.cpu_s / raw.sent_total * 1e6 if raw.sent_total else 0.0,
        "loop_lag_p99_ms": loop_p99,
        "send_lag_p99_ms": send_p99,
        "saturated": bool(reasons),
        "contended": contended,
        "note": note,
    }


def environment() -> dict[str, Any]:
    """Hardware and software of the machine that ran the load (not necessarily the server's)."""
    import psutil

    versions: dict[str, str | None] = {}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    freq = psutil.cpu_freq()
    return {
        "host": platform.node(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_model(),
        "cpu_logical": os.cpu_count(),
        "cpu_physical": psutil.cpu_count(logical=False),
        "cpu_mhz": freq.max or freq.current if freq else None,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": _gpus(),
        "versions": versions,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        names = [
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())
        ]
        return [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    except Exception:
        return []


def git_commit() -> str | None:
    """HEAD of the git checkout miaohui runs from (``+dirty`` when tracked files differ), None outside one.
    ``MIAOHUI_COMMIT`` overrides it: a copy of a working tree whose git metadata is not its files' (the lent GPU
    machine's copy keeps an older ``.git``) says which commit it runs."""
    import os
    import subprocess
    from pathlib import Path

    if os.environ.get("MIAOHUI_COMMIT"):
        return os.environ["MIAOHUI_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno"], cwd=here, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def make_document(command: str, config: dict[str, Any], points: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": git_commit(),
        "command": command,
        "config": config,
        "environment": environment(),
        "points": points,
    }


_POINT_KEYS: dict[str, type] = {
    "mode": str,
    "sent": int,
    "answered": int,
    "errors": dict,
    "error_groups": dict,
    "error_count": int,
    "lost": int,
    "window_s": float,
    "throughput_rps": float,
    "latency_ms": dict,
    "client": dict,
}


def validate_document(doc: dict[str, Any]) -> list[str]:
    """Problems with a report document (empty when it is well formed and every request is accounted for)."""
    problems = []
    top: dict[str, type] = {"schema": str, "command": str, "config": dict, "environment": dict, "points": list}
    for key, kind in top.items():
        if not isinstance(doc.get(key), kind):
            problems.append(f"{key!r} missing or not a {kind.__name__}")
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    for i, point in enumerate(doc.get("points") or []):
        for key, kind in _POINT_KEYS.items():
            value = point.get(key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                problems.append(f"points[{i}].{key} missing or not {kind}")
        if not problems and point["sent"] != point["answered"] + point["error_count"]:
            problems.append(
                f"points[{i}]: sent {point['sent']} != answered {point['answered']} "
                f"+ errors {point['error_count']} ({point['lost']} lost)"
            )
        for q in ("p50", "p90", "p99", "max", "mean"):
            if q not in point.get("latency_ms", {}):
                problems.append(f"points[{i}].latency_ms.{q} missing")
    return problems


def level_label(point: dict[str, Any]) -> str:
    return f"c={point['concurrency']}" if point["mode"] == "closed" else f"{point['rate']:g}/s"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def to_json(doc: dict[str, Any]) -> str:
    """Strict JSON: NaN/inf (e.g. percentiles of no successes) become null."""
    import json

    return json.dumps(_finite(doc), indent=1, ensure_ascii=False, allow_nan=False)
