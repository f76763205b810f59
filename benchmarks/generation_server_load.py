"""The generation server under load, for ``bench_generation_gpu.py --server``: the artifact saved, ``miaohui serve``
started, and streaming ``/v1/completions`` clients in several processes in a closed loop; output tokens/s, TTFT and
inter-chunk latency, the server's CPU per token and its own step metrics over one common window. See that script's
docstring (phase 5) for what each figure means."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from miaohui.bench.scrape import Snapshot, fetch_metrics, gc_pauses, parse_metrics, share_above, window_histogram
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.gil import GENERATION_SWITCH_US

CLIENT_START_S = 0.5
"""Seconds from the last client process's report that it has imported to the clients' common start. (A fixed delay
from their spawn is not enough: spawned processes import this module, torch included, first, and one of them can
start seconds late; ``client_late_s`` reports it.)"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, min(vocab, 30000), size=length).tolist() for _ in range(n)]


def _client_proc(
    url: str,
    model: str,
    prompts: list[list[int]],
    new_tokens: int,
    duration: float,
    warmup: float,
    q: Any,
    first_delays: list[float] | None = None,
    barrier: tuple[Any, Any] | None = None,
) -> None:
    """One client process: ``len(prompts)`` streams in a closed loop for ``warmup + duration`` s from a common start
    (``time.time()``: with ``barrier`` = (ready queue, start queue) the process reports that it has imported and takes
    the start from the parent, which sends it once every client is ready, so all measure one window; default: its own
    start). Only requests that start after the warm-up are recorded; ``window_tokens``: the tokens that arrived within
    the window, whichever request they belong to (a chunk of several tokens counts as the request's mean tokens per
    chunk). ``first_delays``: seconds each stream waits before its first request (staggered starts; none = all at
    once)."""
    import aiohttp

    start_at = 0.0
    if barrier is not None:
        barrier[0].put(os.getpid())
        start_at = barrier[1].get()
    late = max(0.0, time.time() - start_at) if start_at else 0.0  # the process got the start after it had passed
    start_at = max(start_at, time.time())
    measure_from = start_at + warmup
    until = measure_from + duration

    async def one_stream(
        session: aiohttp.ClientSession, prompt: list[int], res: dict[str, list[float]], delay: float
    ) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        await asyncio.sleep(delay)
        while time.time() < until:
            record = time.time() >= measure_from
            start = time.perf_counter()
            last, n = None, 0
            ttft: list[float] = []
            itl: list[float] = []
            arrived: list[float] = []  # time.time() of each chunk
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    res["errors"].append(float(resp.status))
                    await resp.read()
                    continue
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if b'"choices":[]' in line:  # the usage chunk: the token count (a chunk may carry several)
                        n = json.loads(line[6:])["usage"]["completion_tokens"]
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - start)
                    else:
                        itl.append(now - last)
                    last = now
                    arrived.append(time.time())
            chunks = len(arrived)
            if chunks:
                res["window_tokens"].append(n / chunks * sum(measure_from <= t < until for t in arrived))
            if record:
                res["ttft"] += ttft
                res["itl"] += itl
                res["tokens"].append(float(n))
                res["chunks"].append(float(chunks))
                res["done_at"].append(time.time())

    async def main() -> dict[str, list[float]]:
        keys = ("ttft", "itl", "tokens", "chunks", "errors", "done_at", "start", "cpu", "late", "window_tokens")
        res: dict[str, list[float]] = {k: [] for k in keys}
        res["start"].append(measure_from)
        res["late"].append(late)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu, wall = time.process_time(), time.perf_counter()
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
            delays = first_delays or [0.0] * len(prompts)
            await asyncio.gather(*(one_stream(session, p, res, d) for p, d in zip(prompts, delays, strict=True)))
        res["cpu"].append((time.process_time() - cpu) / (time.perf_counter() - wall))  # cores this client used
        return res

    q.put(asyncio.run(main()))


