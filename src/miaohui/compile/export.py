"""``miaohui export``: PyTorch model → ONNX, with named dynamic axes, checked against PyTorch.

Export specs are data (names, dynamic axes, opset, tolerance). Every export is run through ONNX Runtime
on random and real inputs and compared with PyTorch; over the tolerance it fails.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from miaohui.errors import ExportError
from miaohui.models.checkpoint import LoadedModel, ModelMeta
from miaohui.nlp.tokenizer import TextTokenizer


class ExportSpec(BaseModel):
    """How a model is exported: names, dynamic axes, opset, tolerance of the check."""

    model_config = ConfigDict(extra="forbid")

    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    opset: int = Field(default=17, ge=17)
    atol: float = Field(default=1e-3, gt=0)
    """Largest absolute output difference ONNX Runtime vs PyTorch that passes."""
    rtol: float = Field(default=1e-3, gt=0)
    """Largest difference relative to the output's max |value| that passes."""


def encoder_spec(meta: ModelMeta) -> ExportSpec:
    out = "logits" if meta.kind == "intent" else "embeddings"
    return ExportSpec(
        input_names=["input_ids", "attention_mask"],
        output_names=[out],
        dynamic_axes={
            "input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
            out: {0: "batch"},
        },
    )


class CaseError(BaseModel):
    case: str
    max_abs: float
    max_rel: float


class ExportReport(BaseModel):
    path: str
    seconds: float
    opset: int
    bytes: int
    cases: list[CaseError]
    max_abs: float
    max_rel: float


def random_feeds(vocab: int, batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """Random (never all-zero) ids with ragged lengths: the last rows are padded."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    for row in range(batch):
        keep = int(rng.integers(max(1, seq // 2), seq + 1))
        mask[row, keep:] = 0
        ids[row, keep:] = 1
    return {"input_ids": ids, "attention_mask": mask}


def text_feeds(tok: TextTokenizer, texts: list[str]) -> dict[str, np.ndarray]:
    ids, mask = tok.encode(texts, truncate=True)
    return {"input_ids": ids, "attention_mask": mask}


def export_onnx(model: LoadedModel, out_path: Path, real_texts: list[str] | None = None) -> ExportReport:
    """Export ``model`` (loaded with eager attention) to ``out_path`` atomically and check it."""
    spec = encoder_spec(model.meta)
    module = model.module.eval()
    sample = random_feeds(model.meta.bert_config["vocab_size"], 2, 8, seed=0)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".export-", suffix=".onnx", dir=out_path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    started = time.perf_counter()
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                tuple(torch.from_numpy(sample[n]) for n in spec.input_names),
                str(tmp),
                input_names=spec.input_names,
                output_names=spec.output_names,
                dynamic_axes=spec.dynamic_axes,
                opset_version=spec.opset,
                dynamo=False,
                do_constant_folding=True,
            )
        seconds = time.perf_counter() - started
        cases = check_export(tmp, module, model, spec, real_texts or [])
        worst_abs = max(c.max_abs for c in cases)
        worst_rel = max(c.max_rel for c in cases)
        if worst_abs > spec.atol and worst_rel > spec.rtol:
            bad = max(cases, key=lambda c: c.max_abs)
            raise ExportError(
                f"ONNX output differs from PyTorch on {bad.case}: max abs {bad.max_abs:.2e} (tolerance "
                f"{spec.atol:.0e}), max rel {bad.max_rel:.2e} (tolerance {spec.rtol:.0e})",
                "the exporter changed the computation; report the model, torch and onnx versions",
            )
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ExportReport(
        path=str(out_path),
        seconds=round(seconds, 2),
        opset=spec.opset,
        bytes=out_path.stat().st_size,
        cases=cases,
        max_abs=worst_abs,
        max_rel=worst_rel,
    )


def check_export(
    onnx_path: Path, module: torch.nn.Module, model: LoadedModel, spec: ExportSpec, real_texts: list[str]
) -> list[CaseError]:
    """Compare ONNX Runtime with PyTorch on random ragged batches and on real text."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    vocab = model.meta.bert_config["vocab_size"]
    cases = {f"random {b}x{s}": random_feeds(vocab, b, s, seed=b * 1000 + s) for b, s in ((1, 1), (1, 7), (4, 33))}
    if real_texts:
        tok = TextTokenizer(model.tokenizer, model.meta.max_length)
        cases[f"{len(real_texts)} real texts"] = text_feeds(tok, real_texts)
    results = []
    for name, feeds in cases.items():
        (got,) = sess.run(spec.output_names, feeds)
        with torch.inference_mode():
            want = module(*(torch.from_numpy(feeds[n]) for n in spec.input_names)).numpy()
        diff = np.abs(got - want)
        results.append(
            CaseError(
                case=name,
                max_abs=float(diff.max()),
                max_rel=float(diff.max() / max(1e-12, float(np.abs(want).max()))),
            )
        )
    return results
