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
   the client processes start together once all have imported (``generation_server_load.CLIENT_START_S``) and
   measure one common window;
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
import copy
import itertools
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from generation_server_load import log, pct, random_prompts, server_load
from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.static_kv import StaticKVDecoder

HBM_BYTES_PER_S = 4.3e12
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