def server_load(
    hf32: Any, eos: int | None, args: argparse.Namespace, vocab: int, options: SlotEngineOptions
) -> dict[str, Any]:
    from miaohui.generation.build.artifact import CausalLMInfo, GenerationModelConfig
    from miaohui.generation.build.static_artifact import save_static_decoder

    repo = Path(tempfile.mkdtemp(prefix="llm-repo-"))
    version = repo / "llm" / "1"
    version.mkdir(parents=True)
    t = time.perf_counter()
    save_static_decoder(version, hf32, None, "bf16", [eos if eos is not None else vocab - 1], 0)
    info = CausalLMInfo(name="llm", version=1, backend="inductor", precision="bf16", source="random", build_key="-",
                        created=int(time.time()), build_seconds=0.0)  # fmt: skip
    (version / "causal_lm.json").write_text(info.model_dump_json())
    sched = SchedulerConfig(
        max_running_seqs=options.num_slots, max_batched_tokens=args.max_batched_tokens, max_waiting=1024,
        max_model_len=options.max_len, async_scheduling=bool(args.async_scheduling),
        prefill_min_prompts=args.prefill_min_prompts, prefill_max_wait_ms=args.prefill_max_wait_ms,
        max_prefill_seqs=args.max_prefill_seqs,
    )  # fmt: skip
    import yaml

    cfg = GenerationModelConfig(scheduler=sched, engine=options)
    (repo / "llm" / "generation.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    log(f"artifact saved in {time.perf_counter() - t:.1f}s; starting the server")
    # a tokenizer is needed by the server: SmolLM2's when cached, else a tiny word-level one
    _write_tokenizer(version, vocab)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.server_src:  # another tree's miaohui for the server only (A/B of the serving path)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.server_src), env.get("PYTHONPATH")]))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_file = (repo / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "miaohui.cli", "serve", "-r", str(repo), "--port", str(port), "--grpc-port", "0"]
        + (["--workers", str(args.serve_workers), "--shared-engine"] if args.serve_workers > 1 else [])
        + ([] if args.gc_freeze == "on" else ["--no-gc-freeze"]),
        stdout=log_file, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    started = time.perf_counter()
    try:
        while True:
            if time.perf_counter() - started > 400:
                raise RuntimeError("server not ready in 400 s: " + (repo / "serve.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None:
                raise RuntimeError("server exited: " + (repo / "serve.log").read_text()[-3000:])
            time.sleep(1)
        ready_s = time.perf_counter() - started
        frozen = re.search(r"froze (\d+) objects", (repo / "serve.log").read_text())  # miaohui.gcpolicy's log line
        log(f"server ready after {ready_s:.0f}s; load: {args.streams} streams, {args.client_procs} client processes")
        ctx = mp.get_context("spawn")
        q, ready, go = ctx.Queue(), ctx.Queue(), ctx.Queue()
        per = args.streams // args.client_procs
        procs = [
            ctx.Process(
                target=_client_proc,
                args=(
                    f"{base}/v1/completions",
                    "llm",
                    random_prompts(per, args.prompt_len, vocab, 100 + i),
                    args.new_tokens,
                    args.duration,
                    args.client_warmup,
                    q,
                    [(i * per + j) * args.stagger_ms / 1e3 for j in range(per)],
                    (ready, go),
                ),
            )
            for i in range(args.client_procs)
        ]
        for p in procs:
            p.start()
        for _ in procs:  # spawned processes import this module (torch included) before they can start
            ready.get(timeout=300)
        start_at = time.time() + CLIENT_START_S  # every client's window starts here
        for _ in procs:
            go.put(start_at)
        before: list[Snapshot | None] = []
        steady: list[Snapshot | None] = []  # at the end of the clients' window: every stream still in its loop
        measure_in = start_at + args.client_warmup - time.time()  # seconds until the clients' window
        grab = threading.Timer(measure_in, lambda: before.append(fetch_metrics(base)))
        grab_steady = threading.Timer(measure_in + args.duration, lambda: steady.append(fetch_metrics(base)))
        grab.start()
        grab_steady.start()
        host = server_cpu(server.pid, measure_in + 0.5, 0.8 * args.duration)
        results = [q.get(timeout=measure_in + args.duration + 300) for _ in procs]
        for p in procs:
            p.join()
        t0 = min(r["start"][0] for r in results)
        wall = max(max(r["done_at"], default=t0) for r in results) - t0
        merged = {k: [v for r in results for v in r[k]] for k in results[0]}
        tokens = sum(merged["tokens"])
        if not tokens or wall <= 0:
            raise RuntimeError(f"no tokens came back ({len(merged['errors'])} errors); see {repo / 'serve.log'}")
        grab.join()
        grab_steady.join()
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        after = parse_metrics(metrics)
        steps = step_breakdown(before[0] if before else None, after)
        return {
            "streams": args.streams,
            "client_processes": args.client_procs,
            "client_warmup_s": args.client_warmup,
            "stagger_ms": args.stagger_ms,
            "serve_workers": args.serve_workers,
            "async_scheduling": args.async_scheduling,
            "server_src": str(args.server_src) if args.server_src else None,
            "gil_switch_interval_us": GENERATION_SWITCH_US,  # the server's generation loop (no --gil-switch-us)
            "server_ready_s": ready_s,
            "requests": len(merged["tokens"]),
            "errors": len(merged["errors"]),
            "output_tokens": tokens,
            "tokens_per_chunk": tokens / max(1.0, sum(merged["chunks"])),  # > 1: tokens coalesced under load
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            # tokens that arrived within the common window [warm-up end, + duration) / duration: the steady rate as
            # the clients saw it (tokens_per_s above also waits for the last stream's last request to end)
            "window_tokens_per_s": sum(merged["window_tokens"]) / args.duration,
            "ttft_ms_median": statistics.median(merged["ttft"]) * 1e3,
            "ttft_ms_p99": pct(merged["ttft"], 99) * 1e3,
            "itl_ms_median": statistics.median(merged["itl"]) * 1e3,
            "itl_ms_p99": pct(merged["itl"], 99) * 1e3,
            "server_cpu_cores": host["cores"],
            "server_main_thread_cores": host["main_thread_cores"],
            "server_cpu_us_per_token": 1e6 * host["cores"] / (tokens / wall),
            "server_main_thread_us_per_token": 1e6 * host["main_thread_cores"] / (tokens / wall),
            # CPU cores each client process used (a client near 1.0 delays its streams' next requests)
            "client_cpu_cores": [round(c, 3) for c in merged["cpu"]],
            # seconds a client process started after the common start (its streams began that much late)
            "client_late_s": max(merged["late"]),
            # the engine loop's steps over the measured window (server metrics; with --serve-workers the engine
            # process's, shown on every worker's /metrics)
            "steps": steps,
            # the same from the first scrape to the end of the clients' window, before any stream stops: the server's
            # steady state at the full concurrency (``generated_tokens_per_s``: tokens the engine generated per second)
            "steady": step_breakdown(before[0] if before else None, steady[0]) if steady and steady[0] else {},
            # the server's garbage-collector pauses over the measured window, per generation (miaohui.gcpolicy)
            "gc_freeze": args.gc_freeze,
            "gc_frozen_objects": int(frozen.group(1)) if frozen else 0,
            "gc_pauses": gc_pauses(before[0] if before else None, after),
            # the server's own view (from engine.add): TTFT / inter-token / whole-request sums and counts
            "metrics_excerpt": [
                ln
                for ln in metrics.splitlines()
                if ln.startswith(("miaohui_time_to_first_token", "miaohui_inter_token", "miaohui_generation_duration"))
                and ("_sum" in ln or "_count" in ln)
            ][:12],
        }
    finally:
        server.terminate()
        server.wait(30)
        log_file.close()


def step_breakdown(before: Snapshot | None, after: Snapshot) -> dict[str, float]:
    """Where the generation loop's time went between two scrapes: steps per second, and per step kind the
    count, mean and p99 ms (``decode`` / ``prefill`` model time, ``loop``: the loop's own host time between model
    calls), from ``miaohui_stage_duration_seconds``; sequences per step from ``miaohui_batch_size``; prompts per
    prefill step (mean, p99, share over 8) from ``miaohui_prefill_sequences``, the share of those steps that ran
    mixed (``miaohui_mixed_steps_total``); a prompt's wait for its prefill
    step p50 / p99; the server's own TTFT p50 / p99 and the share over 50 ms."""
    if before is None or not before.at:
        return {}
    window = (after.at or time.time()) - before.at
    out: dict[str, float] = {"window_s": window}

    def delta(name: str, **match: str) -> float:
        return after.total(name, **match) - (before.total(name, **match) if before else 0.0)

    steps = delta("miaohui_batch_size_count", model="llm")
    if steps <= 0:
        return {}
    out["steps_per_s"] = steps / window
    out["generated_tokens_per_s"] = delta("miaohui_generated_tokens_total", model="llm") / window
    out["seqs_per_step"] = delta("miaohui_batch_size_sum", model="llm") / steps
    out["model_ms_per_step"] = 1e3 * delta("miaohui_compute_duration_seconds_sum", model="llm") / steps
    for stage in ("decode", "prefill", "loop"):
        n = delta("miaohui_stage_duration_seconds_count", model="llm", stage=stage)
        total = delta("miaohui_stage_duration_seconds_sum", model="llm", stage=stage)
        out[f"{stage}_steps"] = n
        out[f"{stage}_ms_mean"] = 1e3 * total / n if n else 0.0
        out[f"{stage}_ms_per_step"] = 1e3 * total / steps
        hist = window_histogram(before, after, "miaohui_stage_duration_seconds", 1e3, model="llm", stage=stage)
        out[f"{stage}_ms_p99"] = hist["p99"] if hist else 0.0
    if prefills := window_histogram(before, after, "miaohui_prefill_sequences", 1.0, model="llm"):
        out["prompts_per_prefill"], out["prompts_per_prefill_p99"] = prefills["mean"], prefills["p99"]
        # more than the largest static prefill bucket (8) in one step: prefilled eagerly
        out["prefills_over_8_prompts"] = share_above(before, after, "miaohui_prefill_sequences", 8, model="llm")
        prefill_steps = delta("miaohui_prefill_sequences_count", model="llm")
        mixed = delta("miaohui_mixed_steps_total", model="llm")
        out["mixed_share_of_prefill_steps"] = mixed / prefill_steps if prefill_steps else 0.0
    # how long prompts waited for their prefill step (TTFT's queue part)
    if queue := window_histogram(before, after, "miaohui_queue_duration_seconds", 1e3, model="llm"):
        out["queue_ms_p50"], out["queue_ms_p99"] = queue["p50"], queue["p99"]
    # the server's own TTFT (engine.add → first token), apart from HTTP and the clients: is the tail in the engine?
    if ttft := window_histogram(before, after, "miaohui_time_to_first_token_seconds", 1e3, model="llm"):
        out["server_ttft_ms_p50"], out["server_ttft_ms_p99"] = ttft["p50"], ttft["p99"]
        out["server_ttft_share_over_50ms"] = share_above(
            before, after, "miaohui_time_to_first_token_seconds", 0.05, model="llm"
        )
    return out


def server_cpu(pid: int, after_s: float, for_s: float) -> dict[str, float]:
    """CPU the server process used (cores: CPU seconds per second) from ``after_s`` for ``for_s`` seconds,
    in all and on its main thread — the event loop, where the HTTP/SSE host path runs."""
    import psutil

    proc = psutil.Process(pid)

    def sample() -> tuple[float, float]:  # with --serve-workers: the parent, its workers and the engine process
        main = next((t for t in proc.threads() if t.id == pid), None)
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                total += times.user + times.system
        return total, (main.user_time + main.system_time) if main else float("nan")

    time.sleep(after_s)
    (all0, main0), t0 = sample(), time.perf_counter()
    time.sleep(for_s)
    (all1, main1), t1 = sample(), time.perf_counter()
    return {"cores": (all1 - all0) / (t1 - t0), "main_thread_cores": (main1 - main0) / (t1 - t0)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_tokenizer(version: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(version / "tokenizer.json"))
