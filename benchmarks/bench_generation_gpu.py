"""Decoders on the GPU: HF ``generate`` (PyTorch eager, the baseline) against our ``inductor`` engine
(static KV cache, Inductor-compiled, one CUDA graph per batch/length bucket), and the engine behind the
real server under 64 concurrent streams.

    python benchmarks/bench_generation_gpu.py --models qwen1.5b,smollm2 [--server] [--out DIR]

Models: ``qwen1.5b`` — a Qwen2.5-1.5B-*shaped* decoder (hidden 1536, 28 layers, 12 heads, 2 KV heads,
FFN 8960, vocab 151936) with **random weights** (shape is what speed depends on; say so in every result);
``smollm2`` — the real SmolLM2-135M-Instruct (offline GGUF, ``--smollm-cache`` or $MIAOHUI_HOME/models).

Per model, in one process, bf16 everywhere except the fp32 reference:
1. correctness: the engine's prefill and decode logits against HF fp32 on the same tokens
   (‖Δ‖/‖ref‖ per step) and greedy agreement (engine token = argmax of HF fp32 at that position);
2. HF eager bf16 ``generate`` TPOT at batch 1 and tokens/s at batch ``--streams`` (greedy, fixed length);
3. engine decode step at batch 1/8/32/64: CUDA-event time of one graph replay (GPU only), and the host-
   inclusive step (staging copy + replay + argmax back to the host); median and p99 over ``--iters``;
4. engine through the scheduler (``LLMEngine``): TPOT at 1 stream and tokens/s with ``--streams`` streams of
   ``--prompt-len`` prompt and ``--new-tokens`` output tokens (continuous batching, greedy, ignore_eos), one
   synchronous ``step()`` after another; then the same through the server's engine thread (``AsyncLLMEngine``) with
   async scheduling — step N+1 launched before step N's tokens are read — streaming to an asyncio loop
   (``engine_thread``: a served stream's TPOT without HTTP);
5. ``--server`` (first model only): the artifact saved, ``miaohui serve`` started, and ``--streams`` streaming
   ``/v1/completions`` clients (``--client-procs`` processes) in a closed loop for ``--duration`` s:
   output tokens/s (counted from each stream's usage chunk), TTFT and inter-chunk latency ("ITL") p50/p99 — a
   chunk carries every token that queued up while its stream waited for the event loop (under load
   ``tokens_per_chunk`` > 1) — and the server
   process's CPU (all threads, and its main thread — the event loop that runs HTTP and SSE) per streamed token;
   the client processes start together once all have imported (``CLIENT_START_S``) and measure one common window;
   each counts the tokens that arrived in it (``window_tokens_per_s``) and reports its own CPU; from the server's
   metrics, ``steps`` (the window until the last stream ends) and ``steady`` (until the window's end, while every
   stream is still in its loop: ``generated_tokens_per_s`` is the server's steady output rate);
6. ``--cpu-hostpath`` (no GPU): phase 5 with the tiny random model on the CPU, whose steps cost little, so
   the figures are the server's host path: how much CPU one streamed token costs it
   (→ ``generation_cpu_hostpath.json``).

The HBM floor of a decode step is the bytes it must read (weights + attended KV) over the measured copy
bandwidth (4.3 TB/s, ../shared/GPU.md). Writes ``generation_gpu_<models>.json``; prints the table last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import json
import multiprocessing as mp
import os
import platform
import re
import shlex
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
import torch

from miaohui.bench.scrape import Snapshot, fetch_metrics, gc_pauses, parse_metrics, share_above, window_histogram
from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.static_kv import StaticKVDecoder
from miaohui.gil import GENERATION_SWITCH_US

HBM_BYTES_PER_S = 4.3e12
CLIENT_START_S = 0.5
"""Seconds from the last client process's report that it has imported to the clients' common start. (A fixed delay
from their spawn is not enough: spawned processes import this module, torch included, first, and one of them can
start seconds late; ``client_late_s`` reports it.)"""
DEVICE = "cuda"
TINY = {  # --smoke: a tiny Qwen2-shaped model on the CPU, to check this script end to end without a GPU
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
QWEN_15B = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# ---- models ------------------------------------------------------------------------------------------


def load_model(name: str, smollm_cache: Path | None) -> tuple[Any, int | None, str]:
    """(HF fp32 model on cuda, eos id, description)."""
    if name in ("qwen1.5b", "tiny"):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        cfg = Qwen2Config(**(QWEN_15B if name == "qwen1.5b" else TINY))
        with torch.device(DEVICE):
            model = Qwen2ForCausalLM(cfg).eval()
        return model, None, f"{'Qwen2.5-1.5B' if name == 'qwen1.5b' else 'tiny Qwen2'}-shaped decoder, RANDOM weights"
    if name == "smollm2":
        from miaohui.zoo.smollm import load_smollm2

        model, tok, _ = load_smollm2(smollm_cache)
        return model.to(DEVICE).eval(), int(tok.eos_token_id), "SmolLM2-135M-Instruct (real weights), bf16"
    raise SystemExit(f"unknown model {name!r}: use qwen1.5b or smollm2")


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, min(vocab, 30000), size=length).tolist() for _ in range(n)]


def weight_bytes(dec: StaticKVDecoder) -> int:
    """Bytes a decode step reads of the weights: everything but the embedding table (b rows of it)."""
    return sum(p.numel() * p.element_size() for n, p in dec.named_parameters() if n != "embed")


# ---- phases -------------------------------------------------------------------------------------------


def check_against_hf(engine: TorchSlotEngine, hf32: Any, prompt: list[int], steps: int) -> dict[str, Any]:
    """Engine (bf16) logits vs HF fp32 on the engine's own greedy tokens (teacher forcing)."""
    logits = engine.prefill([0], [prompt])
    seq, engine_logits = list(prompt), []
    first = torch.as_tensor(logits.rows([0])[0])
    engine_logits.append(first)
    seq.append(int(first.argmax()))
    for _ in range(steps):
        out = engine.decode([0], [seq[-1]])
        row = torch.as_tensor(out.rows([0])[0])
        engine_logits.append(row)
        seq.append(int(row.argmax()))
    engine.release(0)
    with torch.inference_mode():
        ref = hf32(torch.tensor([seq[:-1]], device=DEVICE)).logits[0, len(prompt) - 1 :].float().cpu()
    rel = [float((e - r).norm() / r.norm()) for e, r in zip(engine_logits, ref, strict=True)]
    agree = [int(e.argmax()) == int(r.argmax()) for e, r in zip(engine_logits, ref, strict=True)]
    return {
        "steps": len(rel),
        "rel_error_prefill": rel[0],
        "rel_error_decode_max": max(rel[1:]),
        "rel_error_decode_median": statistics.median(rel[1:]),
        "greedy_agreement": sum(agree) / len(agree),
    }


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def hf_eager(hf16: Any, prompts: list[list[int]], new_tokens: int, runs: int) -> dict[str, Any]:
    """HF generate, greedy, fixed length: TPOT = (t(n+1 tokens) - t(1 token)) / n."""

    def gen(batch: list[list[int]], n: int) -> float:
        ids = torch.tensor(batch, device=DEVICE)
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            hf16.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        sync()
        return time.perf_counter() - t

    out: dict[str, Any] = {}
    for label, batch in (("batch1", prompts[:1]), (f"batch{len(prompts)}", prompts)):
        gen(batch, 2)  # warm-up
        firsts = [gen(batch, 1) for _ in range(runs)]
        fulls = [gen(batch, new_tokens + 1) for _ in range(runs)]
        tpot = (statistics.median(fulls) - statistics.median(firsts)) / new_tokens
        out[label] = {
            "ttft_ms": statistics.median(firsts) * 1e3,
            "tpot_ms": tpot * 1e3,
            "tokens_per_s": len(batch) / tpot,
        }
        log(f"HF eager {label}: TPOT {tpot * 1e3:.2f} ms, {len(batch) / tpot:.0f} tok/s")
    return out


