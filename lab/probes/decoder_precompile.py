"""Where a GPU decoder's start goes once its compile cache is loaded, and what Dynamo's precompile cache or eager
CUDA graphs would save (issue 43, goal 2: ready in <= 10 s for a 1.5B decoder).

    python -m lab.probes.decoder_precompile --out DIR           (on a GPU; ~5 min at the 1.5B shape)

Runs each step in a fresh process with new empty TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR, a Qwen2-1.5B-shaped
``TorchSlotEngine`` with random weights and the options ``serve`` chooses without a generation.yaml:

1. ``build``: warm-up (compiles every bucket) with ``TORCH_CACHING_PRECOMPILE=1``, then
   ``torch.compiler.save_cache_artifacts()`` into DIR/cache.bin (Inductor's entries and Dynamo's precompile entries)
   and the Triton kernels the warm-up compiled into DIR/triton.tar (as ``build-llm`` saves them);
2. ``load``: load cache.bin and triton.tar, warm-up: the serve path (Dynamo traces, Inductor hits), with a stack
   sampler on the warm-up (every 5 ms: the functions on the main thread's stack, inclusive, and the innermost);
3. ``load-precompile``: the same with ``TORCH_CACHING_PRECOMPILE=1`` (Dynamo's traced bytecode from the cache);
4. ``eager``: ``compile=False``: the same graphs captured from the eager layers (no Dynamo, no Inductor);
each prints its warm-up split (compile / capture) and, for 2–4, the replay time of the decode graph at batch 1 and
64 (length bucket 512). Writes DIR/decoder_precompile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS = ("build", "load", "load-precompile", "eager")


class StackSampler:
    """Every 5 ms, the main thread's stack: how often each function is on it (inclusive) and innermost."""

    def __init__(self) -> None:
        import threading

        self.main = threading.main_thread().ident
        self.inclusive: dict[str, int] = {}
        self.leaf: dict[str, int] = {}
        self.n = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.005):
            frame = sys._current_frames().get(self.main)
            seen: set[str] = set()
            leaf = True
            while frame is not None:
                code = frame.f_code
                key = f"{Path(code.co_filename).name}:{code.co_name}"
                if leaf:
                    self.leaf[key] = self.leaf.get(key, 0) + 1
                    leaf = False
                if key not in seen:
                    seen.add(key)
                    self.inclusive[key] = self.inclusive.get(key, 0) + 1
                frame = frame.f_back
            self.n += 1

    def stop(self) -> dict[str, Any]:
        self.done.set()
        self.thread.join()
        top = sorted(self.inclusive.items(), key=lambda kv: -kv[1])[:60]
        leaf = sorted(self.leaf.items(), key=lambda kv: -kv[1])[:40]
        return {"n": self.n, "inclusive": top, "leaf": leaf}


