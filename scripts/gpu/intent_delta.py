"""Ship the trained intent model to a GPU machine without its 470 MB of unchanged e5 weights.

    python scripts/gpu/intent_delta.py save MODEL_DIR OUT.safetensors   # tensors that differ from e5-small
    python scripts/gpu/intent_delta.py load DELTA.safetensors META.json MODEL_DIR   # e5-small + delta → model

Loading rebuilds the exact checkpoint (same tensors, same tokenizer) and prints its digest, so the GPU run
can be matched to the CPU one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miaohui.models.checkpoint import META_NAME, ModelMeta, load_checkpoint, model_digest, save_checkpoint
from miaohui.models.intent import IntentClassifier
from miaohui.zoo.e5 import load_e5


def save(model_dir: Path, out: Path) -> None:
    trained = load_checkpoint(model_dir).module.state_dict()
    encoder, _ = load_e5()
    base = IntentClassifier(encoder, len(json.loads((model_dir / META_NAME).read_text())["labels"])).state_dict()
    delta = {k: v.contiguous() for k, v in trained.items() if k not in base or not torch.equal(v, base[k])}
    save_file(delta, str(out))
    size_mb = out.stat().st_size / 1e6
    print(f"{len(delta)} of {len(trained)} tensors differ; {size_mb:.1f} MB; digest {model_digest(model_dir)}")


def load(delta_file: Path, meta_file: Path, model_dir: Path) -> None:
    meta = ModelMeta.model_validate_json(meta_file.read_text())
    encoder, tok = load_e5()
    model = IntentClassifier(encoder, len(meta.labels))
    missing, unexpected = model.load_state_dict(load_file(str(delta_file)), strict=False)
    if unexpected:
        raise SystemExit(f"delta has unknown tensors: {unexpected[:5]}")
    save_checkpoint(model_dir, model.eval(), meta, tok)
    print(f"assembled {model_dir} ({len(missing)} tensors from e5-small); digest {model_digest(model_dir)}")


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        load(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
