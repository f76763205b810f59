"""inductor on the GPU from a user's own Hugging Face classifier: a BERT-base-shaped BertForSequenceClassification
(random weights, 3 made-up labels, a WordPiece tokenizer the test writes), built from its ``save_pretrained``
directory, checked by the accuracy gate against the HF source in fp32 (``miaohui validate``'s code) and served on
/v1/intent with its own labels; confidences close to the HF fp32 softmax."""

from __future__ import annotations

import json
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
from miaohui.validate.run import run_validation

pytestmark = pytest.mark.gpu
LABELS = {0: "refund", 1: "shipping", 2: "complaint"}
TEXTS = ["Where is my parcel?", "I want my money back for the broken kettle", "the courier was rude to me"]
DEV = [
    ("where is my parcel", "shipping"), ("my parcel is late", "shipping"), ("when will the courier come", "shipping"),
    ("has my order shipped", "shipping"), ("i want my money back", "refund"), ("refund the broken kettle", "refund"),
    ("please give me a refund", "refund"), ("money back for my order", "refund"), ("the courier was rude", "complaint"),
    ("this service is terrible", "complaint"), ("i want to complain about the staff", "complaint"),
    ("the kettle arrived broken and nobody helps", "complaint"),
]  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    torch.manual_seed(0)
    config = BertConfig(num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})  # BERT-base shape
    out = tmp_path_factory.mktemp("bert-base-clf")
    BertForSequenceClassification(config).eval().save_pretrained(out)
    words = sorted({w.strip("?.,").lower() for text in TEXTS + [t for t, _ in DEV] for w in text.split()})
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n", encoding="utf-8")
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(out)
    return out


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
async def test_hf_bert_base_classifier_through_inductor(source: Path, tmp_path: Path, precision: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = BuildConfig(backend="inductor", precision=precision, shapes=parse_shapes("input_ids:1x1,8x32,32x128"))
    built = build_artifact(source, "support", cfg, tmp_path, log=print)
    assert built.manifest.extra["source"]["architecture"] == "BertForSequenceClassification"
    # miaohui's fast encoder with the model's own pooler + classifier, its tuned kernels where this GPU's tuning file
    # has BERT-base's fp16 shapes (the project ships an H200 file; another GPU gets the library kernels)
    assert built.manifest.extra["format"] == "fast-graphs" and built.manifest.files["triton-cache.tar"].size > 0
    from miaohui.models import tuning

    sel = tuning.select(tuning.Runtime.detect(), (768, 3072, 12))
    tuned = precision == "fp16" and bool(sel.skinny and sel.attention)
    assert built.manifest.extra["gpu_kernels"]["mode"] == ("tuned" if tuned else "library"), sel.reason
    tok = AutoTokenizer.from_pretrained(str(source))
    model = AutoModelForSequenceClassification.from_pretrained(str(source)).eval()
    with torch.inference_mode():
        want = torch.softmax(model(**tok(TEXTS, padding=True, return_tensors="pt")).logits, -1).numpy()
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"text": t, "intent": i}) + "\n" for t, i in DEV), encoding="utf-8")
    report, _ = run_validation("support", tmp_path, str(dev), "torch", max_drop=100.0, min_agreement=0.9, golden=None)
    print(report.model_dump_json())
    assert report.passed, report.failures
    assert report.max_logit_error < 2e-2, report.max_logit_error
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
