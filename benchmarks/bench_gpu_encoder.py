"""GPU encoder benchmark: PyTorch eager fp32/fp16, torch.compile, and miaohui's ``inductor`` engine.

Models: a BERT-base-shaped classifier (12 x 768, RANDOM weights — shape is what matters for speed), the
real e5-small intent model (trained by ``miaohui train-intent``), and ``e5-shape``, a RANDOM-weight model of
e5-small's shape (``scripts/gpu/e5_shape_model.py``: for a call that cannot carry the real weights). Shapes
(batch, seq) as given.

Times: CUDA events around the model call (inputs already on the GPU, outputs left there) — for our engine
that is one CUDA-graph replay, its inputs written into the bucket's buffers before the first event (TensorRT's
``trtexec`` "GPU compute time" measures the same) — median and p99 over ``--iters`` runs after warm-up, random
token ids (never zeros), several input sets rotated. Next to each engine row: ``engine_input_copies`` times the two
device copies into the bucket inside the events as well (their launches from Python leave the GPU
idle between them); ``engine_graph_copies`` replays the serving graph, whose pinned host → device input copy and
output copy back are captured in it (``graph_copies``, the server's default). ``engine_e2e`` is the engine's whole
``infer()`` (pinned H2D copy, replay, D2H, sync) timed on the host; ``engine_copies_e2e`` the same with the copies
captured inside the graph. ``engine_fp16`` is built with ``--gpu-kernels tuned`` (the GPU's tuning file),
``engine_fp16_library`` with ``--gpu-kernels library``: the A/B of the tuned kernels. A ``_static`` variant is built
with ``--static-shapes`` set to the benchmark's shapes (each of them a program compiled for exactly that shape).
``--tuning DIR`` reads the GPU's tuning file from DIR first (a file ``scripts/gpu/tune.py`` just wrote, before it is
committed). ``--rounds N`` times the engine variants N times, one after another per round, so run-to-run drift shows.
``--alternate`` also times the engine variants' replays call by call in turn (rows ``<variant>_alternating``, with the
median per-call difference from the first variant): the A/B for differences smaller than the drift between rounds.
Every variant's output is checked
against fp32 eager (relative error).

    python benchmarks/bench_gpu_encoder.py --models bert-base,e5-intent --out benchmarks/results/gpu_encoder.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miaohui.config import BuildConfig, parse_shapes
from miaohui.engines.inductor_engine import InductorEngine
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact
from miaohui.models.checkpoint import load_checkpoint

ENGINE_VARIANTS = (
    "engine_fp16",
    "engine_bf16",
    "engine_fp16_library",
    "engine_fp16_static",
    "engine_fp16_static_library",
)
"""miaohui's engine as built by ``miaohui build``: precision, ``--gpu-kernels tuned`` or ``library``,
``--static-shapes`` (the benchmark's shapes)."""

PEAK_TFLOPS = 790.0  # measured bf16 dense matrix rate of the H200 here (shared/GPU.md)


def flops(cfg: Any, b: int, s: int, labels: int) -> float:
    """Matrix FLOPs of one forward: linear layers + attention scores/values + head."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    per_token = 2 * (4 * h * h + 2 * h * inter)
    attn = 2 * 2 * s * s * h
    return layers * (b * s * per_token + b * attn) + 2 * b * h * labels


def bert_base_checkpoint(root: Path) -> Path:
    from miaohui.models.tiny import save_bert_base_intent

    return save_bert_base_intent(root / "bert-base-random")


def inputs(vocab: int, b: int, s: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(5, vocab, (b, s), generator=g)
        out.append((ids.cuda(), torch.ones_like(ids).cuda()))
    return out


def time_cuda(fn: Any, sets: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, iters: int) -> list[float]:
    """CUDA events around ``fn(ids, mask)``; for a :class:`Replay`, around its replay alone (its inputs staged
    before the first event)."""
    staged = isinstance(fn, Replay)
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if staged:
            fn.stage(*sets[i % len(sets)])
            starts[i].record()
            fn.replay()
        else:
            starts[i].record()
            fn(*sets[i % len(sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def time_alternating(
    fns: dict[str, Replay], sets: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, iters: int
) -> dict[str, list[float]]:
    """The engines' replays timed call by call in turn (the order reversed every other call), so a drift of the GPU's
    speed over the run hits each alike: ``--alternate``, the A/B for differences smaller than the drift between
    rounds."""
    names = list(fns)
    for i in range(warmup):
        for fn in fns.values():
            fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    events = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
              for n in names}  # fmt: skip
    for i in range(iters):
        for n in names if i % 2 == 0 else names[::-1]:
            fns[n].stage(*sets[i % len(sets)])
            events[n][i][0].record()
            fns[n].replay()
            events[n][i][1].record()
    torch.cuda.synchronize()
    return {n: [s.elapsed_time(e) for s, e in events[n]] for n in names}


def summary(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean())}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp(min=1e-12))


class Replay:
    """The engine's CUDA graph of a call's bucket: :meth:`stage` writes the inputs into the bucket's buffers (device
    copies; with ``graph_copies``, the pinned host buffer the graph copies from), :meth:`replay` runs the graph.
    Called as ``fn(ids, mask)``, both (``engine_input_copies``)."""

    def __init__(self, engine: InductorEngine) -> None:
        self.engine = engine
        self.k: Any = None
        self.b = 0

    def stage(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        b, s = ids.shape
        bb, ss = self.engine.bucket(b, s)
        self.engine.capture(bb, ss)
        self.k, self.b = self.engine._graphs[(bb, ss)], b
        if self.k.copies:  # the graph copies host_io in: write it on the host, as a batch does
            self.k.host_io[0, :b, :s].copy_(ids)
            self.k.host_io[1, :b, :s].copy_(mask)
        else:  # the bucket's inputs are the two halves of one device tensor
            self.k.io[0, :b, :s].copy_(ids)
            self.k.io[1, :b, :s].copy_(mask)

    def replay(self) -> None:
        self.k.graph.replay()

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.stage(ids, mask)
        self.replay()
        out: torch.Tensor = self.k.out[: self.b]
        return out


def with_input_copies(replay: Replay) -> Any:
    """The engine's time with the two device input copies inside the events."""
    return lambda ids, mask: replay(ids, mask)


