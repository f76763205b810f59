"""How far the int8 intent engine can go at batch 1 on this CPU (issue 2's goal: ≥ 6× PyTorch eager fp32).

Three measurements in one run, on the prepared models (``make run`` builds them):

1. PyTorch eager fp32 and the default int8 engine (ONNX Runtime dynamic int8), median over ``--iters`` at each
   ``--shapes`` (batch×sequence), as ``bench_intent_cpu.py`` times them;
2. the int8 engine's time by operator type (ONNX Runtime's profiler, same session options as the engine);
3. the model's GEMMs alone: each distinct weight shape of a layer (QKV, attention output, FFN up, FFN down) as ONNX
   Runtime's ``DynamicQuantizeMatMul`` (the kernel the engine runs) at the sequence's rows, 9 copies against 1 in a
   session so that per-call overhead cancels; × layers = the GEMM time no ORT int8 engine of this model can go below.

The bound printed: eager ÷ (GEMMs alone) = the speed-up if everything but the GEMMs were free, and eager ÷ (GEMMs
alone + the engine's measured non-GEMM work). Writes ``benchmarks/results/int8_ceiling_cpu.json``.

    .venv/bin/python benchmarks/bench_int8_ceiling_cpu.py [--shapes 1x16,1x64] [--iters 200]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from miaohui.engines.store import read_manifest
from miaohui.engines.target import cpu_name
from miaohui.models.checkpoint import load_checkpoint
from miaohui.paths import models_dir, repository_dir
from miaohui.prepare import DEFAULT_MODEL, prepare_defaults


def _median_ms(fn: Any, iters: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return float(np.median(times))


def _session(model: bytes | str, threads: int, disabled: list[str], profile: str | None = None) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    if profile:
        so.enable_profiling, so.profile_file_prefix = True, profile
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)


def gemm_us(m: int, k: int, n: int, threads: int, iters: int) -> float:
    """µs of one ``DynamicQuantizeMatMul`` [m, k] × int8 [k, n]: (9 nodes − 1 node) / 8, same input."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.integers(-127, 127, (k, n)).astype(np.int8), "w"),
        numpy_helper.from_array(np.full((n,), 0.01, np.float32), "scale"),
        numpy_helper.from_array(np.zeros((n,), np.int8), "zero"),
    ]
    x = rng.standard_normal((m, k)).astype(np.float32)
    per = []
    for reps in (1, 9):
        nodes = [
            helper.make_node("DynamicQuantizeMatMul", ["x", "w", "scale", "zero"], [f"y{r}"], domain="com.microsoft")
            for r in range(reps)
        ]
        outs = [helper.make_tensor_value_info(f"y{r}", TensorProto.FLOAT, [m, n]) for r in range(reps)]
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])], outs, inits
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        )
        sess = _session(model.SerializeToString(), threads, [])
        per.append(_median_ms(lambda s=sess: s.run(None, {"x": x}), iters) * 1000)
    return (per[1] - per[0]) / 8


