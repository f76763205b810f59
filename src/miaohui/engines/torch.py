"""``torch`` backend: PyTorch eager — the baseline every benchmark compares against."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from miaohui.engines.base import Engine, Manifest
from miaohui.engines.context import BuildContext, BuiltEngine
from miaohui.engines.onnxruntime_builder import io_specs
from miaohui.engines.target import cpu_target, cuda_target
from miaohui.errors import BuildError
from miaohui.models.checkpoint import META_NAME, WEIGHTS_NAME
from miaohui.sources.detect import load_source

ENGINE_FILE = WEIGHTS_NAME


def backend_version() -> str:
    return str(torch.__version__).split("+")[0]


def build(ctx: BuildContext) -> BuiltEngine:
    """No compilation: the artifact is the checkpoint itself (so eager can be served and compared)."""
    if ctx.model is None:
        raise BuildError(
            "the torch backend needs a model directory, not an ONNX file",
            "pass the directory written by `miaohui train-intent`",
        )
    if ctx.cfg.precision not in ("fp32", "fp16", "bf16"):
        raise BuildError(f"precision {ctx.cfg.precision} is not offered by the torch baseline", "use fp32")
    meta = ctx.model.meta
    if meta.source_format == "hf":  # the HF model's own state, with the meta that says how to rebuild it
        from miaohui.sources.hf_encoder import save_as_checkpoint

        save_as_checkpoint(ctx.model, ctx.out_dir)
    else:
        for name in (META_NAME, WEIGHTS_NAME):
            shutil.copyfile(ctx.model.path / name, ctx.out_dir / name)
    out = "logits" if meta.kind == "intent" else "embeddings"
    width = len(meta.labels) if meta.kind == "intent" else int(meta.bert_config["hidden_size"])
    inputs, outputs = io_specs(ctx, out, ["batch", width])
    target = cuda_target() or cpu_target()
    return BuiltEngine(
        engine_file=ENGINE_FILE,
        backend_version=backend_version(),
        target=target,
        inputs=inputs,
        outputs=outputs,
    )


class TorchEngine(Engine):
    """Eager PyTorch in inference mode, fp32 (or the artifact's half precision on a GPU)."""

    def __init__(self, manifest: Manifest, path: Path, threads: int | None = None) -> None:
        super().__init__(manifest, path)
        if threads:
            torch.set_num_threads(threads)
        loaded = load_source(path, attn_implementation="sdpa")
        self.device = torch.device("cuda" if manifest.target.device == "cuda" else "cpu")
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(manifest.precision, torch.float32)
        self.module = loaded.module.to(self.device, dtype)

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            args = [torch.from_numpy(feeds[n]).to(self.device) for n in self.input_names]
            out = self.module(*args).float().cpu().numpy()
        return {self.output_names[0]: out}
