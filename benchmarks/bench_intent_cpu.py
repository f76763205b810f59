"""CPU benchmark of the intent model: PyTorch eager fp32 vs ONNX Runtime fp32 vs ONNX Runtime int8.

Batch 1/8/32 × sequence 16/64 on this machine's cores, median and p99 after warm-up, random token ids
(fixed seed, several sets rotated), the eager baseline in the same run and the speed-up reported; plus
accuracy of each engine on the dev split. Writes JSON + PNG with hardware, versions and the command.

    python benchmarks/bench_intent_cpu.py            # builds the default engines first if missing
    python benchmarks/bench_intent_cpu.py --engines intent-fp32,intent --iters 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import psutil
import torch

from miaohui.engines.loader import load_engine
from miaohui.engines.store import read_manifest
from miaohui.engines.target import cpu_flags, cpu_name
from miaohui.models.checkpoint import load_checkpoint
from miaohui.nlp.tokenizer import TextTokenizer
from miaohui.paths import models_dir, repository_dir
from miaohui.prepare import DEFAULT_MODEL, prepare_defaults
from miaohui.validate.accuracy import run_logits
from miaohui.zoo.intents import load_split

SHAPES = [(1, 16), (1, 64), (8, 16), (8, 64), (32, 16), (32, 64)]


def feeds_for(b: int, s: int, n: int, vocab: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(b * 100 + s)
    out = []
    for _ in range(n):
        ids = rng.integers(5, min(vocab, 200_000), (b, s)).astype(np.int64)
        out.append({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    return out


def timed(fn: Any, sets: list[dict[str, np.ndarray]], warmup: int, iters: int) -> list[float]:
    time.sleep(IDLE_BETWEEN_S)  # let the previous runner's thread pool go idle (see IDLE_BETWEEN_S)
    for i in range(warmup):
        fn(sets[i % len(sets)])
    ms = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(sets[i % len(sets)])
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


IDLE_BETWEEN_S = 3.0
"""Pause before timing each runner. On this 2-core machine a runner timed right after another ONNX Runtime
session ran slower (int8 1x16: 4.3 ms right after the fp32 session, 2.5 ms right before it, same run): that
session's intra-op threads spin-wait for work after their last run and take the cores."""


def iters_for(b: int, s: int, base: int) -> int:
    return max(5, base * 16 // max(16, b * s // 4))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the prepared intent model)")
    p.add_argument("--engines", default="intent-fp32,intent", help="repository names to compare")
    p.add_argument("--repository", type=Path, default=None)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/intent_cpu.json"))
    args = p.parse_args()
    repo = args.repository or repository_dir()
    model_dir = args.model or models_dir() / DEFAULT_MODEL
    if args.model is None:
        prepare_defaults(repo, log=lambda m: print("·", m))
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    loaded = load_checkpoint(model_dir)
    module = loaded.module.eval()
    tok = TextTokenizer(loaded.tokenizer, loaded.meta.max_length)
    dev = load_split("dev")
    labels = loaded.meta.labels

    def torch_fn(f: dict[str, np.ndarray]) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(f["input_ids"]), torch.from_numpy(f["attention_mask"])).numpy()

    runners: dict[str, Any] = {"torch eager fp32": torch_fn}
    meta: dict[str, Any] = {}
    seen: set[str] = set()
    for name in args.engines.split(","):
        path = repo / name / str(max(int(v.name) for v in (repo / name).iterdir() if v.name.isdigit()))
        engine = load_engine(path, threads=args.threads)
        m = read_manifest(path)
        label = (
            f"{m.backend} {m.precision}"
            if len(args.engines.split(",")) <= 2 and m.precision not in seen
            else f"{name} ({m.backend} {m.precision})"
        )
        seen.add(m.precision)
        runners[label] = lambda f, e=engine, o=m.outputs[0].name: e.infer(f)[o]
        meta[label] = {"artifact": str(path), "build_key": m.build_key, "calibration": m.extra.get("calibration")}

    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "cpu_flags": list(cpu_flags()),
        "threads": args.threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "load_average_before": os.getloadavg(),
        "model": str(model_dir),
        "engines": meta,
        "rows": [],
        "accuracy": {},
    }
    gold = [x.intent for x in dev]
    for label, fn in runners.items():
        logits = run_logits(fn, tok, [x.text for x in dev])
        results["accuracy"][label] = float(
            np.mean([labels[i] == g for i, g in zip(logits.argmax(-1), gold, strict=True)])
        )
    vocab = int(loaded.meta.bert_config["vocab_size"])
    for b, s in SHAPES:
        sets = feeds_for(b, s, 4, vocab)
        n = iters_for(b, s, args.iters)
        base = None
        for label, fn in runners.items():
            ms = timed(fn, sets, args.warmup, n)
            med, p99 = float(np.median(ms)), float(np.percentile(ms, 99))
            base = med if base is None else base
            row = {
                "engine": label,
                "batch": b,
                "seq": s,
                "median_ms": med,
                "p99_ms": p99,
                "iters": n,
                "speedup_vs_eager": base / med,
            }
            results["rows"].append(row)
            print(f"{label:22s} {b:3d}x{s:<3d} median {med:8.2f} ms  p99 {p99:8.2f}  x{base / med:5.2f}", flush=True)
    results["load_average_after"] = os.getloadavg()
    results["cpu_percent_other_processes"] = psutil.cpu_percent(interval=0.5)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print("\naccuracy on dev:", {k: f"{v:.2%}" for k, v in results["accuracy"].items()})
    print(f"{'engine':22s} {'shape':8s} {'median ms':>10s} {'p99 ms':>8s} {'x eager':>8s}")
    for r in results["rows"]:
        print(
            f"{r['engine']:22s} {r['batch']}x{r['seq']:<6d} {r['median_ms']:10.2f} {r['p99_ms']:8.2f} "
            f"{r['speedup_vs_eager']:8.2f}"
        )


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    shapes = list(dict.fromkeys((r["batch"], r["seq"]) for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(engines)
    for i, e in enumerate(engines):
        med = [next(r["median_ms"] for r in rows if r["engine"] == e and (r["batch"], r["seq"]) == s) for s in shapes]
        spd = [
            next(r["speedup_vs_eager"] for r in rows if r["engine"] == e and (r["batch"], r["seq"]) == s)
            for s in shapes
        ]
        x = np.arange(len(shapes)) + i * width
        ax1.bar(x, med, width, label=f"{e} (dev acc {results['accuracy'][e]:.1%})")
        ax2.bar(x, spd, width, label=e)
    for ax in (ax1, ax2):
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, [f"b{b} s{s}" for b, s in shapes])
    ax1.set_yscale("log")
    ax1.set_ylabel("median latency, ms (log)")
    ax2.set_ylabel("speed-up over PyTorch eager fp32")
    ax2.axhline(1, color="grey", lw=0.8)
    ax1.legend(fontsize=8)
    ax1.set_title(f"e5-small intent on {results['cpu']} ({results['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