def kernel_table(fn: Any, args: tuple[torch.Tensor, torch.Tensor], calls: int = 20, top: int = 15) -> dict[str, Any]:
    """The CUDA kernels of ``calls`` calls of ``fn`` (an engine replay: the graph's kernels), per call: each kernel's
    summed duration and its exclusive time (:mod:`miaohui.bench.kernel_timeline`: under PDL a kernel's duration
    includes its wait for the one before), the busy time and the summed durations (``device_us_per_call``)."""
    from torch.profiler import ProfilerActivity, profile

    from miaohui.bench.kernel_timeline import cuda_kernels, summarize

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    table = summarize(cuda_kernels(prof), calls, top)
    return table | {"device_us_per_call": table["duration_us_per_call"]}


def run_model(name: str, ckpt: Path, args: argparse.Namespace, repo: Path, results: dict[str, Any]) -> None:
    loaded = load_checkpoint(ckpt)
    cfg, labels = loaded.module.encoder.config, len(loaded.meta.labels)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    max_b, max_s = max(b for b, _ in shapes), max(s for _, s in shapes)
    hf32 = loaded.module.cuda().eval()
    variants: dict[str, Any] = {}
    compile_s: dict[str, float] = {}
    if "eager_fp32" in args.variants:
        variants["eager_fp32"] = hf32
    if "eager_fp16" in args.variants:
        variants["eager_fp16"] = load_checkpoint(ckpt).module.cuda().half().eval()
    if "compile_fp16" in args.variants:
        m16 = load_checkpoint(ckpt).module.cuda().half().eval()
        variants["compile_fp16"] = torch.compile(m16, mode="reduce-overhead", dynamic=True)
    for variant in ENGINE_VARIANTS:
        if variant not in args.variants.split(","):
            continue
        prec = variant.split("_")[1]
        kernels = "library" if variant.endswith("_library") else "tuned"  # gpu_kernels: the A/B of the same build
        static = ",".join(f"{b}x{s}" for b, s in shapes) if "_static" in variant else ""  # static_shapes
        t0 = time.perf_counter()
        prof = f"input_ids:1x1,{min(32, max_b)}x{min(128, max_s)},{max_b}x{max_s}"
        bcfg = BuildConfig(
            backend="inductor",
            precision=prec,
            shapes=parse_shapes(prof),
            autotune=args.autotune,
            inductor_format=args.inductor_format,
            gpu_kernels=kernels,
            static_shapes=static,  # type: ignore[arg-type]
        )
        try:
            out = build_artifact(
                ckpt,
                f"{name}-{prec}" + ("-library" if kernels == "library" else "") + ("-static" if static else ""),
                bcfg,
                repo,
                log=lambda m: print("  ·", m, flush=True),
            )
        except Exception as exc:  # keep the other variants' numbers
            results.setdefault("errors", []).append(f"{name}/{variant} build: {exc!r}")
            print("BUILD FAILED", name, variant, repr(exc)[:2000], flush=True)
            continue
        compile_s[variant] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine = load_engine(out.path)
        assert isinstance(engine, InductorEngine)
        engine.graph_copies = False  # Replay writes the bucket's device inputs itself
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.infer({"input_ids": np.full((1, 16), 5, np.int64), "attention_mask": np.ones((1, 16), np.int64)})
        results.setdefault("cold_start", {})[f"{name}/{variant}"] = {
            "load_s": round(load_s, 3),
            "first_bucket_capture_s": round(time.perf_counter() - t0, 3),
            "build_s": round(compile_s[variant], 1),
        }
        variants[variant] = Replay(engine)
        variants[f"{variant}_input_copies"] = with_input_copies(variants[variant])
        variants[f"{variant}_e2e"] = engine
        # the same whole infer() with the copies captured inside each graph (config.yaml graph_copies: true)
        served = load_engine(out.path, graph_copies=True)
        variants[f"{variant}_copies_e2e"] = served
        variants[f"{variant}_graph_copies"] = Replay(served)  # type: ignore[arg-type]
    rows = results.setdefault("rows", [])
    for b, s in shapes:
        sets = inputs(cfg.vocab_size, b, s, 4, seed=b * 1000 + s)
        with torch.inference_mode():
            ref = hf32(*sets[0]).float()
            if args.alternate:
                alternate(name, cfg, labels, b, s, variants, sets, args, rows)
            rounds = [(r, v, fn) for r in range(args.rounds) for v, fn in variants.items() if r == 0 or "engine" in v]
            for rnd, vname, fn in rounds:
                try:
                    if vname.endswith("_e2e"):
                        feeds = {"input_ids": sets[0][0].cpu().numpy(), "attention_mask": sets[0][1].cpu().numpy()}
                        for _ in range(args.warmup):
                            fn.infer(feeds)
                        ms = []
                        for _ in range(args.iters):
                            t0 = time.perf_counter()
                            fn.infer(feeds)
                            ms.append((time.perf_counter() - t0) * 1e3)
                        err = rel_err(torch.from_numpy(fn.infer(feeds)["logits"]).cuda(), ref)
                    else:
                        t0 = time.perf_counter()
                        fn(*sets[0])
                        torch.cuda.synchronize()
                        first = time.perf_counter() - t0
                        if vname.startswith("compile"):
                            compile_s[f"{vname}@{b}x{s}"] = round(first, 2)
                        ms = time_cuda(fn, sets, args.warmup, args.iters)
                        err = rel_err(fn(*sets[0]), ref)
                    st = summary(ms)
                    row = {
                        "model": name,
                        "variant": vname,
                        "batch": b,
                        "seq": s,
                        "round": rnd,
                        **st,
                        "rel_err": err,
                        "tflops": flops(cfg, b, s, labels) / (st["median_ms"] * 1e-3) / 1e12,
                    }
                    row["peak_fraction"] = row["tflops"] / PEAK_TFLOPS
                    if args.profile and rnd == 0 and vname.startswith("engine") and not vname.endswith("_e2e"):
                        row["kernels"] = kernel_table(fn, sets[0])
                        kt = row["kernels"]
                        for k in kt["top"]:
                            print(f"  kernel {b}x{s} {k['exclusive_us_per_call']:8.1f} us alone "
                                  f"({k['us_per_call']:8.1f} us) {k['per_call']:5.1f}x {k['kernel']}")  # fmt: skip
                        print(f"  kernels {b}x{s}: {kt['kernels_per_call']:.0f} per call, {kt['busy_us_per_call']:.1f} "
                              f"us busy, {kt['duration_us_per_call']:.1f} us summed", flush=True)  # fmt: skip
                    rows.append(row)
                    print(
                        f"{name:10s} {vname:18s} {b:4d}x{s:<4d} median {st['median_ms']:8.3f} ms  p99 "
                        f"{st['p99_ms']:8.3f}  {row['tflops']:7.1f} TFLOP/s  rel err {err:.1e}",
                        flush=True,
                    )
                    Path(args.out).write_text(json.dumps(results, indent=1))
                except Exception as exc:  # one failing variant must not lose the others
                    results.setdefault("errors", []).append(f"{name}/{vname}@{b}x{s}: {exc!r}")
                    print("FAILED", name, vname, b, s, repr(exc)[:1000], flush=True)
    results.setdefault("compile_seconds", {})[name] = compile_s
    del variants
    torch.cuda.empty_cache()


