"""Where a causal LM comes from: a built-in shortcut, a Hugging Face directory or a GGUF file (``build-llm PATH``).

:func:`resolve_source` checks the input before anything is exported and returns a :class:`DecoderSource` — the
plain fp32 HF directory to load, its format, architecture and digest (which go into ``causal_lm.json`` and the
build key). :func:`load_source` loads ``(model, fast tokenizer, chat template)`` from it.

* **HF directory** (``save_pretrained``): ``config.json`` names one of :data:`ARCHITECTURES`; weights are
  ``*.safetensors`` (each file's header is read up front, so a truncated file is named before loading) or
  ``pytorch_model*.bin``; a fast tokenizer (``tokenizer.json``) must be there. The digest is a sha256 over the
  config, weight, tokenizer and template files (name and bytes).
* **GGUF file**: ``general.architecture`` from its metadata (:data:`GGUF_ARCHITECTURES`); converted once into a
  plain fp32 HF directory under ``$MIAOHUI_HOME/models/gguf/<sha256 prefix>`` (:mod:`miaohui.zoo.gguf`).

The chat template is the tokenizer's (``tokenizer_config.json``'s ``chat_template``, ``chat_template.jinja``, or
the GGUF's ``tokenizer.chat_template``); none means raw prompts only (``/v1/completions``). Stop tokens are
``generation_config.json``'s ``eos_token_id`` (an int or a list) plus the tokenizer's EOS
(:func:`miaohui.generation.build.export.eos_ids`).

RoPE: ``default``, ``linear`` and ``llama3`` are static frequency tables the ONNX export reproduces (it takes
HF's own ``inv_freq``); position-dependent kinds (``dynamic``, ``yarn``, ``longrope``, ...) are refused, and the
GPU static-KV engine takes ``default`` only.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from miaohui.errors import ArtifactError, ConfigError, InputError

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
}
"""HF causal-LM classes the explicit-KV export handles, and their family."""
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
"""GGUF ``general.architecture`` values taken, and the HF class each converts into (Mistral GGUFs say ``llama``)."""
BUILTIN = ("smollm2", "gemma3-270m")
ROPE_TYPES = {"onnxruntime": ("default", "linear", "llama3"), "inductor": ("default",)}
"""RoPE kinds each backend reproduces exactly (static frequency tables)."""
_TOKENIZER_FIX = "save the tokenizer beside the model: AutoTokenizer.from_pretrained(...).save_pretrained(DIR)"
_TEMPLATE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class DecoderSource:
    """A causal LM ready to load: its plain fp32 HF directory and what it was made from."""

    label: str
    """``smollm2``, ``gemma3-270m``, or the file/folder name given."""
    folder: Path
    """The HF directory to load (for a GGUF: its converted cache)."""
    format: Literal["gguf", "hf"]
    architecture: str
    """HF class name, e.g. ``Qwen2ForCausalLM``."""
    digest: str
    """``<file or folder name>@sha256:<hex>``."""
    path: str
    """The path the user gave (or the built-in's GGUF)."""

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]


def default_name(path: Path) -> str:
    """A repository name from a model path: ``Qwen2.5-0.5B-Instruct`` → ``qwen2-5-0-5b-instruct``."""
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-") or "llm"


def resolve_source(source: str | Path, cache: Path | None = None) -> DecoderSource:
    """A built-in name (``smollm2``, ``gemma3-270m``), an HF directory or a ``.gguf`` file → :class:`DecoderSource`.
    InputError/ArtifactError naming the path and the fix for anything that is not a supported causal LM."""
    if isinstance(source, str) and source in BUILTIN:
        return _builtin(source, cache)
    path = Path(source).expanduser()
    if not path.exists():
        raise InputError(
            f"{path} does not exist", f"pass a Hugging Face model directory, a .gguf file, or one of {list(BUILTIN)}"
        )
    if path.is_dir():
        return _hf_dir(path)
    if path.suffix.lower() == ".gguf":
        return _gguf(path, cache)
    raise InputError(
        f"{path} is neither a model directory nor a .gguf file",
        "pass the folder save_pretrained wrote (config.json, weights, tokenizer) or a GGUF file",
    )