def one(step: str, cache: Path, layers: int) -> dict[str, Any]:
    import torch

    from miaohui.generation.executors.compile_clock import cache_counters
    from miaohui.generation.executors.slot_defaults import choose_defaults
    from miaohui.generation.executors.slot_engine import TorchSlotEngine
    from miaohui.generation.models.dims import DecoderDims
    from miaohui.generation.models.static_kv import StaticKVDecoder

    started = time.perf_counter()
    dims = DecoderDims(layers, 1536, 12, 2, 128, 8960, 49152, 1000000.0, 1e-6, 32768)
    chosen = choose_defaults(
        {"hidden": 1536, "num_layers": layers, "num_heads": 12, "num_kv_heads": 2, "head_dim": 128,
         "intermediate": 8960, "vocab": 49152, "max_positions": 32768},
        torch.cuda.mem_get_info()[1],
    )  # fmt: skip
    opts = chosen.engine
    if step == "eager":
        opts = opts.model_copy(update={"compile": False})
    out: dict[str, Any] = {"step": step}
    from miaohui.engines.fast_graphs import pack, private_triton_cache, restore_triton_cache

    triton_tar = cache.with_name("triton.tar")
    if step.startswith("load"):
        t0 = time.perf_counter()
        loaded = torch.compiler.load_cache_artifacts(cache.read_bytes())
        out["cache_load_s"] = round(time.perf_counter() - t0, 2)
        out["cache_entries"] = {k: len(v) for k, v in loaded.artifacts.items()} if loaded else None
        out["triton_restored"] = restore_triton_cache(triton_tar)
    dec = StaticKVDecoder(dims, num_slots=opts.num_slots, max_len=opts.max_len, dtype=torch.bfloat16, device="cuda")
    dec.init_random(0)
    engine = TorchSlotEngine(dec, [], 0, opts)
    captures: list[tuple[float, float]] = []  # (start, seconds) of each graph capture, from the warm-up's start
    capture_one = engine._capture_one
    w0 = time.perf_counter()

    def timed(step_fn: Any, pool: Any) -> Any:
        t = time.perf_counter()
        got = capture_one(step_fn, pool)
        captures.append((round(t - w0, 3), round(time.perf_counter() - t, 3)))
        return got

    engine._capture_one = timed  # type: ignore[method-assign]
    sampler = StackSampler() if step == "load" else None
    import contextlib

    with private_triton_cache() if step == "build" else contextlib.nullcontext(None) as private:
        if sampler:
            sampler.start()
        engine.warmup(log=lambda m: print(m, file=sys.stderr, flush=True))
        if sampler:
            out["samples"] = sampler.stop()
        if private is not None:
            out["triton_files"] = pack(private, triton_tar)
    out["captures"] = {"n": len(captures), "total_s": round(sum(c[1] for c in captures), 2),
                       "slowest": sorted(captures, key=lambda c: -c[1])[:12], "all": captures}  # fmt: skip
    out |= {"warmup_s": round(engine.warmup_seconds or 0.0, 2), "phases": engine.start_phases}
    out["counters"] = cache_counters()
    out["graphs"] = [len(engine._graphs), len(engine._prefill_graphs), len(engine._mixed_graphs)]
    if step == "build":
        saved = torch.compiler.save_cache_artifacts()
        assert saved is not None
        cache.write_bytes(saved[0])
        out["cache_bytes"] = len(saved[0])
    else:
        for b in (1, 64):
            graph, _ = engine._graphs[(b, 512)]
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                graph.replay()
            torch.cuda.synchronize()
            out[f"decode_b{b}_t512_ms"] = round((time.perf_counter() - t0) / 200 * 1e3, 4)
    out["process_s"] = round(time.perf_counter() - started, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--step", choices=STEPS, help="(internal) run one step in this process")
    ap.add_argument("--cache", type=Path)
    args = ap.parse_args()
    if args.step:
        print("RESULT " + json.dumps(one(args.step, args.cache, args.layers)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="precompile-"))
    cache = work / "cache.bin"
    results = []
    for step in STEPS:
        env = dict(os.environ)
        env |= {"TORCHINDUCTOR_CACHE_DIR": str(work / f"c-{step}"), "TRITON_CACHE_DIR": str(work / f"t-{step}")}
        env.pop("TORCH_CACHING_PRECOMPILE", None)
        if step in ("build", "load-precompile"):
            env["TORCH_CACHING_PRECOMPILE"] = "1"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "lab.probes.decoder_precompile", "--step", step, "--cache", str(cache),
             "--layers", str(args.layers)],
            env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        got = json.loads(lines[-1][7:]) if lines else {"step": step, "rc": proc.returncode}
        got["wall_s"] = round(time.perf_counter() - t0, 1)
        if proc.returncode:
            got["stderr_tail"] = proc.stderr[-2000:]
        else:
            got["log"] = [ln for ln in proc.stderr.splitlines() if "ready in" in ln or "captured" in ln][-6:]
        print(json.dumps(got), flush=True)
        results.append(got)
        (args.out / "decoder_precompile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
