"""The server's host path alone (issue 3 overhead, issue 4 ``--workers``): a tiny random-weight intent engine
(ONNX Runtime fp32, ~0.3 ms per row) behind ``miaohui serve``, so what is measured is HTTP/gRPC, JSON, batching,
thread hops and metrics — not the model. Concurrency 1 runs without dynamic batching (every request alone: the
per-request overhead), higher concurrency with it (the model's default batching config).

    .venv/bin/python benchmarks/bench_server_hostpath.py                         # this tree, workers 1 and 2
    git archive HEAD src | tar -x -C /tmp/base                                   # an older tree to compare with
    .venv/bin/python benchmarks/bench_server_hostpath.py --baseline-src /tmp/base/src --rounds 2

Each (tree, workers, target, concurrency) point starts a fresh server (``python -m miaohui.cli serve``; the
baseline tree through ``PYTHONPATH``), runs ``miaohui bench`` against it and stops it; trees and worker counts are
interleaved round by round, because this machine is shared and its load drifts. Writes ``server_hostpath_cpu.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from miaohui.bench.report import environment, git_commit
from miaohui.bench.scrape import fetch_metrics, gc_pauses

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_repository(root: Path) -> Path:
    from miaohui.config import BuildConfig
    from miaohui.engines.store import build_artifact
    from miaohui.models.tiny import save_tiny_intent
    from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config

    ckpt = save_tiny_intent(root / "tiny-intent")
    warmup = [WarmupShape(batch=1, sequence=8), WarmupShape(batch=16, sequence=16)]
    for name, batching in (("batching", True), ("no-batching", False)):
        repo = root / name
        build_artifact(ckpt, "intent", BuildConfig(precision="fp32"), repo, log=lambda m: None)
        config = ModelConfig(threads=1, dynamic_batching=batching, warmup=warmup)
        write_model_config(repo / "intent" / "config.yaml", config)
    return root


def run_point(
    repo: Path,
    src: Path | None,
    workers: int,
    target: str,
    level: int,
    args: argparse.Namespace,
    work: Path,
    shared_engine: bool = False,
    gc_freeze: bool = True,
) -> dict[str, Any]:
    port, grpc_port = free_port(), free_port()
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    cmd = [sys.executable, "-m", "miaohui.cli", "serve", "-r", str(repo), "--port", str(port)]
    cmd += ["--grpc-port", str(grpc_port), "--models", "intent"]
    if workers > 1:
        cmd += ["--workers", str(workers)]
    if shared_engine:
        cmd += ["--shared-engine"]
    if not gc_freeze:
        cmd += ["--no-gc-freeze"]
    log = work / f"server-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline, seen = time.monotonic() + 180, set()
        while len(seen) < workers:  # every worker answered ready (each accepts only once warm)
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start: {log.read_text()[-2000:]}")
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2)
                if r.status_code == 200:
                    seen.add(r.json().get("worker", 0))
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        out_json = work / f"bench-{port}.json"
        bench = [sys.executable, "-m", "miaohui.cli", "bench", "--target", target]
        bench += ["--url", f"http://127.0.0.1:{port}", "--grpc-url", f"127.0.0.1:{grpc_port}"]
        bench += ["--concurrency", str(level), "--duration", f"{args.duration}s", "--warmup", "1s"]
        bench += ["--out", str(out_json)]
        before = fetch_metrics(f"http://127.0.0.1:{port}")
        subprocess.run(bench, check=True, capture_output=True, cwd=ROOT)
        point = json.loads(out_json.read_text())["points"][0]
        after = fetch_metrics(f"http://127.0.0.1:{port}")
        point["gc_pauses"] = gc_pauses(before, after) if after is not None else {}
    finally:
        proc.terminate()
        proc.wait(60)
    point["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--baseline-src", type=Path, default=None, help="an older tree's src/ to compare with")
    ap.add_argument("--workers", default="1,2", help="worker counts; '2s' = 2 workers with --shared-engine")
    ap.add_argument("--targets", default="http,v2-http,grpc")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--gc-freeze", default="on", help="'on', 'off' or 'on,off': the servers' gc.freeze() (A/B)")
    ap.add_argument("--build-only", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "server_hostpath_cpu.json")
    args = ap.parse_args()
    if args.build_only:
        tiny_repository(args.build_only)
        return
    work = Path(tempfile.mkdtemp(prefix="miaohui-hostpath-"))
    os.environ.setdefault("MIAOHUI_HOME", str(work / "home"))
    trees: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.baseline_src:
        trees.insert(0, ("baseline", args.baseline_src.resolve()))
    repos: dict[str, Path] = {}
    for name, src in trees:  # each tree builds its own artifact (the manifest format may differ between trees)
        env = os.environ | ({"PYTHONPATH": str(src)} if src else {})
        root = work / name.replace(" ", "-")
        subprocess.run([sys.executable, __file__, "--build-only", str(root)], check=True, env=env, cwd=ROOT)
        repos[name] = root
    rows = []
    for rnd in range(args.rounds):
        for target in args.targets.split(","):
            for level in (int(c) for c in args.concurrency.split(",")):
                for name, src in trees:
                    for spec, freeze in itertools.product(args.workers.split(","), args.gc_freeze.split(",")):
                        workers, shared = int(spec.rstrip("s")), spec.endswith("s")
                        if src is not None and workers > 1:
                            continue  # the baseline may predate --workers
                        repo = repos[name] / ("batching" if level > 1 else "no-batching")
                        p = run_point(repo, src, workers, target, level, args, work, shared, freeze == "on")
                        lat, srv = p["latency_ms"], p.get("server") or {}
                        other = srv.get("other_ms")
                        row = {"round": rnd, "tree": name, "workers": workers, "target": target, "concurrency": level}
                        row["shared_engine"] = shared
                        row["gc_freeze"], row["gc_pauses"] = freeze, p["gc_pauses"]
                        row |= {"throughput_rps": p["throughput_rps"], "latency_ms": lat, "errors": p["error_count"]}
                        row |= {"server_other_ms": other, "load_avg_after": p["load_avg_after"]}
                        rows.append(row)
                        full = p["gc_pauses"].get("2", {})
                        print(
                            f"{name:<10} w={spec:<2} gc.freeze {freeze:<3} {target:<8} c={level:<3} "
                            f"{p['throughput_rps']:8.1f} req/s  p50 {lat['p50']:7.3f}  p99 {lat['p99']:7.2f}  "
                            f"max {lat['max']:7.1f} ms  errors {p['error_count']}  full collections "
                            f"{full.get('collections', 0):.0f} ({full.get('total_ms', 0):.0f} ms)  "
                            f"load {p['load_avg_after'][0]:.2f}",
                            flush=True,
                        )
    doc = {
        "benchmark": "server host path: tiny engine behind miaohui serve (HTTP /v1/intent, KServe HTTP, gRPC)",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "git_commit": git_commit() or "unknown",
        "environment": environment() | {"cores_usable": len(os.sched_getaffinity(0))},
        "engine": "random-weight BERT (hidden 32, 2 layers), ONNX Runtime fp32, 1 thread; dynamic batching (default "
        "config) for concurrency > 1, off at concurrency 1",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
