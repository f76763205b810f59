"""What a backend builder receives and returns. One typed object each way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from miaohui.config import BuildConfig, InputRange
from miaohui.engines.base import Target, TensorSpec
from miaohui.models.checkpoint import LoadedModel, ModelMeta
from miaohui.nlp.tokenizer import TextTokenizer


@dataclass
class BuildContext:
    """Inputs of one engine build."""

    name: str
    cfg: BuildConfig
    out_dir: Path
    """Temporary artifact directory; renamed into the repository only if the build succeeds."""
    work_dir: Path
    """Scratch space, deleted after the build."""
    model: LoadedModel | None
    """The PyTorch source (None when building from a bare ONNX file)."""
    onnx_path: Path | None
    """The exported fp32 ONNX graph (standard ops only)."""
    shapes: dict[str, InputRange]
    """Resolved min/opt/max per input."""
    calib_texts: list[str] = field(default_factory=list)
    tokenizer: TextTokenizer | None = None
    log: Callable[[str], None] = print
    meta: ModelMeta | None = None
    """What the source is (task, labels, architecture); None for an ONNX file served as raw tensors."""

    def calibration_feeds(self, batch_size: int = 8) -> list[dict[str, np.ndarray]]:
        """Equal-shape token batches of the calibration texts (histogram calibrators need one shape),
        padded to the longest text within the profile's max sequence length."""
        if self.tokenizer is None:
            raise ValueError("calibration needs a tokenizer")
        from miaohui.nlp.tokenizer import pad_batch, truncate_ids

        max_len = self.shapes["input_ids"].max[1]
        seqs = [truncate_ids(s, max_len) for s in self.tokenizer.token_ids(self.calib_texts)]
        width = max(len(s) for s in seqs)
        usable = len(seqs) - len(seqs) % batch_size if len(seqs) >= batch_size else len(seqs)
        feeds = []
        for start in range(0, usable, batch_size):
            ids, mask = pad_batch(seqs[start : start + batch_size], self.tokenizer.pad_id, length=width)
            feeds.append({"input_ids": ids, "attention_mask": mask})
        return feeds

    def text_feeds(self) -> list[dict[str, np.ndarray]]:
        """One unpadded batch-1 feed per calibration text (truncated to the profile's max sequence length),
        the way single requests reach the engine."""
        if self.tokenizer is None:
            raise ValueError("calibration needs a tokenizer")
        from miaohui.nlp.tokenizer import pad_batch, truncate_ids

        max_len = self.shapes["input_ids"].max[1]
        feeds = []
        for seq in self.tokenizer.token_ids(self.calib_texts):
            ids, mask = pad_batch([truncate_ids(seq, max_len)], self.tokenizer.pad_id)
            feeds.append({"input_ids": ids, "attention_mask": mask})
        return feeds


@dataclass
class BuiltEngine:
    """What a backend builder produced inside ``BuildContext.out_dir``."""

    engine_file: str
    backend_version: str
    target: Target
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    extra: dict[str, Any] = field(default_factory=dict)
