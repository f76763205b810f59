"""A Hugging Face encoder directory as ``save_pretrained`` writes it → a :class:`LoadedModel`.

``*ForSequenceClassification`` → task ``intent``: the model's own head (e.g. BERT's pooler + classifier on CLS),
labels from ``id2label``. A bare encoder (``*Model``, or a sentence-transformers directory with ``modules.json``)
→ task ``encoder``: pooled the way ``1_Pooling/config.json`` says (mean or CLS), L2-normalized iff ``modules.json``
lists a ``Normalize`` module. A bare HF directory without sentence-transformers files pools by masked mean and
does not normalize (the common convention; sentence-transformers does the same for a plain HF model).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer
from torch import nn

from miaohui.errors import ArtifactError
from miaohui.models.checkpoint import META_NAME, WEIGHTS_NAME, LoadedModel, ModelMeta
from miaohui.models.intent import mean_pool

SUPPORTED = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra")
"""``model_type`` values whose encoders export to ONNX through miaohui's path (eager attention, opset 17)."""
WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt",
    "sentencepiece.bpe.model", "spiece.model", "added_tokens.json",
)  # fmt: skip
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
ROBERTA_LIKE = ("roberta", "xlm-roberta", "camembert")
"""Position ids start after the padding index: ``max_position_embeddings - (pad_token_id + 1)`` usable."""


class HFClassifier(nn.Module):
    """``(input_ids, attention_mask) -> logits`` of a ``*ForSequenceClassification`` (its own head)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits


class HFEmbedder(nn.Module):
    """``(input_ids, attention_mask) -> embeddings``: a bare encoder, pooled (mean or CLS), optionally normalized."""

    def __init__(self, hf: nn.Module, pooling: Literal["mean", "cls"], normalize: bool) -> None:
        super().__init__()
        self.hf = hf
        self.pooling = pooling
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.hf(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        pooled = hidden[:, 0] if self.pooling == "cls" else mean_pool(hidden, attention_mask)
        return nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "modules.json").is_file()


def read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"{file} is not readable JSON: {exc}", f"restore {file.name} from the model's source"
        ) from exc


def model_dir(path: Path) -> Path:
    """The directory holding ``config.json``: the path itself, or a sentence-transformers Transformer module's."""
    modules = path / "modules.json"
    if modules.is_file():
        for module in read_json(modules):
            if str(module.get("type", "")).endswith("Transformer") and module.get("path"):
                return path / str(module["path"])
    return path