def alternate(
    name: str,
    cfg: Any,
    labels: int,
    b: int,
    s: int,
    variants: dict[str, Any],
    sets: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
) -> None:
    """``--alternate``: the engine variants' replays at ``b``×``s`` timed in turn (:func:`time_alternating`); rows
    named ``<variant>_alternating``, each with its median per-call difference from the first variant's."""
    fns = {v: fn for v, fn in variants.items() if v in ENGINE_VARIANTS}
    times = time_alternating(fns, sets, args.warmup, args.iters * args.rounds)
    first = np.asarray(times[next(iter(fns))])
    for v, ms in times.items():
        st = summary(ms)
        diff = float(np.median(np.asarray(ms) - first))
        tflops = flops(cfg, b, s, labels) / (st["median_ms"] * 1e-3) / 1e12
        row = {"model": name, "variant": f"{v}_alternating", "batch": b, "seq": s, "round": 0, **st}
        rows.append(row | {"median_diff_vs_first_ms": diff, "tflops": tflops, "peak_fraction": tflops / PEAK_TFLOPS})
        print(f"{name:10s} {v + '_alt':18s} {b:4d}x{s:<4d} median {st['median_ms']:8.3f} ms  p99 {st['p99_ms']:8.3f}  "
              f"per-call difference from {next(iter(fns))}: {diff * 1e3:+.1f} us", flush=True)  # fmt: skip