def decode_steps(engine: TorchSlotEngine, prompt_len: int, batches: list[int], iters: int) -> list[dict[str, Any]]:
    rows = []
    vocab = engine.dims.vocab
    for b in batches:
        if b > engine.num_slots:
            continue
        slots = list(range(b))
        engine.prefill(slots, random_prompts(b, prompt_len, vocab, b))
        tokens = [11] * b
        for _ in range(5):
            engine.decode(slots, tokens).argmax()
        host: list[float] = []
        for _ in range(iters):
            t = time.perf_counter()
            tokens = engine.decode(slots, tokens).argmax()
            host.append((time.perf_counter() - t) * 1e3)
        length = int(engine.lengths[slots].max())
        kv_len = next(x for x in engine.length_buckets if x > length)
        gpu: list[float] = []
        graph = engine._graphs.get((next(x for x in engine.batch_buckets if x >= b), kv_len))
        if graph is not None:
            for _ in range(iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph[0].replay()
                e.record()
                e.synchronize()
                gpu.append(s.elapsed_time(e))
        for slot in slots:
            engine.release(slot)
        dec = engine.model
        kv_read = b * kv_len * dec.dims.num_layers * 2 * dec.dims.num_kv_heads * dec.dims.head_dim * 2
        floor_ms = (weight_bytes(dec) + kv_read) / HBM_BYTES_PER_S * 1e3
        row = {
            "batch": b,
            "kv_len_bucket": kv_len,
            "gpu_step_ms_median": statistics.median(gpu) if gpu else None,
            "gpu_step_ms_p99": pct(gpu, 99) if gpu else None,
            "host_step_ms_median": statistics.median(host),
            "host_step_ms_p99": pct(host, 99),
            "hbm_floor_ms": floor_ms,
            "tokens_per_s_host": b / statistics.median(host) * 1e3,
        }
        rows.append(row)
        host_ms = row["host_step_ms_median"]
        log(f"decode b={b}: gpu {row['gpu_step_ms_median']} ms, host {host_ms:.3f} ms, floor {floor_ms:.3f}")
    return rows


def _stream_stats(n: int, stamps: dict[int, list[float]], t0: float, wall: float) -> dict[str, Any]:
    """Tokens/s, TTFT and TPOT of ``n`` streams from each stream's token arrival times."""
    total = sum(len(v) for v in stamps.values())
    ttft = [v[0] - t0 for v in stamps.values()]
    itl = [b - a for v in stamps.values() for a, b in itertools.pairwise(v)]
    log(f"  {n} streams: {total / wall:.0f} tok/s, TPOT {statistics.median(itl) * 1e3:.3f} ms")
    return {
        "streams": n,
        "output_tokens": total,
        "wall_s": wall,
        "tokens_per_s": total / wall,
        "ttft_ms_median": statistics.median(ttft) * 1e3,
        "ttft_ms_p99": pct(ttft, 99) * 1e3,
        "tpot_ms_median": statistics.median(itl) * 1e3,
        "tpot_ms_p99": pct(itl, 99) * 1e3,
    }


def _sched_config(engine: TorchSlotEngine, streams: int, n: int, prompt_len: int, chained: bool) -> SchedulerConfig:
    return SchedulerConfig(
        max_running_seqs=min(streams, engine.num_slots), max_batched_tokens=max(4096, n * prompt_len + n),
        max_waiting=4 * streams, max_model_len=engine.max_len, async_scheduling=chained,
    )  # fmt: skip


def through_scheduler(engine: TorchSlotEngine, streams: int, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """``LLMEngine.step()`` in a loop: schedule, run, collect, one step after another (no HTTP, no engine thread)."""
    vocab = engine.dims.vocab
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    log("scheduler, synchronous steps:")
    for n in (1, streams):
        llm = LLMEngine(engine, None, _sched_config(engine, streams, n, prompt_len, False))
        llm.generate(random_prompts(min(n, 4), prompt_len, vocab, 7), params.model_copy(update={"max_tokens": 4}))
        prompts = random_prompts(n, prompt_len, vocab, 11)
        for p in prompts:
            llm.add_request(p, params)
        stamps: dict[int, list[float]] = {}
        t0 = time.perf_counter()
        while llm.scheduler.has_work():
            step = llm.step()
            now = time.perf_counter()
            for up in step.updates if step is not None else ():
                if up.token_id is not None:
                    stamps.setdefault(up.seq_id, []).append(now)
        out[f"streams{n}"] = _stream_stats(n, stamps, t0, time.perf_counter() - t0)
    return out


def through_async_engine(engine: TorchSlotEngine, streams: int, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """The server's engine thread (``AsyncLLMEngine``) with async scheduling — step N+1 launched before step N's
    tokens are read, so the host's per-step work overlaps the GPU's — and the tokens streamed to an asyncio loop: a
    served stream's TPOT without HTTP."""
    vocab = engine.dims.vocab
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    log("engine thread, async scheduling:")
    for n in (1, streams):
        llm = LLMEngine(engine, None, _sched_config(engine, streams, n, prompt_len, True))
        prompts = random_prompts(n, prompt_len, vocab, 11)

        async def run(llm: LLMEngine, prompts: list[list[int]]) -> tuple[dict[int, list[float]], float, float]:
            stamps: dict[int, list[float]] = {}
            eng = AsyncLLMEngine(llm)
            await eng.start(warmup=False)  # warm already (its warm-up prompt is the EOS id: -1 here, no EOS)

            async def one(i: int, prompt: list[int]) -> None:
                async for event in eng.generate(prompt, params):
                    if event.token_id is not None:
                        stamps.setdefault(i, []).append(time.perf_counter())

            try:
                t0 = time.perf_counter()
                await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
                return stamps, t0, time.perf_counter() - t0
            finally:
                await eng.stop()

        stamps, t0, wall = asyncio.run(run(llm, prompts))
        out[f"streams{n}"] = _stream_stats(n, stamps, t0, wall)
    engine.chaining = False  # the engine thread switched it on
    return out


# ---- server --------------------------------------------------------------------------------------------


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


# ---- main ------------------------------------------------------------------------------------------------


def bench_model(name: str, args: argparse.Namespace, server: bool) -> dict[str, Any]:
    hf32, eos, desc = load_model(name, args.smollm_cache)
    vocab = hf32.config.vocab_size
    log(f"{name}: {desc}; {sum(p.numel() for p in hf32.parameters()) / 1e6:.0f}M parameters")
    res: dict[str, Any] = {"model": name, "description": desc}
    dtype = "fp32" if DEVICE == "cpu" else "bf16"
    options = SlotEngineOptions(
        num_slots=args.slots,
        max_len=args.max_len,
        dtype=dtype,
        autotune=args.autotune,
        static_prefill=args.static_prefill,
        **({"decode_attention": args.decode_attention} if args.decode_attention else {}),
        int8_batch1=args.int8_batch1,
        **({"int8_kernel": args.int8_kernel} if args.int8_kernel else {}),
        prefill_batch_buckets=tuple(2**i for i in range(args.prefill_batch_max.bit_length())),
        **(
            {"mixed_prefill_tokens": tuple(int(v) for v in args.mixed_prefill.split(",") if v.isdigit())}
            if args.mixed_prefill is not None
            else {}
        ),
        mixed_prefill_prompts=args.mixed_prefill_prompts,
    )
    res["engine_options"] = options.model_dump(mode="json")
    if args.server_only:
        res["server"] = server_load(hf32, eos, args, vocab, options)
        return res
    dec = StaticKVDecoder.from_hf(hf32, num_slots=options.num_slots, max_len=options.max_len, dtype=torch.bfloat16)
    engine = TorchSlotEngine(dec, [eos if eos is not None else -1], 0, options)
    res["engine_warmup_s"] = engine.warmup(log=log)
    res["weights_gb"] = weight_bytes(dec) / 1e9
    prompt = random_prompts(1, 64, vocab, 3)[0]
    res["check"] = check_against_hf(engine, hf32, prompt, args.check_steps)
    log(f"check: {res['check']}")
    res["decode_steps"] = decode_steps(engine, args.prompt_len, [1, 8, 32, 64], args.iters)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    res["scheduler"] = through_scheduler(engine, args.streams, args.prompt_len, args.new_tokens)
    res["engine_thread"] = through_async_engine(engine, args.streams, args.prompt_len, args.new_tokens)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    res["hf_eager"] = hf_eager(hf16, random_prompts(args.streams, args.prompt_len, vocab, 5), args.hf_tokens, 2)
    del hf16
    base = res["hf_eager"]["batch1"]["tpot_ms"]
    ours = res["scheduler"]["streams1"]["tpot_ms_median"]
    res["tpot_speedup_vs_eager"] = base / ours
    engine.close()
    del engine, dec
    torch.cuda.empty_cache()
    if server:
        try:
            res["server"] = server_load(hf32, eos, args, vocab, options)
            srv = res["server"]
            steady = srv["steady"]
            log(
                f"server: {srv['tokens_per_s']:.0f} tok/s, TTFT p99 {srv['ttft_ms_p99']:.1f} ms; steady window "
                f"{steady.get('generated_tokens_per_s', 0):.0f} tok/s, {steady.get('steps_per_s', 0):.0f} steps/s x "
                f"{steady.get('seqs_per_step', 0):.1f} rows; client cores max {max(srv['client_cpu_cores']):.2f}"
            )
        except Exception as exc:  # report, keep the other results
            res["server"] = {"error": repr(exc)}
            log(f"server phase failed: {exc!r}")
    return res


def plot(doc: dict[str, Any], path: Path) -> None:
    """Two panels per model: batch-1 time per token (HF eager vs engine vs HBM floor) and tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in doc["models"] if "error" not in m]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [m["model"] for m in models]
    x = np.arange(len(models))
    bars = {
        "HF eager": [m["hf_eager"]["batch1"]["tpot_ms"] for m in models],
        "engine (1 stream)": [m["scheduler"]["streams1"]["tpot_ms_median"] for m in models],
        "HBM floor": [m["decode_steps"][0]["hbm_floor_ms"] for m in models],
    }
    for i, (label, vals) in enumerate(bars.items()):
        axes[0].bar(x + (i - 1) * 0.27, vals, 0.27, label=label)
    axes[0].set_yscale("log")
    axes[0].set_xticks(x, names)
    axes[0].set_ylabel("ms per output token, batch 1 (log)")
    axes[0].legend()
    streams = max(int(k.removeprefix("streams")) for k in models[0]["scheduler"]) if models else 0
    tput = {
        f"HF eager batch {streams}": [m["hf_eager"][f"batch{streams}"]["tokens_per_s"] for m in models],
        f"engine {streams} streams": [m["scheduler"][f"streams{streams}"]["tokens_per_s"] for m in models],
        "engine via server": [m.get("server", {}).get("tokens_per_s", 0.0) for m in models],
    }
    for i, (label, vals) in enumerate(tput.items()):
        axes[1].bar(x + (i - 1) * 0.27, vals, 0.27, label=label)
    axes[1].set_xticks(x, names)
    axes[1].set_ylabel("output tokens/s")
    axes[1].legend()
    fig.suptitle(f"{doc['gpu']} · torch {doc['torch']} · {doc['date']} (qwen1.5b: random weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--replot":  # PNGs from committed JSONs (no GPU needed)
        for name in sys.argv[2:]:
            plot(json.loads(Path(name).read_text()), Path(name).with_suffix(".png"))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen1.5b,smollm2")
    ap.add_argument("--smollm-cache", type=Path, default=None)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-tokens", type=int, default=16)
    ap.add_argument("--check-steps", type=int, default=32)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument(
        "--static-prefill", action="store_true", help="prefill through padded buckets, CUDA graphs on a GPU (A/B)"
    )
    ap.add_argument(
        "--prefill-batch-max",
        type=int,
        default=8,
        help="static prefill buckets 1, 2, 4 … up to this many prompts (more in one step are prefilled eagerly)",
    )
    ap.add_argument(
        "--mixed-prefill",
        default=None,
        help="mixed steps' token buckets (prompts as extra rows of a decode step), e.g. 128,256; off: none; "
        "default: the engine's (128,256,512)",
    )
    ap.add_argument("--mixed-prefill-prompts", type=int, default=4, help="the most prompts one mixed step takes")
    ap.add_argument(
        "--decode-attention",
        choices=["matmul", "triton"],
        default=None,
        help="decode's attention kernel (default: the engine's, triton)",
    )
    ap.add_argument(
        "--gc-freeze",
        choices=["on", "off"],
        default="on",
        help="the server freezes its warm heap (gc.freeze(), the default) or not (miaohui serve --no-gc-freeze): A/B",
    )
    ap.add_argument(
        "--int8-batch1", action="store_true", help="int8 weight-only copy for decode steps of one row (engine option)"
    )
    ap.add_argument(
        "--int8-kernel",
        choices=["inductor", "gemv_layer"],
        default=None,
        help="the kernels of --int8-batch1's steps (default: the engine's, gemv_layer)",
    )
    ap.add_argument("--server", action="store_true", help="also load the first model through `miaohui serve`")
    ap.add_argument("--server-only", action="store_true", help="only the server phase (writes *_server.json)")
    ap.add_argument("--server-src", type=Path, help="serve from this tree's src/ (e.g. `git archive REV src`), A/B")
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--client-warmup", type=float, default=5.0, help="seconds of load before recording")
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="--server: launch step N+1 before reading step N's tokens (scheduler: async_scheduling; default off)",
    )
    ap.add_argument(
        "--prefill-min-prompts", type=int, default=1, help="--server: hold prompts for a joint prefill (scheduler)"
    )
    ap.add_argument("--prefill-max-wait-ms", type=float, default=0.0, help="--server: the longest such a hold")
    ap.add_argument(
        "--max-prefill-seqs", type=int, default=None, help="--server: most prompts prefilled per step (scheduler)"
    )
    ap.add_argument(
        "--stagger-ms",
        type=float,
        default=0.0,
        help="server load: stream k sends its first request k x this many ms after the start (0: all at once; then "
        "fixed-length streams finish and restart together, in waves of --streams prompts)",
    )
    ap.add_argument(
        "--serve-workers",
        type=int,
        default=1,
        help="server load: `miaohui serve --workers N --shared-engine` (N > 1): N HTTP workers stream from the one "
        "engine process (server CPU then sums every process; main_thread_cores is the parent's)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU: checks the script, no timing")
    ap.add_argument(
        "--cpu-hostpath",
        action="store_true",
        help="the server's host path on the CPU: the tiny model (near-free steps) behind `miaohui serve`, "
        "--streams streaming clients; reports server CPU per streamed token (→ generation_cpu_hostpath.json)",
    )
    args = ap.parse_args()
    global DEVICE
    if args.cpu_hostpath:
        DEVICE = "cpu"
        args.models, args.server_only, args.client_procs = "tiny", True, 1
    elif args.smoke:
        DEVICE = "cpu"
        args.models, args.streams, args.prompt_len, args.new_tokens, args.iters = "tiny", 4, 16, 8, 5
        args.hf_tokens, args.check_steps, args.slots, args.max_len, args.duration = 4, 4, 8, 256, 3.0
        args.client_procs, args.client_warmup = 2, 1.0
        if args.out == Path("benchmarks/results"):  # never overwrite measured results with a smoke run
            args.out = Path(tempfile.mkdtemp(prefix="gen-gpu-smoke-"))
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (or --smoke for a CPU check of the script)")
    args.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "none (on the CPU)",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if DEVICE == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "hbm_bytes_per_s_assumed": HBM_BYTES_PER_S,
        "note": "qwen1.5b has RANDOM weights (shape only); smollm2 is the real model. bf16 weights and KV.",
        "models": [],
    }
    suffix = "_server" if args.server_only else ""
    path = args.out / f"generation_gpu_{args.models.replace(',', '_')}{suffix}.json"
    if args.cpu_hostpath:
        path = args.out / "generation_cpu_hostpath.json"
    args.server = args.server or args.server_only
    for i, name in enumerate(args.models.split(",")):
        try:
            doc["models"].append(bench_model(name, args, server=args.server and i == 0))
        except Exception as exc:
            doc["models"].append({"model": name, "error": repr(exc)})
            log(f"{name} failed: {exc!r}")
        path.write_text(json.dumps(doc, indent=1, default=str))
        torch.cuda.empty_cache()
    try:
        if not args.server_only:
            plot(doc, path.with_suffix(".png"))
    except Exception as exc:  # a plot must never cost the measured numbers
        log(f"plot failed: {exc!r}")
    print(f"\nwrote {path}\n")
    print(f"{'model':10} {'what':34} {'value':>12}")
    for m in doc["models"]:
        if "error" in m:
            print(f"{m['model']:10} ERROR {m['error'][:100]}")
            continue
        if args.server_only:
            srv = m["server"]
            for k in ("tokens_per_s", "ttft_ms_median", "ttft_ms_p99", "itl_ms_median", "itl_ms_p99", "errors"):
                print(f"{m['model']:10} server {k:27} {srv[k]:12.3f}")
            for k, v in srv.get("steps", {}).items():
                print(f"{m['model']:10} step {k:29} {v:12.3f}")
            continue
        rows = [
            ("HF eager TPOT b=1 (ms)", m["hf_eager"]["batch1"]["tpot_ms"]),
            ("engine TPOT 1 stream (ms)", m["scheduler"]["streams1"]["tpot_ms_median"]),
            ("speed-up vs eager", m["tpot_speedup_vs_eager"]),
            *(
                [
                    ("engine thread async TPOT 1 (ms)", m["engine_thread"]["streams1"]["tpot_ms_median"]),
                    (
                        f"engine thread async tok/s {args.streams}",
                        m["engine_thread"][f"streams{args.streams}"]["tokens_per_s"],
                    ),
                ]
                if "engine_thread" in m
                else []
            ),
            ("graph step b=1 (ms)", m["decode_steps"][0]["gpu_step_ms_median"]),
            ("HBM floor b=1 (ms)", m["decode_steps"][0]["hbm_floor_ms"]),
            (f"engine tok/s {args.streams} streams", m["scheduler"][f"streams{args.streams}"]["tokens_per_s"]),
            (f"HF eager tok/s batch {args.streams}", m["hf_eager"][f"batch{args.streams}"]["tokens_per_s"]),
            ("greedy agreement vs HF fp32", m["check"]["greedy_agreement"]),
            ("warm-up (compile+graphs) s", m["engine_warmup_s"]),
        ]
        if "server" in m and "tokens_per_s" in m["server"]:
            rows += [
                ("server tok/s", m["server"]["tokens_per_s"]),
                ("server window tok/s", m["server"]["window_tokens_per_s"]),
                ("server TTFT p99 (ms)", m["server"]["ttft_ms_p99"]),
            ]
        for what, v in rows:
            print(
                f"{m['model']:10} {what:34} {v:12.3f}"
                if isinstance(v, float)
                else f"{m['model']:10} {what:34} {v!s:>12}"
            )


if __name__ == "__main__":
    main()
