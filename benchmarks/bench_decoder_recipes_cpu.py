"""Which SmolLM2 recipe should ``make run`` serve? Speed at one stream on ONNX Runtime and the decoder gate's
figures, one row per recipe:

    .venv/bin/python benchmarks/bench_decoder_recipes_cpu.py [--new-tokens 64] [--runs 3] [--out benchmarks/results]

* recipes: ``fp32``; ``int4`` (4-bit weight blocks as llama.cpp's Q4_1, an 8-bit LM head, fp32 arithmetic);
  ``int8`` weight-only (8-bit blocks, int8 dot products); ``int8-edges`` (the
  same with the first and last blocks and the LM head fp32); ``int8-a32`` (8-bit weights, fp32 compute); and on
  llama.cpp (``--backend llamacpp``): ``llamacpp-q4_1`` (the shipped GGUF as it is), ``llamacpp-q8_0`` and
  ``llamacpp-f16`` (GGUFs miaohui writes from the fp32 model: ``--precision q8_0|f16``).
* fp32 is built with ``build_causal_lm`` into ``--repository`` (default ``$MIAOHUI_HOME/bench-recipes``; reused
  while its build key holds); each int8 recipe is ``quantize_decoder`` (int4: ``quantize_decoder_int4``) on that
  fp32 graph (what ``build_causal_lm`` does after its own export, without exporting again) as a version of its own;
  each is gated with
  :func:`miaohui.validate.decoder_gate.run_decoder_gate` against the fp32 model in PyTorch.
* speed: the engine alone (``OrtCausalLMEngine``; ``LlamaCppLLMEngine`` for llama.cpp, 2 threads), batch 1: one
  chat prompt's prefill (TTFT) then
  ``--new-tokens`` greedy decode steps; TPOT = median step, over ``--runs`` runs after one warm-up run. The machine
  is shared: the 1-minute load average is recorded per recipe, and absolute numbers are noisy; compare rows.

Writes (merges its recipes into) ``decoder_recipes_cpu.json``; prints the table last. ``--recipes int8-edges``
runs one recipe; recipes run separately end up in the same file.
"""

from __future__ import annotations

import argparse
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

from miaohui.bench.report import git_commit
from miaohui.generation.build.artifact import MARKER_NAME, ChatTokenizer, LLMPrecision, build_causal_lm, read_info
from miaohui.generation.build.export import Int8Method, quantize_decoder, quantize_decoder_int4
from miaohui.generation.executors.ort_engine import OrtCausalLMEngine
from miaohui.paths import home
from miaohui.validate.decoder_gate import run_decoder_gate

RECIPES: dict[str, tuple[LLMPrecision, Int8Method]] = {
    "fp32": ("fp32", "weight-only"),
    "int4": ("int4", "weight-only"),
    "int8": ("int8", "weight-only"),
    "int8-edges": ("int8", "weight-only-edges"),
    "int8-a32": ("int8", "weight-only-a32"),
}
LLAMACPP: dict[str, str] = {"llamacpp-q4_1": "gguf", "llamacpp-q8_0": "q8_0", "llamacpp-f16": "f16"}
"""llama.cpp recipes: ``build-llm --backend llamacpp --precision`` of each."""
ORDER = [*RECIPES, *LLAMACPP]
VERSIONED = ("onnxruntime", "torch", "transformers", "numpy", "xllamacpp", "gguf")
PROMPT = "Explain what a bank deposit is in two sentences."


def speed(folder: Path, new_tokens: int, runs: int) -> dict[str, float]:
    info = read_info(folder)
    ids = ChatTokenizer.from_dir(folder, info).encode_chat([{"role": "user", "content": PROMPT}])
    engine = OrtCausalLMEngine(folder)
    ttft, steps = [], []
    for run in range(runs + 1):
        t0 = time.perf_counter()
        logits, kv = engine.prefill([ids])
        t1 = time.perf_counter()
        gaps = []
        for _ in range(new_tokens - 1):
            s = time.perf_counter()
            logits, kv = engine.decode([int(logits[0].argmax())], kv)
            gaps.append(time.perf_counter() - s)
        if run:  # run 0 warms up
            ttft.append(t1 - t0)
            steps += gaps
    tpot = statistics.median(steps) * 1e3
    return {
        "prompt_tokens": len(ids),
        "ttft_ms": round(statistics.median(ttft) * 1e3, 2),
        "tpot_ms": round(tpot, 2),
        "tokens_per_s": round(1e3 / tpot, 1),
        "model_mb": round((folder / "model.onnx").stat().st_size / 2**20, 1),
    }


