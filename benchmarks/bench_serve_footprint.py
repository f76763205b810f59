"""What a serving process costs: time to ready and resident memory of ``miaohui serve`` on one repository, for one
or more source trees side by side (for example the tree before and after a change), several runs each.

    python benchmarks/bench_serve_footprint.py --repository R --tree before=/path/to/old/src --tree after=src \\
        --runs 3 --out benchmarks/results/serve_footprint_cpu.json

Each run starts a fresh interpreter (``python -m miaohui.cli serve``, the tree's ``src`` first on PYTHONPATH),
polls ``/v2/health/ready`` every 50 ms and, once ready, reads the resident set size of the server process and its
children (psutil) and whether torch / transformers / onnx are loaded (``/proc/<pid>/maps``). Medians are reported.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from miaohui.bench.report import git_commit

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mapped(pid: int, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` have a shared library mapped into process ``pid``."""
    text = Path(f"/proc/{pid}/maps").read_text()
    return [n for n in names if f"/{n}/" in text]


def one_run(src: Path, repository: Path, timeout_s: float) -> dict[str, object]:
    port, grpc_port = free_port(), free_port()
    env = os.environ | {"PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "miaohui.cli", "serve", "-r", str(repository), "--port", str(port)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "--grpc-port", str(grpc_port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server from {src} exited with {proc.returncode}")
            if time.perf_counter() - started > timeout_s:
                raise SystemExit(f"the server from {src} was not ready after {timeout_s} s")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready_s = time.perf_counter() - started
        server = psutil.Process(proc.pid)
        rss = server.memory_info().rss + sum(c.memory_info().rss for c in server.children(recursive=True))
        libs = mapped(proc.pid, ("torch", "transformers", "onnx", "onnxruntime", "xllamacpp"))
        return {"ready_s": round(ready_s, 3), "rss_mb": round(rss / 2**20, 1), "libraries_mapped": libs}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, required=True)
    ap.add_argument("--tree", action="append", required=True, help="NAME=SRC_DIR (a tree's src folder)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in trees}
    for _ in range(args.runs):  # interleaved, so a change in the machine's load touches every tree alike
        for name, src in trees.items():
            runs[name].append(one_run(Path(src).resolve(), args.repository, args.timeout))
    summary = {
        name: {
            "ready_s_median": statistics.median(float(r["ready_s"]) for r in rs),  # type: ignore[arg-type]
            "rss_mb_median": statistics.median(float(r["rss_mb"]) for r in rs),  # type: ignore[arg-type]
            "libraries_mapped": rs[-1]["libraries_mapped"],
        }
        for name, rs in runs.items()
    }
    result = {
        "benchmark": "serve_footprint",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit() or "unknown",
        "hardware": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_1min": round(os.getloadavg()[0], 1),
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "repository": sorted(p.name for p in args.repository.iterdir() if p.is_dir()),
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'tree':<10} {'ready s':>8} {'RSS MB':>8}  libraries mapped")
    for name, s in summary.items():
        print(f"{name:<10} {s['ready_s_median']:>8.2f} {s['rss_mb_median']:>8.1f}  {', '.join(s['libraries_mapped'])}")


if __name__ == "__main__":
    main()
