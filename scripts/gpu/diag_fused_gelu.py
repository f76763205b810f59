"""On the GPU: does the BERT-base inductor engine (exported program) answer every bucket with and without the fused
GEMM+GELU epilogue? Session 11's benchmark hit a device-side assert at 32×128 right after the fp32 reference ran;
this runs the engine alone first at each shape (CUDA_LAUNCH_BLOCKING=1 names the failing kernel), then the reference.

    FUSED=1 CUDA_LAUNCH_BLOCKING=1 python3 scripts/gpu/diag_fused_gelu.py
    FUSED=0 CUDA_LAUNCH_BLOCKING=1 python3 scripts/gpu/diag_fused_gelu.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_gpu_encoder import bert_base_checkpoint
from miaohui.config import BuildConfig, parse_shapes
from miaohui.engines import inductor
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact
from miaohui.models.checkpoint import load_checkpoint

fused = os.environ.get("FUSED", "1") == "1"
if not fused:
    inductor.use_fused_gelu = lambda module, on=True: module  # type: ignore[assignment]
root = Path(tempfile.mkdtemp())
ckpt = bert_base_checkpoint(root)
cfg = BuildConfig(backend="inductor", precision="fp16", shapes=parse_shapes("input_ids:1x1,32x128,128x128"),
                  inductor_format="exported-program")  # fmt: skip
art = build_artifact(ckpt, "bert", cfg, root / "repo", log=lambda m: None)
print("fused", fused, flush=True)
engine = load_engine(art.path)
vocab = load_checkpoint(ckpt).module.encoder.config.vocab_size
rng = np.random.default_rng(0)
outs = {}
for b, s in ((1, 16), (8, 64), (32, 128), (128, 128), (3, 100)):
    ids = rng.integers(5, vocab, (b, s), dtype=np.int64)
    mask = np.ones((b, s), np.int64)
    try:
        outs[(b, s)] = (ids, mask, engine.infer({"input_ids": ids, "attention_mask": mask})["logits"])
        torch.cuda.synchronize()
        print(f"engine {b}x{s}: ok", flush=True)
    except Exception as exc:
        print(f"engine {b}x{s}: FAILED {exc!r}"[:600], flush=True)
        raise SystemExit(1) from exc
ref = load_checkpoint(ckpt).module.cuda().eval()
with torch.inference_mode():
    for (b, s), (ids, mask, got) in outs.items():
        want = ref(torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda()).float().cpu().numpy()
        print(f"ref {b}x{s}: rel err {np.linalg.norm(got - want) / np.linalg.norm(want):.2e}", flush=True)