def check_backend(src: DecoderSource, backend: str) -> None:
    """ConfigError when ``backend`` cannot run ``src`` (Gemma 3 and scaled RoPE: onnxruntime and llamacpp only)."""
    if backend in ("onnxruntime", "llamacpp"):
        return
    check_family(src.family, src.label, backend)
    rope = _rope_type(_read_config(src.folder))
    if rope not in ROPE_TYPES[backend]:
        raise ConfigError(
            f"{src.label} uses RoPE scaling {rope!r}, which the {backend} engine does not implement",
            f"build it with --backend onnxruntime (it takes {list(ROPE_TYPES['onnxruntime'])})",
        )


def check_family(family: str, label: str, backend: str) -> None:
    """ConfigError when ``backend`` cannot run a ``family`` decoder (the GPU engine: no Gemma 3). Cheap: built-in
    sources are checked with it before their GGUF is converted."""
    if family == "gemma3" and backend not in ("onnxruntime", "llamacpp"):
        raise ConfigError(
            f"the {backend} engine runs Llama/Qwen2/Mistral-style decoders; {label} is Gemma 3",
            "build Gemma 3 with --backend onnxruntime",
        )


def load_source(src: DecoderSource) -> tuple[Any, Any, str | None]:
    """``(fp32 HF model in eval mode, fast tokenizer, chat template or None)``; ArtifactError if it does not load."""
    if src.format == "gguf" and src.label in BUILTIN:
        from miaohui.zoo.gemma import load_gemma3
        from miaohui.zoo.smollm import load_smollm2

        return load_gemma3(src.folder) if src.label == "gemma3-270m" else load_smollm2(src.folder)
    import transformers
    from transformers import AutoTokenizer

    model_cls = getattr(transformers, src.architecture)
    fix = f"save the model again into {src.folder} (model.save_pretrained)"
    try:
        model = model_cls.from_pretrained(str(src.folder), local_files_only=True, dtype="float32")
    except Exception as exc:  # safetensors, torch and transformers raise unrelated types for a damaged file
        raise ArtifactError(f"cannot load the {src.architecture} weights in {src.folder}: {exc}", fix) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.folder), local_files_only=True)
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise ArtifactError(f"cannot load the tokenizer in {src.folder}: {exc}", _TOKENIZER_FIX) from exc
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ArtifactError(
            f"the tokenizer in {src.folder} is not a fast tokenizer (no tokenizer.json)", _TOKENIZER_FIX
        )
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    return model.eval(), tokenizer, template or None


# ---- the three kinds --------------------------------------------------------------------------------------------


def _builtin(name: str, cache: Path | None) -> DecoderSource:
    from miaohui.zoo.gguf import SOURCE_FILE

    if name == "gemma3-270m":
        from miaohui.zoo.gemma import ensure_gemma_cache, gemma_gguf_path

        folder, gguf, arch = ensure_gemma_cache(cache), gemma_gguf_path(), "Gemma3ForCausalLM"
    else:
        from miaohui.zoo.smollm import ensure_smollm_cache, smollm_gguf_path

        folder, gguf, arch = ensure_smollm_cache(cache), smollm_gguf_path(), "LlamaForCausalLM"
    src = json.loads((folder / SOURCE_FILE).read_text())
    return DecoderSource(name, folder, "gguf", arch, f"{src['file']}@sha256:{src['sha256']}", str(gguf))


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}", "save the model again (model.save_pretrained)") from exc
    if not isinstance(config, dict):
        raise InputError(f"{path} is not a JSON object", "save the model again (model.save_pretrained)")
    return config


def _rope_type(config: dict[str, Any]) -> str:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        return "default"
    if "rope_type" not in params and "type" not in params and all(isinstance(v, dict) for v in params.values()):
        kinds = {str(v.get("rope_type", "default")) for v in params.values()}  # Gemma 3: one per layer type
        return "default" if kinds == {"default"} else ",".join(sorted(kinds - {"default"}))
    return str(params.get("rope_type") or params.get("type") or "default")


