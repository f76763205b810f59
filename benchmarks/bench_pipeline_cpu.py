"""End-to-end dialogue pipeline latency over HTTP on this CPU: ``POST /v1/dialogue/{pipeline}`` at
concurrency 1 and 16, non-generative intents only, with the share of each stage.

    .venv/bin/python benchmarks/bench_pipeline_cpu.py [--repository var/repository] [--model intent]
        [--requests 400] [--out benchmarks/results]

* The server is ``miaohui.server.app.build_app`` (plus the dialogue router while it is not wired in) in
  its own process under uvicorn on 127.0.0.1, serving ``--model`` of ``--repository``; by default the
  intent model ``miaohui prepare`` trains (``--source``) built as ORT int8 into
  ``$MIAOHUI_HOME/bench/pipeline-repo`` (reused while its build key holds). The client is one asyncio
  process (httpx, keep-alive) with N workers for concurrency N; both share this machine's cores, as a
  co-located client would.
* Workload: the seeds' non-generative turns (knowledge-base answers, bookings, hand-offs) of all four
  pipelines, cycled in a fixed order, each a new session; replies that took the ``llm`` route would be
  excluded and counted (none should). ``timings: true`` gives the server's per-stage times.
* Per configuration: warm-up requests, then ``--requests`` measured. Latency = client send → response
  parsed; p50/p99 over all measured requests. Stage shares = mean stage time / mean client latency, with
  ``http`` = client latency − server pipeline total (HTTP, JSON, framework, scheduling).
* The machine is shared: the 1-minute load average is recorded before each configuration, and a run waits
  (up to ``--max-wait`` s) while it is above ``--max-load``.

Goal (issue 6): p99 ≤ 300 ms at both concurrencies. Writes ``pipeline_cpu.json`` and ``pipeline_cpu.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from miaohui.bench.report import git_commit

GOAL_P99_MS = 300.0
STAGES = ("normalize", "intent", "reply", "compliance")
WORKLOAD: list[tuple[str, str]] = [
    ("bank_advisor", "我想买一只稳健型基金，年化收益5%左右"),
    ("gov_hotline", "查社保"),
    ("meeting_assistant", "帮我订明天上午九点的会议室"),
    ("bank_advisor", "五年定期存款利率是多少？"),
    ("gov_hotline", "我在朝阳区，社保断缴了怎么补缴？"),
    ("negotiation_coach", "你好"),
    ("bank_advisor", "我的银行卡丢了"),
    ("gov_hotline", "公积金怎么提取"),
    ("meeting_assistant", "取消预订"),
    ("bank_advisor", "I want a conservative fund with about 3% annual return"),
    ("bank_advisor", "赎回基金多久到账"),
    ("gov_hotline", "转人工"),
]


# ---- server (child process) ------------------------------------------------------------------------------
def serve(repository: Path, model: str, port: int) -> None:
    import uvicorn

    from miaohui.server.app import build_app

    app = build_app(repository, [model])
    if not any(getattr(r, "path", None) == "/v1/dialogue/{pipeline}" for r in app.router.routes):
        from miaohui.server.dialogue_api import DialogueService, dialogue_router

        state = app.state.miaohui
        service = DialogueService.for_manager(state.manager, state.metrics, intent_model=model)
        app.include_router(dialogue_router(service))
    loop = "uvloop" if _has("uvloop") else "asyncio"
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop=loop)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(repository: Path, model: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, __file__, "--serve", str(port), "--repository", str(repository), "--model", model]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                return proc, url
            failed = [r for r in httpx.post(url + "/v2/repository/index", timeout=1).json() if r.get("reason")]
            if failed:
                proc.kill()
                raise SystemExit(f"the model did not load: {failed}")
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready in 300 s")


# ---- client --------------------------------------------------------------------------------------------
async def run_config(url: str, concurrency: int, requests: int, warmup: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await _drive(client, concurrency, warmup, itertools.cycle(WORKLOAD))
        wall = time.perf_counter()
        rows = await _drive(client, concurrency, requests, itertools.cycle(WORKLOAD))
        wall = time.perf_counter() - wall
    return _summary(rows, concurrency, wall)


async def _drive(
    client: httpx.AsyncClient, concurrency: int, n: int, work: itertools.cycle[tuple[str, str]]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            pipeline, text = next(work)
            t0 = time.perf_counter()
            r = await client.post(f"/v1/dialogue/{pipeline}", json={"text": text, "timings": True})
            body = r.json()
            ms = (time.perf_counter() - t0) * 1000
            if r.status_code != 200:
                raise SystemExit(f"{pipeline} {text!r}: HTTP {r.status_code} {body}")
            rows.append({"pipeline": pipeline, "ms": ms, "strategy": body["strategy"], **body["timings"]})

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rows


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _summary(rows: list[dict[str, Any]], concurrency: int, wall: float) -> dict[str, Any]:
    kept = [r for r in rows if r["strategy"] != "llm"]
    ms = [r["ms"] for r in kept]
    mean = statistics.fmean(ms)
    stage_ms = {s: statistics.fmean(r[f"{s}_ms"] for r in kept) for s in STAGES}
    server_total = [r["total_ms"] for r in kept]
    stage_ms["http"] = mean - statistics.fmean(server_total)
    return {
        "concurrency": concurrency,
        "requests": len(kept),
        "excluded_llm": len(rows) - len(kept),
        "throughput_rps": len(rows) / wall,
        "latency_ms": {
            "p50": percentile(ms, 50),
            "p90": percentile(ms, 90),
            "p99": percentile(ms, 99),
            "mean": mean,
            "max": max(ms),
        },
        "server_total_ms": {"p50": percentile(server_total, 50), "p99": percentile(server_total, 99)},
        "stage_mean_ms": stage_ms,
        "stage_share": {k: v / mean for k, v in stage_ms.items()},
        "goal_met": percentile(ms, 99) <= GOAL_P99_MS,
    }


def wait_for_quiet(max_load: float, max_wait: float) -> dict[str, float]:
    waited = 0.0
    load = os.getloadavg()[0]
    while load > max_load and waited < max_wait:
        print(f"load average {load:.2f} > {max_load}: waiting", flush=True)
        time.sleep(10)
        waited += 10
        load = os.getloadavg()[0]
    return {"load1": round(load, 2), "waited_s": waited}


# ---- report --------------------------------------------------------------------------------------------
def environment(repository: Path, model: str) -> dict[str, Any]:
    from miaohui.engines.store import read_manifest, resolve_artifact
    from miaohui.engines.target import cpu_name

    versions = {}
    for pkg in ("miaohui", "onnxruntime", "numpy", "fastapi", "uvicorn", "httpx", "pydantic", "tokenizers"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    m = read_manifest(resolve_artifact(model, repository))
    commit = git_commit() or "unknown"
    return {
        "cpu": cpu_name(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "engine": {"name": m.name, "version": m.version, "backend": m.backend, "precision": m.precision},
        "git_commit": commit,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = doc["results"]
    labels = [f"concurrency {r['concurrency']}" for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    ax1.bar(x - 0.18, [r["latency_ms"]["p50"] for r in rows], 0.36, label="p50")
    ax1.bar(x + 0.18, [r["latency_ms"]["p99"] for r in rows], 0.36, label="p99")
    ax1.axhline(GOAL_P99_MS, color="tab:red", linestyle="--", label=f"goal p99 ≤ {GOAL_P99_MS:.0f} ms")
    ax1.set_xticks(x, labels)
    ax1.set_ylabel("ms (client, over HTTP)")
    ax1.set_yscale("log")
    ax1.set_title("end-to-end pipeline latency")
    ax1.legend()
    ax1.grid(True, axis="y", which="both", alpha=0.3)
    bottom = np.zeros(len(rows))
    for stage in (*STAGES, "http"):
        vals = np.array([r["stage_mean_ms"][stage] for r in rows])
        ax2.bar(x, vals, 0.5, bottom=bottom, label=stage)
        bottom += vals
    ax2.set_xticks(x, labels)
    ax2.set_ylabel("mean ms per request")
    ax2.set_title("where the time goes (mean)")
    ax2.legend()
    env = doc["environment"]
    fig.suptitle(f"{env['cpu']} ({env['cores_usable']} cores), {env['engine']['backend']} {env['engine']['precision']}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(doc: dict[str, Any]) -> str:
    head = "| concurrency | requests | p50 ms | p99 ms | req/s | normalize | intent | reply | compliance | http "
    lines = [head + "| p99 ≤ 300 ms |", "|" + "---|" * 11]
    for r in doc["results"]:
        sh, lat = r["stage_share"], r["latency_ms"]
        shares = " | ".join(f"{sh[s]:.0%}" for s in (*STAGES, "http"))
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {lat['p50']:.1f} | {lat['p99']:.1f} | "
            f"{r['throughput_rps']:.0f} | {shares} | {'yes' if r['goal_met'] else 'NO'} |"
        )
    return "\n".join(lines)


def bench_repository(source: Path) -> Path:
    """``$MIAOHUI_HOME/bench/pipeline-repo`` with ``intent`` = ``source`` as ORT int8 (train split as
    calibration), built once and reused while the build key holds."""
    from miaohui.engines.store import build_artifact
    from miaohui.paths import home
    from miaohui.prepare import default_config
    from miaohui.zoo.intents import load_split

    if not source.is_dir():
        raise SystemExit(f"no intent model at {source}: run `miaohui prepare` (or pass --source / --repository)")
    repository = home() / "bench" / "pipeline-repo"
    texts = [x.text for x in load_split("train")]
    build_artifact(source, "intent", default_config("onnxruntime", "int8"), repository, calib_texts=texts, log=print)
    return repository


def main() -> None:
    from miaohui.paths import models_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repository", type=Path, default=None, help="serve this repository as it is")
    ap.add_argument("--source", type=Path, default=None, help="intent model to build (default: miaohui prepare's)")
    ap.add_argument("--model", default="intent")
    ap.add_argument("--requests", type=int, default=400, help="measured requests per concurrency")
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--max-load", type=float, default=2.5)
    ap.add_argument("--max-wait", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.repository, args.model, args.serve)
        return
    repository = args.repository or bench_repository(args.source or models_dir() / "intent-e5-small")
    if not (repository / args.model).is_dir():
        raise SystemExit(f"no model {args.model!r} in {repository}")
    proc, url = start_server(repository, args.model)
    results = []
    try:
        for c in (int(v) for v in args.concurrency.split(",")):
            load = wait_for_quiet(args.max_load, args.max_wait)
            r = asyncio.run(run_config(url, c, args.requests * (4 if c > 1 else 1), args.warmup))
            r["load_before"] = load
            r["load_after"] = round(os.getloadavg()[0], 2)
            results.append(r)
            lat = r["latency_ms"]
            print(f"concurrency {c}: p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    doc = {
        "benchmark": "dialogue pipeline end to end over HTTP, non-generative intents",
        "goal_p99_ms": GOAL_P99_MS,
        "workload": [{"pipeline": p, "text": t} for p, t in WORKLOAD],
        "environment": environment(repository, args.model),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_cpu.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1), encoding="utf-8")
    plot(doc, args.out / "pipeline_cpu.png")
    print(table(doc))


if __name__ == "__main__":
    main()
