"""Which ONNX Runtime int8 kernels are fastest for the intent encoder on this CPU (the search behind the default).

From the exported fp32 ONNX graph of the intent model, builds and times on ONNX Runtime:

* ``dynamic-qattention`` — the default recipe without smoothing: fused attention (``QAttention``), plain
  LayerNorm/GELU, dynamic int8 (``DynamicQuantizeMatMul``);
* ``dynamic-unfused-attention`` — the same with attention left as MatMul/Softmax (Q/K/V as int8 MatMuls);
* ``nbits8-b32`` / ``nbits8-b128`` / ``nbits4-b32`` — weight-only ``MatMulNBits`` (block-wise symmetric int8 / int4
  weights, ``accuracy_level=4``: int8 compute), attention unfused;
* ``fp32`` — the unfused-attention fp32 graph (the reference for the max logit difference).

Median of ``--iters`` runs after warm-up, ``--rounds`` interleaved rounds (this shared 2-core machine drifts), the
max |logit − fp32 logit| on the same random ids. Writes JSON with hardware, versions and the command::

    python benchmarks/bench_int8_kernels_cpu.py --onnx var/onnx/intent-5384580a0f3549c0.onnx
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from miaohui.compile.optimize import ORT_SLOW_FUSIONS, fuse_bert, unfuse_slow_ops
from miaohui.engines.target import cpu_name

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1, 16), (1, 64), (32, 16)]


def _plain(src: Path, work: Path, attention: bool) -> Path:
    fused, plain = work / f"fused-{attention}.onnx", work / f"plain-{attention}.onnx"
    if not plain.exists():
        fuse_bert(src, fused, 12, 384, attention=attention)
        unfuse_slow_ops(fused, plain)
    return plain


def _dynamic(plain: Path, out: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if not out.exists():
        quantize_dynamic(
            str(plain), str(out), weight_type=QuantType.QInt8, per_channel=True,
            op_types_to_quantize=["MatMul", "Attention"], extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )  # fmt: skip
    return out


def _nbits(plain: Path, out: Path, bits: int, block: int) -> Path:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if not out.exists():
        cfg = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=4, bits=bits)
        q = MatMulNBitsQuantizer(
            onnx.load(str(plain)), bits=bits, block_size=block, is_symmetric=True, accuracy_level=4, algo_config=cfg
        )
        q.process()
        q.model.save_model_to_file(str(out), use_external_data_format=False)
    return out


def _session(path: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = threads, 1, 3
    return ort.InferenceSession(
        str(path), opts, providers=["CPUExecutionProvider"], disabled_optimizers=list(ORT_SLOW_FUSIONS)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onnx", type=Path, required=True, help="the exported fp32 intent model (var/onnx/intent-*.onnx)")
    ap.add_argument("--work", type=Path, default=ROOT / "var" / "bench" / "int8-kernels")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "intent_cpu_int8_kernels.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    fused, unfused = _plain(args.onnx, args.work, True), _plain(args.onnx, args.work, False)
    models = {
        "dynamic-qattention": _dynamic(fused, args.work / "dynamic-qattention.onnx"),
        "dynamic-unfused-attention": _dynamic(unfused, args.work / "dynamic-unfused.onnx"),
        "nbits8-b32": _nbits(unfused, args.work / "nbits8-b32.onnx", 8, 32),
        "nbits8-b128": _nbits(unfused, args.work / "nbits8-b128.onnx", 8, 128),
        "nbits4-b32": _nbits(unfused, args.work / "nbits4-b32.onnx", 4, 32),
        "fp32": unfused,
    }
    sessions = {name: _session(path, args.threads) for name, path in models.items()}
    rng = np.random.default_rng(0)
    rows = []
    for b, s in SHAPES:
        ids = rng.integers(1000, 20000, size=(b, s)).astype(np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        times: dict[str, list[float]] = {name: [] for name in sessions}
        logits: dict[str, np.ndarray] = {}
        for _ in range(args.rounds):
            for name, sess in sessions.items():
                for _ in range(3):
                    logits[name] = sess.run(None, feeds)[0]
                for _ in range(args.iters if b == 1 else max(3, args.iters // 6)):
                    t = time.perf_counter()
                    sess.run(None, feeds)
                    times[name].append(time.perf_counter() - t)
        for name in sessions:
            row = {
                "engine": name, "batch": b, "seq": s, "median_ms": float(np.median(times[name]) * 1e3),
                "max_abs_logit_diff_vs_fp32": float(np.abs(logits[name] - logits["fp32"]).max()),
            }  # fmt: skip
            rows.append(row)
            diff = row["max_abs_logit_diff_vs_fp32"]
            print(f"{b:>3}x{s:<3} {name:26s} {row['median_ms']:8.2f} ms  max|Δlogit| {diff:.3f}")
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).resolve().relative_to(ROOT).as_posix(), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_name(),
        "threads": args.threads,
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