def sentence_transformers_head(path: Path) -> tuple[Literal["mean", "cls"], bool, int | None] | None:
    """(pooling, normalize, max_seq_length) declared by a sentence-transformers directory; None without one."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = read_json(modules_file)
    pooling: Literal["mean", "cls"] = "mean"
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling = _pooling_mode(path / str(module.get("path", "")) / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ArtifactError(
                f"{modules_file} lists a {kind} module, which miaohui does not build",
                "use a sentence-transformers model made of Transformer, Pooling (mean or CLS) and Normalize only",
            )
    config = path / "sentence_bert_config.json"
    max_len = read_json(config).get("max_seq_length") if config.is_file() else None
    return pooling, normalize, int(max_len) if max_len else None


def _pooling_mode(config_file: Path) -> Literal["mean", "cls"]:
    cfg = read_json(config_file) if config_file.is_file() else {"pooling_mode_mean_tokens": True}
    modes = sorted(k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v)
    if modes == ["mean_tokens"]:
        return "mean"
    if modes == ["cls_token"]:
        return "cls"
    raise ArtifactError(
        f"{config_file} asks for pooling {modes or 'none'}; miaohui builds mean or CLS pooling",
        "set exactly one of pooling_mode_mean_tokens or pooling_mode_cls_token to true",
    )


def inspect_hf(path: Path) -> ModelMeta:
    """What the directory is (task, architecture, labels, pooling, max length), read from its files only."""
    root = model_dir(path)
    if not (root / "config.json").is_file():
        raise ArtifactError(
            f"{root} has no config.json",
            "point at the directory `save_pretrained` wrote (config.json, model.safetensors, tokenizer.json)",
        )
    config = read_json(root / "config.json")
    model_type = str(config.get("model_type", "?"))
    archs = config.get("architectures") or []
    arch = str(archs[0]) if archs else f"{model_type} (no architectures in config.json)"
    if model_type not in SUPPORTED:
        raise ArtifactError(
            f"{root / 'config.json'}: architecture {arch} (model_type {model_type!r}) is not supported",
            f"miaohui builds encoders of model types {', '.join(SUPPORTED)}",
        )
    if not any((root / w).is_file() for w in WEIGHT_FILES):
        raise ArtifactError(
            f"{root} has config.json but no weights ({' or '.join(WEIGHT_FILES[:2])})",
            "save the model with model.save_pretrained(DIR)",
        )
    st = sentence_transformers_head(path)
    if arch.endswith("ForSequenceClassification") and st is None:
        kind: Literal["intent", "encoder"] = "intent"
        id2label = config.get("id2label") or {str(i): f"LABEL_{i}" for i in range(int(config.get("num_labels", 2)))}
        labels = [str(id2label[k]) for k in sorted(id2label, key=int)]
    elif arch.endswith("Model") or st is not None:
        kind, labels = "encoder", []
    else:
        raise ArtifactError(
            f"{root / 'config.json'} declares {arch}, neither a sequence classifier nor a bare encoder",
            "save a *ForSequenceClassification (task intent) or a *Model / sentence-transformers directory "
            "(task encoder)",
        )
    pooling, normalize, st_len = st or ("mean", False, None)
    config.setdefault("hidden_size", config.get("dim"))  # DistilBERT names them dim and n_heads
    config.setdefault("num_attention_heads", config.get("n_heads"))
    meta = ModelMeta(
        kind=kind,
        base=f"hf:{config.get('_name_or_path') or root.name}",
        bert_config=config,
        labels=labels,
        max_length=max_length(root, config, st_len),
        source_format="hf",
        architecture=arch,
        pooling=pooling,
        normalize=normalize,
    )
    return meta


def max_length(root: Path, config: dict[str, Any], st_len: int | None) -> int:
    """The smallest of: the positions the model has (minus RoBERTa's offset), the tokenizer's
    ``model_max_length``, sentence-transformers' ``max_seq_length``; at most 512 when only positions are known."""
    positions = int(config.get("max_position_embeddings", 512))
    if config.get("model_type") in ROBERTA_LIKE:
        positions -= int(config.get("pad_token_id", 1)) + 1
    limits = [positions]
    tok_cfg = root / "tokenizer_config.json"
    tok_len = read_json(tok_cfg).get("model_max_length") if tok_cfg.is_file() else None
    if isinstance(tok_len, int | float) and 0 < tok_len < 1_000_000:
        limits.append(int(tok_len))
    if st_len:
        limits.append(st_len)
    if len(limits) == 1:
        limits.append(512)
    return min(limits)


def source_files(path: Path) -> list[Path]:
    """The files that define the model (hashed into the build key), in a fixed order."""
    root = model_dir(path)
    names = ("config.json", *WEIGHT_FILES, *TOKENIZER_FILES)
    files = [root / n for n in names if (root / n).is_file()]
    files += sorted(root.glob("model-*.safetensors")) + sorted(root.glob("pytorch_model-*.bin"))
    if (path / "modules.json").is_file():
        files += [path / n for n in ST_FILES if (path / n).is_file()]
        files += sorted(path.glob("*_Pooling/config.json"))
    return files


def hf_digest(path: Path) -> str:
    h = hashlib.sha256()
    for file in source_files(path):
        h.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def load_tokenizer(root: Path) -> Tokenizer:
    """``tokenizer.json``, or the fast tokenizer transformers converts from the slow tokenizer's files."""
    file = root / "tokenizer.json"
    if file.is_file():
        try:
            return Tokenizer.from_file(str(file))
        except Exception as exc:
            raise ArtifactError(
                f"cannot read {file}: {exc}", "save it again with tokenizer.save_pretrained(DIR)"
            ) from exc
    backend = None
    vocab = [n for n in ("vocab.txt", "vocab.json", "sentencepiece.bpe.model", "spiece.model") if (root / n).is_file()]
    if vocab:  # without a vocabulary transformers would make an empty tokenizer, not fail
        try:
            from transformers import AutoTokenizer

            backend = getattr(AutoTokenizer.from_pretrained(str(root)), "backend_tokenizer", None)
        except Exception:
            backend = None
    if not isinstance(backend, Tokenizer):
        raise ArtifactError(
            f"{root} has no tokenizer.json and no tokenizer files transformers can convert",
            "save the model's tokenizer into the directory: AutoTokenizer.from_pretrained(...).save_pretrained(DIR)",
        )
    return backend


def _check_weights(root: Path) -> None:
    """A damaged safetensors file named before transformers fails on it with a less helpful message."""
    from safetensors import safe_open

    for file in [root / "model.safetensors", *sorted(root.glob("model-*.safetensors"))]:
        if not file.is_file():
            continue
        try:
            with safe_open(str(file), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 — safe_open has no __iter__
                    fh.get_slice(key)
        except Exception as exc:
            raise ArtifactError(
                f"{file} is not a valid safetensors file ({exc})",
                "the file is truncated or corrupt: save the model again with model.save_pretrained(DIR)",
            ) from exc


def build_hf_module(meta: ModelMeta, hf: nn.Module) -> nn.Module:
    if meta.kind == "intent":
        return HFClassifier(hf)
    return HFEmbedder(hf, meta.pooling, meta.normalize)


def load_hf(path: Path, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load the directory's model (eval mode) and tokenizer. ``attn_implementation='eager'`` for ONNX export."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    path = Path(path)
    meta = inspect_hf(path)
    root = model_dir(path)
    tokenizer = load_tokenizer(root)
    _check_weights(root)
    factory = AutoModelForSequenceClassification if meta.kind == "intent" else AutoModel
    try:
        hf = factory.from_pretrained(str(root), attn_implementation=attn_implementation)
    except Exception as exc:
        raise ArtifactError(
            f"transformers cannot load {root}: {str(exc).splitlines()[0]}",
            "check the directory with AutoModel.from_pretrained(DIR); save it again with model.save_pretrained(DIR)",
        ) from exc
    module = build_hf_module(meta, hf).eval()
    return LoadedModel(path=path, meta=meta, module=module, tokenizer=tokenizer, digest=hf_digest(path))


def save_as_checkpoint(model: LoadedModel, out_dir: Path) -> None:
    """Write ``model`` (an HF source) as ``miaohui-model.json`` + ``model.safetensors`` of the HF model's state:
    what the torch backend's artifact holds and :func:`load_saved` reads back."""
    from safetensors.torch import save_file

    hf = model.module.get_submodule("hf")
    state = {k: v.detach().contiguous().clone() for k, v in hf.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS_NAME))
    (out_dir / META_NAME).write_text(model.meta.model_dump_json(indent=2), encoding="utf-8")


def load_saved(path: Path, meta: ModelMeta, attn_implementation: str = "sdpa") -> nn.Module:
    """The module of a checkpoint written by :func:`save_as_checkpoint` (no tokenizer needed)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    cfg = dict(meta.bert_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = attn_implementation
    factory = AutoModelForSequenceClassification if meta.kind == "intent" else AutoModel
    hf = factory.from_config(config)
    hf.load_state_dict(load_file(str(Path(path) / WEIGHTS_NAME)))
    return build_hf_module(meta, hf).eval()