def llamacpp_speed(folder: Path, new_tokens: int, runs: int) -> dict[str, float]:
    import asyncio

    from miaohui.generation.engine.llamacpp_engine import LlamaCppLLMEngine
    from miaohui.generation.engine.params import SamplingParams
    from miaohui.generation.engine.scheduler import SchedulerConfig

    info = read_info(folder)
    ids = ChatTokenizer.from_dir(folder, info).encode_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def measure() -> tuple[list[float], list[float]]:
        sched = SchedulerConfig(max_running_seqs=1, max_model_len=1024)
        ttft: list[float] = []
        steps: list[float] = []
        async with LlamaCppLLMEngine(folder, sched, threads=2) as engine:
            for run in range(runs + 1):
                t0 = time.perf_counter()
                times = [time.perf_counter() async for _ in engine.generate(ids, params)]
                if run:  # run 0 warms up
                    ttft.append(times[0] - t0)
                    steps += [b - a for a, b in itertools.pairwise(times)]
        return ttft, steps

    ttft, steps = asyncio.run(measure())
    tpot = statistics.median(steps) * 1e3
    return {
        "prompt_tokens": len(ids),
        "ttft_ms": round(statistics.median(ttft) * 1e3, 2),
        "tpot_ms": round(tpot, 2),
        "tokens_per_s": round(1e3 / tpot, 1),
        "model_mb": round((folder / "model.gguf").stat().st_size / 2**20, 1),
    }


def _llamacpp_version(repo: Path, name: str) -> Path:
    return build_causal_lm(repo, f"smollm2-{name}", LLAMACPP[name], backend="llamacpp", log=print)


def _version(repo: Path, name: str, precision: LLMPrecision, method: Int8Method) -> Path:
    fp32 = build_causal_lm(repo, "smollm2-fp32", "fp32", log=print)
    if precision == "fp32":
        return fp32
    folder = repo / f"smollm2-{name}" / "1"
    if not folder.is_dir():
        if precision == "int4":
            quantize_decoder_int4(fp32, folder)
        else:
            quantize_decoder(fp32, folder, method)
        int8_method = method if precision == "int8" else None
        info = read_info(fp32).model_copy(
            update={"name": folder.parent.name, "precision": precision, "int8_method": int8_method, "build_key": name}
        )
        (folder / MARKER_NAME).write_text(info.model_dump_json(indent=2), encoding="utf-8")
    return folder


def _merge(path: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Write ``rows`` into ``path``, keeping the rows of other recipes already there (recipes may run separately)."""
    from filelock import FileLock

    commit = git_commit() or "unknown"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        old = json.loads(path.read_text()) if path.is_file() else {"rows": []}
        mine = {r["recipe"] for r in rows}
        kept = [r for r in old["rows"] if r["recipe"] not in mine]
        for r in rows:
            r |= {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": commit,
                  "command": shlex.join([sys.executable, *sys.argv])}  # fmt: skip
        doc = {
            "benchmark": "decoder_recipes_cpu",
            "hardware": {"cpu": _cpu_name(), "cores": os.cpu_count()},
            "versions": {p: metadata.version(p) for p in VERSIONED},
            "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32)",
            "settings": {"new_tokens": args.new_tokens, "runs": args.runs, "streams": 1, "prompt": PROMPT},
            "note": "machine shared with other jobs (2 cores; load average in each row): absolute times are noisy",
            "rows": sorted(kept + rows, key=lambda r: ORDER.index(r["recipe"])),
        }
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    Path(str(path) + ".lock").unlink(missing_ok=True)
    return doc


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repository", type=Path, default=None)
    ap.add_argument("--recipes", default=",".join(ORDER))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    repo = args.repository or home() / "bench-recipes"
    rows = []
    for name in args.recipes.split(","):
        if name in LLAMACPP:
            folder = _llamacpp_version(repo, name)
            gate = run_decoder_gate(folder)
            load = os.getloadavg()[0]
            row = {"recipe": name, "precision": read_info(folder).precision, "int8_method": None}
            row |= llamacpp_speed(folder, args.new_tokens, args.runs)
        else:
            precision, method = RECIPES[name]
            folder = _version(repo, name, precision, method)
            gate = run_decoder_gate(folder)
            load = os.getloadavg()[0]
            row = {"recipe": name, "precision": precision, "int8_method": method if precision == "int8" else None}
            row |= speed(folder, args.new_tokens, args.runs)
        row |= {
            "exact_match": round(gate.exact_match, 4),
            "teacher_forced": round(gate.teacher_forced, 4),
            "factual": gate.factual,
            "factual_counted": gate.factual_counted,
            "gate_passed": gate.passed,
            "gate_failures": gate.failures,
            "load_avg_1m": round(load, 2),
        }
        rows.append(row)
        print(json.dumps(row, ensure_ascii=False), flush=True)
    rows = _merge(args.out / "decoder_recipes_cpu.json", rows, args)["rows"]
    print(
        f"\n{'recipe':<14} {'TTFT ms':>8} {'TPOT ms':>8} {'tok/s':>6} {'MB':>6} {'exact':>6} {'TF':>6} {'fact':>5} gate"
    )
    for r in rows:
        fact = "n/a" if r["factual"] is None else f"{r['factual']:.0%}"
        print(
            f"{r['recipe']:<14} {r['ttft_ms']:>8.1f} {r['tpot_ms']:>8.2f} {r['tokens_per_s']:>6.1f} "
            f"{r['model_mb']:>6.1f} "
            f"{r['exact_match']:>6.1%} {r['teacher_forced']:>6.1%} {fact:>5} {'pass' if r['gate_passed'] else 'FAIL'}"
        )


if __name__ == "__main__":
    main()
