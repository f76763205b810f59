"""The intent server under closed-loop load on this CPU (issue 3): dynamic batching on vs off, the int8
engine vs PyTorch eager behind the same server, and the server's overhead over the bare engine.

    .venv/bin/python benchmarks/bench_server_cpu.py                      # 10 s per point, c = 1,8,32,64
    .venv/bin/python benchmarks/bench_server_cpu.py --duration 1 --model PATH --work /tmp/w --out /tmp/r

* Engines: the int8 ONNX Runtime ``intent`` engine of ``--repository`` (made, or reused, by
  :func:`miaohui.prepare.prepare_defaults`), and a ``torch`` (eager fp32) artifact of the same checkpoint
  built into ``--work``. ``--model PATH`` builds both from another checkpoint instead (int8 calibrated on
  the train split), e.g. a tiny one to check that the script runs.
* Configurations, each served by a fresh ``python -m miaohui.cli serve`` process on 127.0.0.1 (gRPC off)
  from its own repository under ``--work/configs`` (a link to the artifact and a ``config.yaml``):
  ``int8-batching`` (the model's batching config; the default length buckets 16/32/64/128 where it has
  none), ``int8-no-batching`` (``dynamic_batching: false``: every request runs alone) and ``eager-batching``.
  ``--workers N`` serves each with ``miaohui serve --workers N``; ``--threads``/``--instances`` override the
  engine threads and instances of every configuration. Plus the bare engines (``engine`` target: tokenize +
  ``Engine.infer`` of one text in this process, no server) at concurrency 1.
* Load: :mod:`miaohui.bench` — its closed-loop runner and keep-alive HTTP client on ``POST /v1/intent``,
  a warm-up before every point, a fixed seed, dev-split texts of ``--tokens`` tokens (composed from
  shorter ones where needed), the same texts in the same order for every configuration. ``/metrics`` is
  scraped around each point for the server-side queue / compute / batch-size means.
* The server and the client share this machine's cores, as a co-located client would; the 1-minute load
  average is recorded before and after every point (``--max-load`` waits for a quieter machine).

Ratios against the baselines of the same run: batching on/off throughput at c=32 (goal ≥ 3× with a lower
p99), int8/eager peak throughput (goal ≥ 5×), server overhead = p50 of the server at c=1 − p50 of the bare
engine with one served instance's threads (goal ≤ 1 ms; measured without batching, whose queue delay is a
configured wait, and reported with it too). The bare engines, as served (instances × threads), also
run in length-bucketed batches of 1, 8 and 32 (``engine_ceilings``): their rows/s bound what any server
in front of them can reach, so their batch-32/batch-1 and int8/eager ratios are the ceilings of the first
two goals on this machine.
Writes ``<--name>.json`` and ``.png`` (default ``server_cpu``) to ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from miaohui.bench.cli import parse_levels, parse_token_range
from miaohui.bench.load import LoadPlan
from miaohui.bench.report import environment, git_commit, to_json
from miaohui.bench.sweep import fit_token_range, load_texts, measure, tokenizer_counter
from miaohui.bench.targets import TargetSpec
from miaohui.engines.store import read_manifest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "intent"
GOALS = {"batching_speedup_c32": 3.0, "engine_vs_eager": 5.0, "overhead_p50_ms": 1.0}


@dataclass(frozen=True)
class ServerConfig:
    name: str
    engine: str
    """``int8`` or ``eager``: which artifact the server loads."""
    dynamic_batching: bool


CONFIGS = (
    ServerConfig("int8-batching", "int8", True),
    ServerConfig("int8-no-batching", "int8", False),
    ServerConfig("eager-batching", "eager", True),
)


# ---- engines and per-configuration repositories --------------------------------------------------------
def artifacts(args: argparse.Namespace) -> dict[str, Path]:
    """``{"int8": version dir, "eager": version dir}``, built or reused (build keys)."""
    from miaohui.config import BuildConfig
    from miaohui.engines.store import build_artifact, resolve_artifact
    from miaohui.prepare import default_config, prepare_defaults
    from miaohui.zoo.intents import load_split

    if args.model is None:
        source = prepare_defaults(args.repository)
        int8 = resolve_artifact(MODEL, args.repository)
    else:
        source = args.model
        calib = [x.text for x in load_split("train")]
        cfg = default_config("onnxruntime", "int8")
        int8 = build_artifact(source, MODEL, cfg, args.work / "int8", calib_texts=calib).path
    eager = build_artifact(source, MODEL, BuildConfig(backend="torch"), args.work / "eager").path
    return {"int8": int8, "eager": eager}


def config_repository(
    work: Path,
    cfg: ServerConfig,
    artifact: Path,
    threads: int | None,
    instances: int | None = None,
    queue_delay_ms: float | None = None,
    max_batch_tokens: int | None = None,
) -> Path:
    """``work/configs/<name>/intent/{config.yaml, <version> → artifact}``: the artifact's serving config
    with this configuration's batching mode and backend. A batching config without length buckets (written
    before they became the default) gets the default ones: batches of mixed lengths pad every row to the
    longest, which on this CPU costs more than batching saves."""
    from miaohui.serving.model_config import ModelConfig, load_model_config, write_model_config

    repo = work / "configs" / cfg.name
    if repo.exists():
        shutil.rmtree(repo)
    model_dir = repo / MODEL
    model_dir.mkdir(parents=True)
    (model_dir / artifact.name).symlink_to(artifact.resolve(), target_is_directory=True)
    base = load_model_config(artifact.parent / "config.yaml")
    batching = base.batching
    if not batching.length_buckets:
        batching = batching.model_copy(update={"length_buckets": ModelConfig().batching.length_buckets})
    if instances:
        batching = batching.model_copy(update={"instances": instances})
    if queue_delay_ms is not None:
        batching = batching.model_copy(update={"max_queue_delay_ms": queue_delay_ms})
    if max_batch_tokens is not None:
        batching = batching.model_copy(update={"max_batch_tokens": max_batch_tokens or None})
    update = {"dynamic_batching": cfg.dynamic_batching, "backend": read_manifest(artifact).backend}
    update |= {"threads": threads, "batching": batching}
    write_model_config(model_dir / "config.yaml", base.model_copy(update=update))
    return repo


# ---- server process ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(repo: Path, workers: int = 1, timeout_s: float = 300.0) -> tuple[subprocess.Popen[bytes], str, float]:
    """``miaohui serve`` on a free port; returns once ``/v2/health/ready`` says 200 (and the seconds it took)."""
    port = free_port()
    cmd = [sys.executable, "-m", "miaohui.cli", "serve", "-r", str(repo), "--port", str(port)]
    cmd += ["--grpc-port", "0", "--models", MODEL, "--workers", str(workers)]
    log = (repo / "server.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url, started = f"http://127.0.0.1:{port}", time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}; see {repo / 'server.log'}")
        try:
            if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                return proc, url, time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise SystemExit(f"the server was not ready after {timeout_s:.0f} s; see {repo / 'server.log'}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ---- measuring -----------------------------------------------------------------------------------------
def wait_for_quiet(max_load: float | None, max_wait: float) -> float:
    """Seconds waited while the 1-minute load average was above ``max_load`` (None: never wait)."""
    waited = 0.0
    while max_load is not None and os.getloadavg()[0] > max_load and waited < max_wait:
        print(f"  load average {os.getloadavg()[0]:.2f} > {max_load}: waiting", flush=True)
        time.sleep(5)
        waited += 5
    return waited


def run_point(
    spec: TargetSpec, texts: list[str], level: int, args: argparse.Namespace, metrics_url: str | None
) -> dict[str, Any]:
    waited = wait_for_quiet(args.max_load, args.max_wait)
    load_before = os.getloadavg()
    plan = LoadPlan(
        mode="closed",
        level=level,
        warmup_s=args.warmup,
        duration_s=args.duration,
        seed=args.seed,
        processes=args.processes,
    )
    point = measure(spec, texts, plan, metrics_url)
    point["load_avg_before"] = [round(x, 2) for x in load_before]
    point["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    point["waited_for_quiet_s"] = waited
    lat, srv = point["latency_ms"], point.get("server") or {}
    batch = srv.get("batch_size") or {}
    print(
        f"  c={level:<3} {point['throughput_rps']:8.1f} req/s  p50 {lat['p50']:8.2f}  p99 {lat['p99']:8.2f} ms  "
        f"errors {point['error_count']}  batch {batch.get('mean', float('nan')):.1f}  "
        f"load {load_before[0]:.2f}→{point['load_avg_after'][0]:.2f}",
        flush=True,
    )
    client = point["client"]
    if client["saturated"] or client["contended"]:
        print(f"  warning: {client['note']}", flush=True)
    return point


def run_config(
    cfg: ServerConfig, artifact: Path, texts: list[str], levels: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    repo = config_repository(
        args.work, cfg, artifact, args.threads, args.instances, args.queue_delay_ms, args.max_batch_tokens
    )
    m = read_manifest(artifact)
    print(f"{cfg.name}: {m.backend} {m.precision} ({artifact}), dynamic_batching={cfg.dynamic_batching}", flush=True)
    proc, url, ready_s = start_server(repo, args.workers)
    try:
        spec = TargetSpec(kind="http", url=url, model=MODEL, timeout_s=args.timeout)
        points = [run_point(spec, texts, c, args, url) for c in levels]
    finally:
        stop_server(proc)
    from miaohui.serving.model_config import load_model_config

    served = load_model_config(repo / MODEL / "config.yaml")
    return {
        "name": cfg.name,
        "kind": "server",
        "artifact": str(artifact),
        "backend": m.backend,
        "precision": m.precision,
        "build_key": m.build_key[:12],
        "dynamic_batching": cfg.dynamic_batching,
        "server_workers": args.workers,
        "model_config": served.model_dump(mode="json"),
        "server_ready_s": round(ready_s, 2),
        "points": points,
    }


def served_config(artifact: Path, args: argparse.Namespace) -> Any:
    """The ``ModelConfig`` ``miaohui serve`` uses for ``artifact`` here (``--instances``/``--threads`` applied)."""
    from miaohui.serving.model_config import load_model_config

    cfg = load_model_config(artifact.parent / "config.yaml")
    if args.instances:
        cfg = cfg.model_copy(update={"batching": cfg.batching.model_copy(update={"instances": args.instances})})
    return cfg.model_copy(update={"threads": args.threads}) if args.threads else cfg


def served_instances(artifact: Path, args: argparse.Namespace) -> int:
    return int(served_config(artifact, args).batching.instances)


def served_threads(artifact: Path, args: argparse.Namespace) -> int:
    """Intra-op threads of one served instance of ``artifact`` (the server's own rule)."""
    return int(served_config(artifact, args).instance_threads())


def run_engine(name: str, artifact: Path, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The bare engine with one served instance's threads, at concurrency 1."""
    m = read_manifest(artifact)
    threads = served_threads(artifact, args)
    print(f"{name}: bare engine, {m.backend} {m.precision}, {threads} threads ({artifact})", flush=True)
    spec = TargetSpec(kind="engine", model=MODEL, engine=str(artifact), engine_threads=threads, timeout_s=args.timeout)
    return {
        "name": name,
        "kind": "engine",
        "artifact": str(artifact),
        "backend": m.backend,
        "precision": m.precision,
        "build_key": m.build_key[:12],
        "engine_threads": threads,
        "points": [run_point(spec, texts, 1, args, None)],
    }


def engine_ceiling(name: str, artifact: Path, texts: list[str], args: argparse.Namespace, limit: int) -> dict[str, Any]:
    """The bare engines of the served configuration (its instances, each with its threads, side by side
    in threads of this process) over the first ``limit`` texts in batches of 1, 8 and 32, grouped by the
    server's length buckets and padded to each batch's longest row as the server does: rows/s that no
    server in front of them can exceed, so the ceiling of the batching and int8/eager ratios."""
    from concurrent.futures import ThreadPoolExecutor

    from miaohui.engines.loader import load_engine
    from miaohui.nlp.tokenizer import TextTokenizer, pad_batch, truncate_ids
    from miaohui.serving.model_config import ModelConfig

    threads, instances = served_threads(artifact, args), served_instances(artifact, args)
    engines = [load_engine(artifact, threads=threads) for _ in range(instances)]
    m = engines[0].manifest
    tok = TextTokenizer.from_file(artifact / (m.tokenizer_file or "tokenizer.json"), m.max_length or 512)
    ids = [truncate_ids(x, tok.max_length) for x in tok.token_ids(texts[:limit])]
    buckets = ModelConfig().batching.length_buckets
    by_bucket: dict[int, list[list[int]]] = {}
    for seq in ids:
        by_bucket.setdefault(next((b for b in buckets if len(seq) <= b), buckets[-1]), []).append(seq)
    out: dict[str, Any] = {"name": name, "artifact": str(artifact), "threads": threads, "instances": instances}
    out |= {"rows": len(ids), "rows_per_s": {}}

    def run(engine: Any, feeds: list[dict[str, Any]]) -> None:
        for feed in feeds:
            engine.infer(feed)

    with ThreadPoolExecutor(instances) as pool:
        for size in (1, 8, 32):
            feeds = []
            for group in by_bucket.values():
                for start in range(0, len(group), size):
                    x, mask = pad_batch(group[start : start + size], tok.pad_id)
                    feeds.append({"input_ids": x, "attention_mask": mask})
            list(pool.map(run, engines, [feeds[:2]] * instances))  # warm-up
            started = time.perf_counter()
            list(pool.map(run, engines, [feeds[k::instances] for k in range(instances)]))
            out["rows_per_s"][str(size)] = len(ids) / (time.perf_counter() - started)
            print(f"  {name} batch {size:>3}: {out['rows_per_s'][str(size)]:8.1f} rows/s", flush=True)
    for engine in engines:
        engine.close()
    return out


# ---- ratios and goals ----------------------------------------------------------------------------------
def _point(runs: dict[str, dict[str, Any]], name: str, c: int) -> dict[str, Any] | None:
    run = runs.get(name)
    found = [p for p in run["points"] if p["concurrency"] == c] if run else []
    return found[0] if found and found[0]["answered"] else None


def ratios(runs: dict[str, dict[str, Any]], levels: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"batching": {}, "engine_vs_eager": {}, "overhead": {}}
    for c in levels:
        on, off = _point(runs, "int8-batching", c), _point(runs, "int8-no-batching", c)
        if on and off:
            out["batching"][f"c={c}"] = {
                "throughput_ratio": on["throughput_rps"] / off["throughput_rps"],
                "p99_on_ms": on["latency_ms"]["p99"],
                "p99_off_ms": off["latency_ms"]["p99"],
            }
        eng, eager = on, _point(runs, "eager-batching", c)
        if eng and eager:
            out["engine_vs_eager"][f"c={c}"] = eng["throughput_rps"] / eager["throughput_rps"]
    if "int8-batching" in runs and "eager-batching" in runs:
        peak = {n: max(p["throughput_rps"] for p in runs[n]["points"]) for n in ("int8-batching", "eager-batching")}
        if peak["eager-batching"]:
            out["engine_vs_eager"]["peak"] = peak["int8-batching"] / peak["eager-batching"]
    engine = _point(runs, "engine-int8", 1)
    for name in ("int8-no-batching", "int8-batching"):
        server = _point(runs, name, 1)
        if engine and server:
            out["overhead"][name] = {
                "server_p50_ms": server["latency_ms"]["p50"],
                "engine_p50_ms": engine["latency_ms"]["p50"],
                "overhead_p50_ms": server["latency_ms"]["p50"] - engine["latency_ms"]["p50"],
                "server_other_ms": (server.get("server") or {}).get("other_ms"),
            }
    return out


def ceiling_ratios(ceilings: dict[str, dict[str, Any]]) -> dict[str, float]:
    """What the bare engines allow: int8 rows/s in batches of 32 over single rows (the most batching can
    give), and int8 over eager, both in batches of 32 (the most an int8-backed server can gain)."""
    out: dict[str, float] = {}
    int8, eager = (ceilings.get(k, {}).get("rows_per_s", {}) for k in ("int8", "eager"))
    if int8.get("32") and int8.get("1"):
        out["int8_batch32_over_batch1"] = int8["32"] / int8["1"]
    if int8.get("32") and eager.get("32"):
        out["int8_over_eager_batch32"] = int8["32"] / eager["32"]
    return out


def goals(r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    b32 = r["batching"].get("c=32")
    if b32:
        out["batching_3x_at_c32"] = b32["throughput_ratio"] >= GOALS["batching_speedup_c32"]
        out["batching_lower_p99_at_c32"] = b32["p99_on_ms"] < b32["p99_off_ms"]
    if "peak" in r["engine_vs_eager"]:
        out["engine_5x_eager_peak"] = r["engine_vs_eager"]["peak"] >= GOALS["engine_vs_eager"]
    ov = r["overhead"].get("int8-no-batching")
    if ov:
        out["overhead_p50_le_1ms"] = ov["overhead_p50_ms"] <= GOALS["overhead_p50_ms"]
    return out


# ---- report --------------------------------------------------------------------------------------------
def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    for i, run in enumerate(doc["runs"]):
        pts = [p for p in run["points"] if p["answered"]]
        color, tput = f"C{i}", [p["throughput_rps"] for p in pts]
        style = "*" if run["kind"] == "engine" else "o-"
        ax_lat.plot(tput, [p["latency_ms"]["p50"] for p in pts], style, color=color, label=run["name"])
        ax_lat.plot(tput, [p["latency_ms"]["p99"] for p in pts], "x--", color=color, alpha=0.6)
        for p in pts:
            ax_lat.annotate(f"c={p['concurrency']}", (p["throughput_rps"], p["latency_ms"]["p50"]), fontsize=7)
        ax_tp.plot([p["concurrency"] for p in pts], tput, style, color=color, label=run["name"])
    ax_lat.set(xlabel="throughput (answered req/s)", ylabel="latency ms (p50 solid, p99 dashed)", yscale="log")
    ax_lat.set(xscale="log", title="latency vs throughput")
    ax_tp.set(xlabel="concurrency (closed loop)", ylabel="answered req/s", title="throughput", yscale="log")
    ax_tp.set_xscale("log", base=2)
    for ax in (ax_lat, ax_tp):
        ax.grid(True, which="both", alpha=0.3)
    ax_lat.legend(fontsize=8)
    ax_tp.legend(fontsize=8)
    env = doc["environment"]
    fig.suptitle(f"miaohui intent server on {env['cpu']} ({env['cores_usable']} cores usable), POST /v1/intent")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(doc: dict[str, Any]) -> str:
    head = f"{'configuration':<18} {'c':>3} {'req/s':>8} {'p50':>8} {'p90':>8} {'p99':>8} {'errors':>6}"
    lines = [head + f" {'queue':>7} {'compute':>8} {'batch':>6}   (ms; queue/compute/batch: server means)"]
    for run in doc["runs"]:
        for p in run["points"]:
            lat, srv = p["latency_ms"], p.get("server") or {}

            def mean(key: str, srv: dict[str, Any] = srv) -> str:
                return f"{srv[key]['mean']:.2f}" if srv.get(key) else "-"

            lines.append(
                f"{run['name']:<18} {p['concurrency']:>3} {p['throughput_rps']:>8.1f} {lat['p50']:>8.2f} "
                f"{lat['p90']:>8.2f} {lat['p99']:>8.2f} {p['error_count']:>6} {mean('queue_ms'):>7} "
                f"{mean('compute_ms_per_batch'):>8} {mean('batch_size'):>6}"
            )
    r, g = doc["ratios"], doc["goals"]
    if "c=32" in r["batching"]:
        b, met = r["batching"]["c=32"], _ok(g, "batching_3x_at_c32", "batching_lower_p99_at_c32")
        lines.append(
            f"batching on/off at c=32: {b['throughput_ratio']:.2f}x throughput, p99 {b['p99_on_ms']:.1f} vs "
            f"{b['p99_off_ms']:.1f} ms (goal ≥ 3x, lower p99: {met})"
        )
    if "peak" in r["engine_vs_eager"]:
        per_c = ", ".join(f"{k} {v:.1f}x" for k, v in r["engine_vs_eager"].items() if k != "peak")
        lines.append(
            f"int8 engine / eager, peak throughput: {r['engine_vs_eager']['peak']:.2f}x ({per_c}) "
            f"(goal ≥ 5x: {_ok(g, 'engine_5x_eager_peak')})"
        )
    c = r.get("ceiling", {})
    if c:
        lines.append(
            "bare-engine ceilings (rows/s, length-bucketed batches): int8 batch 32 / batch 1 = "
            f"{c.get('int8_batch32_over_batch1', float('nan')):.2f}x, int8 / eager at batch 32 = "
            f"{c.get('int8_over_eager_batch32', float('nan')):.2f}x"
        )
    for name, ov in r["overhead"].items():
        goal = f" (goal ≤ 1 ms: {_ok(g, 'overhead_p50_le_1ms')})" if name == "int8-no-batching" else ""
        lines.append(
            f"server overhead p50, {name}: {ov['overhead_p50_ms']:.2f} ms = {ov['server_p50_ms']:.2f} − engine "
            f"{ov['engine_p50_ms']:.2f}{goal}"
        )
    return "\n".join(lines)


def _ok(goals_met: dict[str, Any], *keys: str) -> str:
    return "met" if all(goals_met.get(k) for k in keys) else "NOT met"


# ---- main ----------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repository", "-r", type=Path, default=None, help="default $MIAOHUI_HOME/repository")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint to build from (default: prepare's)")
    ap.add_argument("--work", type=Path, default=None, help="default $MIAOHUI_HOME/bench/server-cpu")
    ap.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per point")
    ap.add_argument("--tokens", default="8-64", help="token range of the texts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0, help="client timeout per request (s)")
    ap.add_argument("--processes", type=int, default=1, help="load-generator processes")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: the server's default)")
    ap.add_argument("--instances", type=int, default=None, help="engine instances (default: the model config's)")
    ap.add_argument("--queue-delay-ms", type=float, default=None, help="max_queue_delay_ms (default: the config's)")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="max_batch_tokens (0: none; default: config's)")
    ap.add_argument("--workers", type=int, default=1, help="server processes (miaohui serve --workers)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the bare-engine batch throughput runs")
    ap.add_argument("--max-load", type=float, default=None, help="wait while the 1-min load average is above")
    ap.add_argument("--max-wait", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="server_cpu", help="file name of the JSON and PNG written to --out")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("MIAOHUI_HOME", str(ROOT / "var"))  # before any path is resolved
    from miaohui.paths import home, repository_dir

    args.repository = (args.repository or repository_dir()).resolve()
    args.work = (args.work or home() / "bench" / "server-cpu").resolve()
    known = {c.name: c for c in CONFIGS}
    unknown = [n for n in args.configs.split(",") if n not in known]
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; choose from {', '.join(known)}")
    levels = [int(c) for c in parse_levels(args.concurrency, "--concurrency", True)]
    arts = artifacts(args)
    lo, hi = parse_token_range(args.tokens)
    max_len = read_manifest(arts["int8"]).max_length or hi
    texts = fit_token_range(load_texts(), tokenizer_counter(arts["int8"]), lo, min(hi, max_len), args.seed)
    print(f"{len(texts)} texts of {lo}-{min(hi, max_len)} tokens; {args.duration:g} s per point", flush=True)

    runs: dict[str, dict[str, Any]] = {}
    for cfg in (known[n] for n in args.configs.split(",")):
        runs[cfg.name] = run_config(cfg, arts[cfg.engine], texts, levels, args)
    for engine in ("int8", "eager"):
        runs[f"engine-{engine}"] = run_engine(f"engine-{engine}", arts[engine], texts, args)

    ceilings = {}
    if not args.no_ceiling:
        print("bare engines in batches (the ceiling of any server in front of them):", flush=True)
        for engine, limit in (("int8", 512), ("eager", 256)):
            ceilings[engine] = engine_ceiling(engine, arts[engine], texts, args, limit)
    r = ratios(runs, levels)
    r["ceiling"] = ceiling_ratios(ceilings)
    doc = {
        "benchmark": "intent server on CPU: dynamic batching on/off, int8 engine vs eager, overhead over engine",
        "schema": "miaohui-bench-server-cpu/1",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "git_commit": git_commit() or "unknown",
        "environment": environment() | {"cores_usable": len(os.sched_getaffinity(0))},
        "settings": {
            "concurrency": levels,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "tokens": [lo, min(hi, max_len)],
            "n_texts": len(texts),
            "seed": args.seed,
            "client_processes": args.processes,
            "client_timeout_s": args.timeout,
            "target": "http POST /v1/intent (miaohui.bench keep-alive client), closed loop",
        },
        "goals": goals(r),
        "goal_thresholds": GOALS,
        "ratios": r,
        "runs": list(runs.values()),
        "engine_ceilings": list(ceilings.values()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.name}.json"
    out.write_text(to_json(doc) + "\n", encoding="utf-8")
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}\n")
    print(table(doc))


if __name__ == "__main__":
    main()
