"""The interactive class's latency while a bulk tenant floods the intent server (issue 47): priority on vs off.

    .venv/bin/python benchmarks/bench_priority_cpu.py                       # 20 s per configuration
    .venv/bin/python benchmarks/bench_priority_cpu.py --duration 3 --work /tmp/w --out /tmp/r   # a quick check

* Model: a small random-weight BERT intent classifier (``--hidden`` 256, ``--layers`` 4, 4 heads, seed 0,
  :func:`~miaohui.zoo.tiny.any_tokenizer`), built to an fp32 ONNX Runtime engine served with one thread and
  batches of at most ``--max-batch`` requests: small enough to build in seconds, big enough that the engine (not
  the HTTP front) is what saturates, so requests wait in the batcher's queue, where the priority class acts.
* Server: a real ``python -m miaohui.cli serve --api-keys FILE`` (gRPC off) per configuration, with keys of two
  tenants: ``voice`` (priority ``interactive``) and ``batch``. ``priority-on``: ``batch``'s key has priority
  ``bulk``; ``priority-off``: the same key file except ``batch`` is ``interactive`` too (one class: first come,
  first served). Both configurations run in one invocation, one after the other, with the same load.
* Load, per configuration, after a warm-up: ``--bulk-procs`` client processes (this script with ``--client``), each
  a closed loop of ``--bulk-concurrency`` requests in flight on ``POST /v1/intent`` with ``batch``'s key for
  ``--duration`` s; meanwhile this process sends ``voice``'s requests open-loop at ``--interactive-rate``
  requests/s (one every 1/rate s whatever the answers). Every request is accounted for: answered (200), rejected
  (429, 503, any other status, counted by status) or failed on the client (timeout or connection error, counted).
* Reported: the interactive p50/p99 (answered requests) with priority on vs off and their ratio, the bulk
  throughput (answered requests/s), every count. The clients share the machine's cores with the server.

Writes ``<--name>.json`` and ``.png`` (default ``priority_cpu``) to ``--out`` and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from miaohui.bench.report import environment, git_commit, latency_stats, to_json

ROOT = Path(__file__).resolve().parents[1]
TEXT = "帮我订个明天上午九点的会议室，八个人，两个小时，要有投影仪"
TENANTS = ("voice", "batch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------------ clients


async def _one(client: httpx.AsyncClient, url: str, key: str, counts: Counter[str]) -> float | None:
    """One request: its latency when answered 200, else None (its status or failure counted)."""
    started = time.perf_counter()
    try:
        r = await client.post(url, json={"text": TEXT}, headers={"Authorization": f"Bearer {key}"})
    except httpx.HTTPError as exc:
        counts[f"client_{type(exc).__name__}"] += 1
        return None
    counts[str(r.status_code)] += 1
    return time.perf_counter() - started if r.status_code == 200 else None


async def bulk_loop(url: str, key: str, concurrency: int, duration: float) -> dict[str, Any]:
    """A closed loop of ``concurrency`` requests in flight for ``duration`` s."""
    counts: Counter[str] = Counter()
    end = time.monotonic() + duration
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def worker() -> None:
            while time.monotonic() < end:
                await _one(client, url, key, counts)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - started
    return {"counts": dict(counts), "wall_s": wall}


async def interactive_loop(url: str, key: str, rate: float, duration: float) -> dict[str, Any]:
    """Open loop: one request every 1/rate s for ``duration`` s, whatever the answers; all awaited at the end."""
    counts: Counter[str] = Counter()
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=60) as client:

        async def timed() -> None:
            seconds = await _one(client, url, key, counts)
            if seconds is not None:
                latencies.append(seconds)

        tasks = []
        start = time.monotonic()
        n = 0
        while (due := start + n / rate) < start + duration:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(timed()))
            n += 1
        await asyncio.gather(*tasks)
    return {"sent": n, "counts": dict(counts), "latencies_s": latencies}


# ------------------------------------------------------------------------------------------------ server


def build_repository(work: Path, hidden: int, layers: int, max_batch: int) -> Path:
    from miaohui.config import BuildConfig
    from miaohui.engines.store import build_artifact
    from miaohui.models.checkpoint import ModelMeta, save_checkpoint
    from miaohui.models.intent import IntentClassifier, random_bert
    from miaohui.serving.batcher import BatcherConfig
    from miaohui.serving.model_config import ModelConfig, write_model_config
    from miaohui.zoo.tiny import any_tokenizer

    repo = work / "repository"
    if (repo / "intent" / "config.yaml").exists():
        return repo
    tok = any_tokenizer()
    encoder = random_bert(hidden=hidden, layers=layers, heads=4, vocab=tok.get_vocab_size(), max_positions=128)
    labels = ["book_meeting_room", "greeting", "goodbye", "out_of_scope"]
    meta = ModelMeta(
        kind="intent", base="small-random", bert_config=encoder.config.to_diff_dict(), labels=labels, max_length=64
    )
    ckpt = save_checkpoint(work / "checkpoint", IntentClassifier(encoder, num_labels=len(labels)).eval(), meta, tok)
    build_artifact(ckpt, "intent", BuildConfig(precision="fp32"), repo, log=lambda m: None)
    batching = BatcherConfig(max_batch_size=max_batch, max_queue_size=1024, length_buckets=[16, 32, 64])
    write_model_config(repo / "intent" / "config.yaml", ModelConfig(threads=1, batching=batching))
    return repo


def write_keys(path: Path, keys: dict[str, str], bulk_priority: str) -> None:
    from miaohui.server.auth import ApiKey, KeyFile, hash_key

    entries = [
        ApiKey(tenant="voice", sha256=hash_key(keys["voice"]), models=["intent"], priority="interactive"),
        ApiKey(tenant="batch", sha256=hash_key(keys["batch"]), models=["intent"], priority=bulk_priority),  # type: ignore[arg-type]
    ]
    KeyFile(keys=entries).save(path)


def serve(repo: Path, key_file: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "miaohui.cli", "serve", "-r", str(repo), "--port", str(port), "--grpc-port", "0"]
    cmd += ["--api-keys", str(key_file)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server not ready after 300 s:\n{log.read_text()}")


def server_metrics(url: str) -> dict[str, Any]:
    """What the server counted: ``miaohui_rejected_requests_total`` by tenant, code and reason, and the means of
    batch size, queue wait and engine time per batch since start (warm-up included)."""
    from miaohui.bench.scrape import parse_metrics

    snap = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    rejected: dict[str, float] = {}
    for labels, value in snap.select("miaohui_rejected_requests_total").items():
        named = dict(labels)
        rejected[f"{named.get('tenant')}/{named.get('code')}/{named.get('reason')}"] = value

    def mean(name: str) -> float:
        count = snap.total(f"{name}_count")
        return snap.total(f"{name}_sum") / count if count else float("nan")

    return {
        "rejected": rejected,
        "batch_size_mean": mean("miaohui_batch_size"),
        "queue_ms_mean": mean("miaohui_queue_duration_seconds") * 1000,
        "compute_ms_mean": mean("miaohui_compute_duration_seconds") * 1000,
    }


def run_config(name: str, repo: Path, work: Path, keys: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    key_file = work / f"keys-{name}.yaml"
    write_keys(key_file, keys, "bulk" if name == "priority-on" else "interactive")
    proc, url = serve(repo, key_file, work / f"server-{name}.log")
    try:
        infer = url + "/v1/intent"
        asyncio.run(bulk_loop(infer, keys["voice"], 4, args.warmup))  # warm-up (the engine's first batches)
        client = [sys.executable, __file__, "--client", infer, "--key", keys["batch"]]
        client += ["--bulk-concurrency", str(args.bulk_concurrency), "--duration", str(args.duration)]
        procs = [subprocess.Popen(client, stdout=subprocess.PIPE, cwd=ROOT) for _ in range(args.bulk_procs)]
        time.sleep(1.0)  # the flood is on before the first interactive request
        inter = asyncio.run(interactive_loop(infer, keys["voice"], args.interactive_rate, args.duration - 2.0))
        bulk = [json.loads(p.communicate(timeout=args.duration + 120)[0]) for p in procs]
        server = server_metrics(url)
    finally:
        proc.terminate()
        proc.wait(30)
    bulk_counts: Counter[str] = Counter()
    for b in bulk:
        bulk_counts.update(b["counts"])
    wall = max(b["wall_s"] for b in bulk)
    lat = latency_stats(inter["latencies_s"])
    return {
        "name": name,
        "interactive": {
            "sent": inter["sent"],
            "counts": inter["counts"],
            "accounted": sum(inter["counts"].values()),
            "latency_ms": lat,
        },
        "bulk": {
            "counts": dict(bulk_counts),
            "answered_per_s": bulk_counts.get("200", 0) / wall,
            "wall_s": wall,
        },
        "server": server,
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["name"] for r in runs]
    xs = range(len(runs))
    for i, stat in enumerate(("p50", "p99")):
        ax1.bar([x + i * 0.4 for x in xs], [r["interactive"]["latency_ms"][stat] for r in runs], 0.4, label=stat)
    ax1.set_xticks([x + 0.2 for x in xs], names)
    ax1.set_ylabel("interactive latency (ms)")
    ax1.set_title(f"interactive at {doc['config']['interactive_rate']:g} req/s under a bulk flood")
    ax1.legend()
    ax2.bar(list(xs), [r["bulk"]["answered_per_s"] for r in runs], 0.5)
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("bulk answered req/s")
    ax2.set_title(f"bulk: {doc['config']['bulk_procs']} procs x {doc['config']['bulk_concurrency']} in flight")
    fig.suptitle(f"{doc['date']} {doc['commit'][:10]} {doc['environment']['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run one bulk client against this URL
    p.add_argument("--key", help=argparse.SUPPRESS)
    p.add_argument("--duration", type=float, default=20.0, help="Seconds of load per configuration.")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--bulk-procs", type=int, default=3)
    p.add_argument("--bulk-concurrency", type=int, default=16, help="Requests in flight per bulk process.")
    p.add_argument("--interactive-rate", type=float, default=5.0, help="Interactive requests per second.")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--work", type=Path, default=ROOT / "var" / "bench-priority")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default="priority_cpu")
    args = p.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(bulk_loop(args.client, args.key, args.bulk_concurrency, args.duration))))
        return
    from miaohui.server.auth import new_key

    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    repo = build_repository(args.work, args.hidden, args.layers, args.max_batch)
    keys = {t: new_key() for t in TENANTS}
    load_before = os.getloadavg()[0]
    runs = [run_config(name, repo, args.work, keys, args) for name in ("priority-on", "priority-off")]
    on, off = (r["interactive"]["latency_ms"] for r in runs)
    commit = git_commit() or "unknown"
    doc = {
        "benchmark": "priority_cpu",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "command": shlex.join([".venv/bin/python", "benchmarks/bench_priority_cpu.py", *sys.argv[1:]]),
        "environment": environment() | {"loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]},
        "config": {k: v for k, v in vars(args).items() if k not in ("client", "key", "work", "out")},
        "model": f"random BERT intent, hidden {args.hidden}, {args.layers} layers, fp32 ONNX Runtime, 1 thread",
        "runs": runs,
        "ratios": {
            "interactive_p99_off_over_on": off["p99"] / on["p99"],
            "interactive_p50_off_over_on": off["p50"] / on["p50"],
            "bulk_throughput_on_over_off": runs[0]["bulk"]["answered_per_s"] / runs[1]["bulk"]["answered_per_s"],
        },
    }
    (args.out / f"{args.name}.json").write_text(to_json(doc))
    plot(doc, args.out / f"{args.name}.png")
    for r in runs:
        i, b = r["interactive"], r["bulk"]
        print(
            f"{r['name']:>13}: interactive p50 {i['latency_ms']['p50']:.1f} ms p99 {i['latency_ms']['p99']:.1f} ms "
            f"({i['counts']}, sent {i['sent']}); bulk {b['answered_per_s']:.1f} req/s ({b['counts']}); "
            f"server {r['server']}"
        )
    print("ratios:", json.dumps(doc["ratios"]))


if __name__ == "__main__":
    main()