def speedups(rows: list[dict[str, Any]]) -> None:
    base = {(r["model"], r["batch"], r["seq"]): r["median_ms"] for r in rows if r["variant"] == "eager_fp32"}
    for r in rows:
        key = (r["model"], r["batch"], r["seq"])
        if key in base:
            r["speedup_vs_eager_fp32"] = base[key] / r["median_ms"]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mrows = [r for r in rows if r["model"] == model]
        shapes = sorted({(r["batch"], r["seq"]) for r in mrows})
        variants = sorted({r["variant"] for r in mrows})
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            ys = [
                next((r["median_ms"] for r in mrows if r["variant"] == v and (r["batch"], r["seq"]) == s), np.nan)
                for s in shapes
            ]
            ax.bar(np.arange(len(shapes)) + i * width, ys, width, label=v)
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, [f"{b}x{s}" for b, s in shapes])
        ax.set_yscale("log")
        ax.set_ylabel("median ms (log)")
        ax.set_title(f"{model} on {torch.cuda.get_device_name()}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tuning_runtime() -> dict[str, Any]:
    """The tuning file this GPU's tuned builds read (name and digest), for the results."""
    from miaohui.models import tuning

    rt = tuning.Runtime.detect()
    path = tuning.find(rt.gpu, rt.capability) if rt else None
    return {"file": str(path) if path else None, "sha256": tuning.digest(path) if path else None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="bert-base,e5-intent")
    p.add_argument("--e5-model", default="var/models/intent-e5-small")
    p.add_argument(
        "--e5-shape-model",
        default="var/models/intent-e5-shape",
        help="model e5-shape: scripts/gpu/e5_shape_model.py's random-weight model of e5-small's shape",
    )
    p.add_argument(
        "--tuning",
        type=Path,
        help="a folder whose tuning file for this GPU the tuned builds read instead of the committed one (one that "
        "scripts/gpu/tune.py just wrote)",
    )
    p.add_argument("--shapes", default="1x16,1x128,8x64,32x128,128x128")
    p.add_argument("--variants", default="eager_fp32,eager_fp16,compile_fp16,engine_fp16,engine_bf16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="time the engine variants this many times, interleaved")
    p.add_argument(
        "--alternate",
        action="store_true",
        help="also time the engine variants call by call in turn (iters × rounds calls each): drift hits each alike",
    )
    p.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--inductor-format",
        default="auto",
        choices=["auto", "aoti-package", "exported-program"],
        help="engine format (exported-program skips the AOTInductor package, which segfaults on the H200's image)",
    )
    p.add_argument("--profile", action="store_true", help="also the engine's kernel table at every shape")
    p.add_argument("--out", default="benchmarks/results/gpu_encoder.json")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(),
        "capability": torch.cuda.get_device_capability(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "peak_tflops_bf16_measured": PEAK_TFLOPS,
        "notes": "bert-base and e5-shape have RANDOM weights (shape matters for speed); e5-intent is the trained "
        "intent model. "
        "Times: CUDA events, inputs on device; *_e2e: host wall time of engine.infer incl. copies.",
    }
    if args.tuning:
        from miaohui.models import tuning

        tuning.SEARCH_PATH.insert(0, args.tuning)
    runtime = tuning_runtime()
    results["tuning_file"] = runtime
    print("tuning file:", runtime, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        for name in args.models.split(","):
            ckpt = {"bert-base": bert_base_checkpoint(Path(tmp)), "e5-shape": Path(args.e5_shape_model)}.get(
                name, Path(args.e5_model)
            )
            run_model(name, ckpt, args, repo, results)
    speedups(results["rows"])
    Path(args.out).write_text(json.dumps(results, indent=1))
    plot(results["rows"], Path(args.out).with_suffix(".png"))
    print(f"\n{'model':10s} {'variant':18s} {'shape':9s} {'median':>9s} {'p99':>9s} {'xEager32':>8s} {'%peak':>6s}")
    for r in results["rows"]:
        print(
            f"{r['model']:10s} {r['variant']:18s} {r['batch']}x{r['seq']:<7d} {r['median_ms']:9.3f} "
            f"{r['p99_ms']:9.3f} {r.get('speedup_vs_eager_fp32', float('nan')):8.1f} {100 * r['peak_fraction']:6.1f}"
        )


if __name__ == "__main__":
    main()
