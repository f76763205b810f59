"""Probe: SmolLM2's fp32 ONNX decoder with 4-bit affine (Q4_1-layout) layer weights and an 8-bit head, fp32 compute.

Compares logits with the fp32 graph and times one-row decode steps (past 128 tokens) on this CPU.
    .venv/bin/python lab/probes/q4_affine_probe.py var/test-cache/llm-repo-*/smollm2/1
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from miaohui.generation.build.export import _feeds, load_meta
from miaohui.generation.build.weight_blocks import quantize_blocks_model

src = Path(sys.argv[1])
meta = load_meta(src)
out = Path("/tmp/q4probe")
out.mkdir(exist_ok=True)
model = onnx.load(str(src / "model.onnx"))
t = time.perf_counter()
quantize_blocks_model(model)
print(f"quantized in {time.perf_counter() - t:.1f} s")
onnx.save(model, str(out / "model.onnx"))
print("size MB", (out / "model.onnx").stat().st_size / 1e6)

d = meta.decoder_dims
opts = ort.SessionOptions()
opts.intra_op_num_threads = 2
sess = {
    k: ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"])
    for k, p in (("fp32", src / "model.onnx"), ("q4", out / "model.onnx"))
}
ids = (np.arange(128, dtype=np.int64) * 997 % d.vocab)[None]
past0 = [np.zeros((1, d.num_kv_heads, 0, d.head_dim), np.float32)] * (2 * d.num_layers)
feeds = _feeds(ids, np.ones_like(ids), np.arange(128, dtype=np.int64)[None], past0)
res = {k: s.run(None, feeds) for k, s in sess.items()}
la, lb = res["fp32"][0], res["q4"][0]
print("max |logit diff|", float(np.abs(la - lb).max()), "top1 agree", float((la.argmax(-1) == lb.argmax(-1)).mean()))


def median_ms(session: ort.InferenceSession, feeds: dict, warm: int, runs: int) -> float:
    for _ in range(warm):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t)
    return round(1000 * float(np.median(times)), 2)


for k, s in sess.items():
    past = res[k][1:]
    step = _feeds(np.array([[5]]), np.ones((1, 129), np.int64), np.array([[128]]), past)
    print(k, "decode step ms p50", median_ms(s, step, 5, 40))
    past8 = [np.repeat(p, 8, 0) for p in past]  # an 8-row step (8 streams)
    step8 = _feeds(np.full((8, 1), 5), np.ones((8, 129), np.int64), np.full((8, 1), 128), past8)
    print(k, "8-row step ms p50", median_ms(s, step8, 3, 20))
