"""GGUF → plain fp32 HF model, cached: what :mod:`miaohui.zoo.smollm` and :mod:`miaohui.zoo.gemma` share.

transformers can read GGUF, but ``from_pretrained(gguf_file=...)`` insists on ``accelerate`` and the model it
returns cannot be ``save_pretrained``. So we do what it does by hand: the config and tokenizer come from the GGUF
metadata, a *plain* model class (no ``quantization_config``) is built from the config, and the dequantized fp32
tensors from :func:`transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint` are loaded into it. The result is
cached with the GGUF's size and sha256 (``source.json``), so a changed GGUF is noticed and converted again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miaohui.errors import ArtifactError
from miaohui.paths import atomic_dir

SOURCE_FILE = "source.json"


def file_digest(path: Path) -> dict[str, object]:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return {"file": path.name, "size": path.stat().st_size, "sha256": h.hexdigest()}


def cache_is_fresh(cache: Path, source: dict[str, object]) -> bool:
    marker = cache / SOURCE_FILE
    if not marker.is_file() or not (cache / "model.safetensors").is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()) == source)
    except (OSError, ValueError):
        return False


def load_gguf_model(gguf: Path, model_cls: Any, label: str, fix: str) -> tuple[Any, Any]:
    """``(model_cls with the GGUF's dequantized fp32 weights, in eval mode, tied; its HF fast tokenizer)``;
    ArtifactError naming ``label`` when the file cannot be read or its tensors do not fit ``model_cls``."""
    import torch
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read {label} GGUF metadata from {gguf}: {exc}", fix) from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("cpu"):
        model = model_cls(config).eval()
    try:
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    except (OSError, ValueError, KeyError) as exc:
        raise ArtifactError(f"cannot read {label} GGUF tensors from {gguf}: {exc}", fix) from exc
    result = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    allowed_missing = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise ArtifactError(
            f"{label} GGUF tensors do not fit {model_cls.__name__}: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}",
            fix,
        )
    model.tie_weights()
    return model, tokenizer


def save_converted(out_dir: Path, model: Any, tokenizer: Any, source: dict[str, object]) -> None:
    """Model + tokenizer + ``source.json`` into ``out_dir``, atomically."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))


def convert_gguf(gguf: Path, out_dir: Path, source: dict[str, object], class_name: str) -> None:
    """Any supported GGUF → plain fp32 ``class_name`` (``LlamaForCausalLM``, ...) + tokenizer in ``out_dir``.
    Gemma 3 gets ``<end_of_turn>`` as a second stop token (its chat turns end with it), as :mod:`.gemma` does."""
    import transformers

    fix = f"check {gguf.name}: a complete GGUF as llama.cpp's convert_hf_to_gguf.py writes it"
    model, tokenizer = load_gguf_model(gguf, getattr(transformers, class_name), gguf.name, fix)
    if class_name == "Gemma3ForCausalLM":
        end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
        if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
            model.generation_config.eos_token_id = sorted({int(tokenizer.eos_token_id), end_of_turn})
    save_converted(out_dir, model, tokenizer, source)


def ensure_converted(
    gguf: Path,
    cache: Path,
    convert: Callable[[Path, Path, dict[str, object]], None],
    *,
    source: dict[str, object] | None = None,
) -> Path:
    """``convert(gguf, cache, source)`` unless ``cache`` already holds a conversion of this very GGUF; ``cache``.
    ``source``: :func:`file_digest` of ``gguf`` when the caller has it already. Under a file lock beside ``cache``:
    processes that need it at once (``serve --workers N``, parallel test workers) convert it once, the others
    wait and read it."""
    from filelock import FileLock

    source = source or file_digest(gguf)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache.parent / f".{cache.name}.lock")):
        if not cache_is_fresh(cache, source):
            from rich.console import Console

            with Console(stderr=True).status(f"converting {gguf.name} → fp32 safetensors in {cache} (once)"):
                convert(gguf, cache, source)
    return cache