def _hf_dir(path: Path) -> DecoderSource:
    if not (path / "config.json").is_file():
        raise InputError(
            f"{path} is not a Hugging Face model directory (no config.json)",
            "pass the folder save_pretrained wrote (config.json, model.safetensors, tokenizer files) or a .gguf file",
        )
    config = _read_config(path)
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise InputError(
            f"{path} holds a {', '.join(map(str, archs)) or config.get('model_type', 'unknown')} model, "
            "not a supported causal LM",
            f"build-llm takes {', '.join(ARCHITECTURES)} (encoders: `miaohui build PATH`)",
        )
    rope = _rope_type(config)
    if rope not in ROPE_TYPES["onnxruntime"] or (arch == "Gemma3ForCausalLM" and rope != "default"):
        raise InputError(
            f"{path}: RoPE scaling {rope!r} is not supported (it changes the frequencies with the sequence length)",
            f"use a model with RoPE {list(ROPE_TYPES['onnxruntime'])}, or remove rope_scaling from config.json if "
            "the model does not need its long context",
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise InputError(
            f"{path}: attention_bias/mlp_bias on a {arch} is not supported by the explicit-KV export",
            "use a model without these biases (Qwen2's Q/K/V biases are supported)",
        )
    weights = _weight_files(path)
    if not (path / "tokenizer.json").is_file():
        raise InputError(f"{path} has no tokenizer.json (a fast tokenizer is needed to serve it)", _TOKENIZER_FIX)
    files = [path / "config.json", *weights, *(path / n for n in _TEMPLATE_FILES if (path / n).is_file())]
    gen = path / "generation_config.json"
    files += [gen] if gen.is_file() else []
    return DecoderSource(path.name, path, "hf", arch, f"{path.name}@sha256:{_digest(files)}", str(path))


def _weight_files(path: Path) -> list[Path]:
    """The weight files, each safetensors header checked (a truncated or foreign file is named here)."""
    safetensors = sorted(path.glob("*.safetensors"))
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not safetensors and not bins:
        raise InputError(
            f"{path} has no weights (model.safetensors or pytorch_model.bin)",
            "save the model with model.save_pretrained(DIR), which writes model.safetensors",
        )
    from safetensors import safe_open

    for file in safetensors:
        try:
            with safe_open(str(file), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # SafetensorError, or OSError for an unreadable file
            raise ArtifactError(
                f"{file} is not a readable safetensors file ({exc})",
                "the file is damaged or incomplete: copy or save the model again",
            ) from exc
    return safetensors or bins


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for file in sorted(files):
        h.update(file.name.encode() + b"\0")
        with file.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file; ArtifactError when the file is no readable GGUF."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (OSError, ValueError, KeyError, IndexError, EOFError) as exc:
        raise ArtifactError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})",
            "check the file (a complete .gguf, e.g. from llama.cpp's convert_hf_to_gguf.py)",
        ) from exc


def _gguf(path: Path, cache: Path | None) -> DecoderSource:
    from miaohui.paths import models_dir
    from miaohui.zoo.gguf import convert_gguf, ensure_converted, file_digest

    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise InputError(
            f"{path} is a GGUF of architecture {arch!r}, which build-llm does not take",
            f"use a GGUF of {list(GGUF_ARCHITECTURES)}, or the model's Hugging Face directory if it is one of "
            f"{list(ARCHITECTURES)}",
        )
    digest = file_digest(path)
    folder = cache or models_dir() / "gguf" / f"{path.stem}-{str(digest['sha256'])[:16]}"
    cls = GGUF_ARCHITECTURES[arch]
    ensure_converted(path, folder, lambda g, out, s: convert_gguf(g, out, s, cls), source=digest)
    return DecoderSource(path.name, folder, "gguf", cls, f"{path.name}@sha256:{digest['sha256']}", str(path))
