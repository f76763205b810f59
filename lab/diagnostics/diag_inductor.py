"""Step-by-step check of the inductor engine on a GPU (each step printed before it runs, faulthandler on)."""

from __future__ import annotations

import faulthandler
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

faulthandler.enable()


def step(msg: str) -> None:
    print(f"[diag {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> None:
    from miaohui.config import BuildConfig, parse_shapes
    from miaohui.engines.inductor_engine import InductorEngine
    from miaohui.engines.store import build_artifact, read_manifest
    from miaohui.models.checkpoint import ModelMeta, save_checkpoint
    from miaohui.models.intent import IntentClassifier, random_bert
    from miaohui.zoo.tiny import word_tokenizer

    tmp = Path(tempfile.mkdtemp())
    tok = word_tokenizer()
    enc = random_bert(hidden=64, layers=2, heads=4, vocab=tok.get_vocab_size(), max_positions=128)
    meta = ModelMeta(
        kind="intent", base="tiny", bert_config=enc.config.to_diff_dict(), labels=list("abcd"), max_length=64
    )
    ckpt = save_checkpoint(tmp / "m", IntentClassifier(enc, 4).eval(), meta, tok)
    step("build fp16 (no autotune)")
    cfg = BuildConfig(
        backend="inductor", precision="fp16", autotune=False, shapes=parse_shapes("input_ids:1x1,4x16,8x64")
    )
    out = build_artifact(ckpt, "t", cfg, tmp / "repo", log=lambda m: step(m))
    manifest = read_manifest(out.path)
    ids = np.random.default_rng(0).integers(5, 1000, (3, 9)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    step("load without CUDA graphs")
    plain = InductorEngine(manifest, out.path, use_cuda_graphs=False)
    step("infer without CUDA graphs")
    a = plain.infer(feeds)["logits"]
    step(f"ok {a.shape}")
    del plain
    step("load with CUDA graphs")
    eng = InductorEngine(manifest, out.path, use_cuda_graphs=True)
    step("infer with CUDA graphs (capture)")
    b = eng.infer(feeds)["logits"]
    step(f"ok max diff {np.abs(a - b).max():.2e}")
    t0 = time.perf_counter()
    for _ in range(100):
        eng.infer(feeds)
    step(f"100 replays {1e3 * (time.perf_counter() - t0) / 100:.3f} ms each")


if __name__ == "__main__":
    sys.exit(main())
