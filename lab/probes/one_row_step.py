"""A CPU decoder version's one-stream decode step, version against version (issue 44): the nodes ONNX Runtime runs a
step after its optimizer (inside the ``If`` branch of an int4 version's one-row graph) and the step's median time,
each version in its own process in turn, so that the machine's drift between minutes moves both alike.

    .venv/bin/python -m lab.probes.one_row_step OLD/model.onnx NEW/model.onnx [--pairs 3]

A 100-token prompt, then 120 greedy one-token steps (the first 20 not timed), two threads, as the server runs them.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def session(path: str, optimized: str | None = None) -> object:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads = 2, 1
    if optimized:
        opts.optimized_model_filepath = optimized
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.data")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def step_ms(path: str) -> float:
    """Median one-token step of the decoder at ``path`` (its ``decoder.json`` beside it)."""
    dims = json.loads((Path(path).parent / "decoder.json").read_text())["dims"]
    layers, kv, hd = dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]
    s = session(path)

    def feed(ids: np.ndarray, past: list[np.ndarray], pos: int) -> dict[str, np.ndarray]:
        n = ids.shape[1]
        f = {"input_ids": ids, "attention_mask": np.ones((1, pos + n), np.int64),
             "position_ids": np.arange(pos, pos + n, dtype=np.int64)[None]}  # fmt: skip
        for i in range(layers):
            f[f"past_key_values.{i}.key"], f[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
        return f

    ids = np.random.default_rng(0).integers(0, dims["vocab"], (1, 100)).astype(np.int64)
    out = s.run(None, feed(ids, [np.zeros((1, kv, 0, hd), np.float32)] * (2 * layers), 0))  # type: ignore[attr-defined]
    times, pos = [], 100
    for _ in range(120):
        token = np.array([[int(out[0].argmax())]])
        started = time.perf_counter()
        out = s.run(None, feed(token, out[1:], pos))  # type: ignore[attr-defined]
        times.append(time.perf_counter() - started)
        pos += 1
    return float(np.median(times[20:]) * 1000)


def one_row_nodes(path: str) -> dict[str, int]:
    """Operator counts of the graph a one-token step runs, after ONNX Runtime's optimizer."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        session(path, str(Path(tmp) / "opt.onnx"))
        graph = onnx.load(str(Path(tmp) / "opt.onnx"), load_external_data=False).graph
    for node in graph.node:  # an int4 version: the If's one-row branch
        for attr in node.attribute:
            if node.op_type == "If" and attr.name == "then_branch":
                graph = attr.g
    return dict(collections.Counter(n.op_type for n in graph.node).most_common())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--step-only", action="store_true", help=argparse.SUPPRESS)  # one measurement, in a child
    args = ap.parse_args()
    if args.step_only:
        print(step_ms(args.models[0]))
        return
    for path in args.models:
        counts = one_row_nodes(path)
        print(f"{path}: {sum(counts.values())} nodes a step; {dict(list(counts.items())[:8])}")
    for _ in range(args.pairs):
        row = []
        for path in args.models:
            child = [sys.executable, "-m", "lab.probes.one_row_step", path, "--step-only"]
            row.append(float(subprocess.run(child, capture_output=True, text=True, check=True).stdout.split()[-1]))
        print(" ".join(f"{ms:.2f} ms" for ms in row))


if __name__ == "__main__":
    main()
