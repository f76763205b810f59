"""Tell a model source apart from its files, and read what it is without loading its weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from miaohui.errors import ArtifactError
from miaohui.models.checkpoint import META_NAME, LoadedModel, ModelMeta, load_checkpoint, model_digest, read_meta

Format = Literal["miaohui", "hf", "onnx"]
ACCEPTED = (
    f"a miaohui checkpoint (directory with {META_NAME}, from `miaohui train-intent`), "
    "a Hugging Face directory as save_pretrained writes it (config.json + model.safetensors or pytorch_model.bin + "
    "tokenizer.json), or an .onnx file"
)


@dataclass
class Source:
    """One model source: what it is (``meta``), its digest (part of the build key), and how to load it."""

    path: Path
    format: Format
    meta: ModelMeta | None
    """What the model is; None for an ONNX file served as raw tensors (task ``tensor``)."""
    digest: str
    onnx: Any = None
    """The ONNX file's graph facts (:class:`miaohui.sources.onnx_file.OnnxGraph`), for ``format == 'onnx'``."""
    tokenizer_file: Path | None = None
    """The ``tokenizer.json`` an ONNX text model was given (``--tokenizer``)."""

    def load(self, attn_implementation: str = "sdpa") -> LoadedModel | None:
        """The PyTorch model (None for an ONNX file: there is none)."""
        if self.format == "onnx":
            return None
        return load_source(self.path, attn_implementation)

    @property
    def task(self) -> Literal["intent", "encoder", "tensor"]:
        return self.meta.kind if self.meta is not None else "tensor"

    def record(self) -> dict[str, Any]:
        """What the manifest records about the source."""
        facts: dict[str, Any] = {"format": self.format, "path": str(self.path), "digest": self.digest}
        if self.meta is None:
            return facts
        facts["architecture"] = self.meta.architecture or self.meta.base
        if self.meta.kind == "encoder":
            facts |= {"pooling": self.meta.pooling, "normalize": self.meta.normalize}
        return facts


def open_source(path: Path, tokenizer: Path | None = None, labels: list[str] | None = None) -> Source:
    """Detect the kind of ``path`` and read it. ``tokenizer``/``labels`` apply to an ONNX file only."""
    path = Path(path)
    if (tokenizer is not None or labels) and path.suffix != ".onnx":
        raise ArtifactError(
            f"--tokenizer and --labels apply to an ONNX file; {path} is not one",
            "drop them: a checkpoint or Hugging Face directory carries its own tokenizer and labels",
        )
    if not path.exists():
        raise ArtifactError(f"{path} does not exist", f"pass {ACCEPTED}")
    if path.is_file():
        if path.suffix == ".onnx":
            from miaohui.sources.onnx_file import open_onnx

            return open_onnx(path, tokenizer, labels)
        raise ArtifactError(f"{path} is a file but not an .onnx file", f"pass {ACCEPTED}")
    if (path / META_NAME).is_file():
        return Source(path=path, format="miaohui", meta=read_meta(path), digest=model_digest(path))
    from miaohui.sources import hf_encoder

    if hf_encoder.is_hf_dir(path):
        return Source(path=path, format="hf", meta=hf_encoder.inspect_hf(path), digest=hf_encoder.hf_digest(path))
    raise ArtifactError(
        f"{path} is not a model directory (no {META_NAME}, config.json or modules.json)", f"pass {ACCEPTED}"
    )


def load_source(path: Path, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load a checkpoint or a Hugging Face directory (also a torch artifact made from either)."""
    path = Path(path)
    from miaohui.sources import hf_encoder

    if (path / META_NAME).is_file():
        meta = read_meta(path)
        if meta.source_format != "hf":
            return load_checkpoint(path, attn_implementation)
        module = hf_encoder.load_saved(path, meta, attn_implementation)
        tokenizer = hf_encoder.load_tokenizer(path)
        return LoadedModel(path=path, meta=meta, module=module, tokenizer=tokenizer, digest=model_digest(path))
    return hf_encoder.load_hf(path, attn_implementation)