def op_profile(
    path: Path, feeds: dict[str, np.ndarray], threads: int, disabled: list[str], runs: int
) -> dict[str, float]:
    """ms per run by operator type (kernel time from ONNX Runtime's profiler)."""
    with tempfile.TemporaryDirectory() as tmp:
        sess = _session(str(path), threads, disabled, profile=os.path.join(tmp, "ort"))
        for _ in range(10):
            sess.run(None, feeds)
        start = time.perf_counter()
        for _ in range(runs):
            sess.run(None, feeds)
        wall = (time.perf_counter() - start) * 1000 / (runs + 10)  # profiling includes the warm-up runs
        events = json.loads(Path(sess.end_profiling()).read_text())
    by_op: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"] / 1000 / (runs + 10)
    return {"wall_ms_profiled": wall, **dict(by_op.most_common())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x16,1x64")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--engine", default="intent", help="repository name of the int8 engine")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/int8_ceiling_cpu.json"))
    args = ap.parse_args()
    repo = repository_dir()
    prepare_defaults(repo, log=lambda m: print("·", m))
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    loaded = load_checkpoint(models_dir() / DEFAULT_MODEL)
    module = loaded.module.eval()
    cfg = loaded.meta.bert_config
    hidden, inter, layers = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    version = max(int(v.name) for v in (repo / args.engine).iterdir() if v.name.isdigit())
    path = repo / args.engine / str(version)
    manifest = read_manifest(path)
    disabled = [str(x) for x in manifest.extra.get("ort_disabled_optimizers", [])]
    engine = _session(str(path / manifest.engine_file), args.threads, disabled)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": args.threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
        "load_average_before": os.getloadavg(),
        "engine": {"artifact": str(path), "precision": manifest.precision, "disabled_optimizers": disabled},
        "model": {"hidden": hidden, "intermediate": inter, "layers": layers},
        "shapes": {},
    }
    rng = np.random.default_rng(1)
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        feeds = {
            "input_ids": rng.integers(1000, 20000, (b, s)).astype(np.int64),
            "attention_mask": np.ones((b, s), np.int64),
        }
        ids, mask = torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])

        def eager(ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> None:
            with torch.inference_mode():
                module(ids, mask)

        eager_ms = _median_ms(eager, args.iters // 2)
        int8_ms = _median_ms(lambda f=feeds: engine.run(None, f), args.iters)
        gemms = {
            "qkv": gemm_us(b * s, hidden, 3 * hidden, args.threads, args.iters),
            "attn_out": gemm_us(b * s, hidden, hidden, args.threads, args.iters),
            "ffn_up": gemm_us(b * s, hidden, inter, args.threads, args.iters),
            "ffn_down": gemm_us(b * s, inter, hidden, args.threads, args.iters),
        }
        gemm_ms = layers * sum(gemms.values()) / 1000
        ops = op_profile(path / manifest.engine_file, feeds, args.threads, disabled, args.iters)
        kernel_ms = sum(v for k, v in ops.items() if k != "wall_ms_profiled")
        # the engine's GEMM kernels: DynamicQuantizeMatMul nodes + QAttention's fused QKV projection
        in_engine_gemm_ms = ops.get("DynamicQuantizeMatMul", 0.0) + layers * gemms["qkv"] / 1000
        rest_ms = max(0.0, kernel_ms - in_engine_gemm_ms)
        row = {
            "eager_fp32_ms": eager_ms,
            "int8_engine_ms": int8_ms,
            "int8_x_eager": eager_ms / int8_ms,
            "gemm_us_per_layer": gemms,
            "gemms_alone_ms": gemm_ms,
            "macs_per_s_gemms": layers * b * s * (4 * hidden * hidden + 2 * hidden * inter) / (gemm_ms / 1000),
            "engine_ms_by_op": ops,
            "engine_non_gemm_ms": rest_ms,
            "bound_x_eager_if_only_gemms": eager_ms / gemm_ms,
            "bound_x_eager_gemms_plus_measured_rest": eager_ms / (gemm_ms + rest_ms),
            "int8_ms_needed_for_6x": eager_ms / 6,
        }
        report["shapes"][shape] = row
        print(
            f"{shape}: eager {eager_ms:.2f} ms, int8 {int8_ms:.2f} ms ({eager_ms / int8_ms:.2f}x); GEMMs alone "
            f"{gemm_ms:.2f} ms ({row['macs_per_s_gemms'] / 1e9:.0f} GMAC/s), the rest {rest_ms:.2f} ms; 6x needs "
            f"{eager_ms / 6:.2f} ms; bounds {row['bound_x_eager_if_only_gemms']:.2f}x (GEMMs only) / "
            f"{row['bound_x_eager_gemms_plus_measured_rest']:.2f}x (GEMMs + rest)",
            flush=True,
        )
    report["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
