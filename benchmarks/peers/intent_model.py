"""The intent model as the peers serve it: miaohui's int8 ONNX artifact run by plain ONNX Runtime.

Runs inside a peer's venv (numpy, onnxruntime, tokenizers; nothing from miaohui). It reads the artifact's
``manifest.json`` for the engine file, labels, tokenizer and maximum length, normalizes text the way miaohui
does (zero-width characters dropped, NFKC, control characters and runs of whitespace to one space), pads a
batch to its longest text and returns ``(intent, confidence)`` per text: the work miaohui's KServe v2 text
contract does (TEXT → INTENT, CONFIDENCE), without slots.
"""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import numpy as np

_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e"))
_WS = re.compile(r"\s+")


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFKC", text.translate(_ZERO_WIDTH))
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)
    return _WS.sub(" ", text).strip()


class IntentModel:
    """``predict(texts)`` → ``[(intent, confidence), ...]`` with ``threads`` intra-op threads."""

    def __init__(self, artifact: str | Path, threads: int = 2) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        path = Path(artifact)
        manifest = json.loads((path / "manifest.json").read_text())
        self.labels: list[str] = manifest["labels"]
        self.max_length: int = manifest.get("max_length") or 128
        self.tokenizer = Tokenizer.from_file(str(path / manifest["tokenizer_file"]))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        pads = [self.tokenizer.token_to_id(p) for p in ("<pad>", "[PAD]")]
        self.pad_id = next((p for p in pads if p is not None), 0)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        disabled = [str(x) for x in manifest.get("extra", {}).get("ort_disabled_optimizers", [])]
        self.session = ort.InferenceSession(
            str(path / manifest["engine_file"]), opts, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
        )
        self.output = manifest["outputs"][0]["name"]

    def predict(self, texts: list[str]) -> list[tuple[str, float]]:
        encs = self.tokenizer.encode_batch([normalize(t) for t in texts], add_special_tokens=True)
        seqs = [e.ids if len(e.ids) <= self.max_length else [*e.ids[: self.max_length - 1], e.ids[-1]] for e in encs]
        width = max(len(s) for s in seqs)
        ids = np.full((len(seqs), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(seqs), width), dtype=np.int64)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = seq
            mask[row, : len(seq)] = 1
        logits = self.session.run([self.output], {"input_ids": ids, "attention_mask": mask})[0]
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = z / z.sum(axis=-1, keepdims=True)
        best = probs.argmax(axis=-1)
        return [(self.labels[int(b)], float(probs[i, b])) for i, b in enumerate(best)]
