"""A team's Hugging Face encoder as :mod:`miaohui.models.fast_bert`'s fast encoder: the same weights in FastBert's
layout (Q/K/V fused), with the source's own head, so the GPU engine runs miaohui's encoder and its tuning file on it.

Covered: BERT, RoBERTa / XLM-RoBERTa / CamemBERT (positions counted from ``pad_token_id + 1``), DistilBERT (its
own layer names, no token types) and ELECTRA (embeddings projected up where they are narrower than the hidden size);
``*ForSequenceClassification`` heads (BERT's pooler + classifier, RoBERTa's and ELECTRA's classification heads,
DistilBERT's pre-classifier) and bare encoders pooled by mean or CLS. :func:`fast_from_hf` raises
:class:`Unsupported` naming what does not fit (another activation, a head of another shape); the caller then
compiles the source's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from miaohui.models.fast_bert import FastBert, FastBertLayer, FastClsClassifier, FastSentenceEncoder

BERT_LIKE = ("bert", "roberta", "xlm-roberta", "camembert", "electra")
"""Model types whose layers have BERT's module names (``attention.self.query`` …)."""
ROBERTA_LIKE = ("roberta", "xlm-roberta", "camembert")
GELU = ("gelu",)
"""Activations FastBert computes (erf GELU; the GPU's fused epilogue is its tanh form, |Δ| ≤ 5e-4)."""


class Unsupported(ValueError):
    """The source does not map onto FastBert; the message says what."""


def fast_from_hf(module: nn.Module) -> nn.Module:
    """The fast equivalent (eval mode) of a :class:`~miaohui.sources.hf_encoder.HFClassifier` or
    :class:`~miaohui.sources.hf_encoder.HFEmbedder`; raises :class:`Unsupported` where it has none."""
    hf: Any = module.get_submodule("hf")
    cfg = hf.config
    model_type = str(getattr(cfg, "model_type", "?"))
    act = str(getattr(cfg, "activation" if model_type == "distilbert" else "hidden_act", "gelu"))
    if act not in GELU:
        raise Unsupported(f"FastBert computes erf GELU, this {model_type} model uses {act!r}")
    base = hf.base_model
    encoder = _copy_distilbert(base) if model_type == "distilbert" else _copy_bert_like(base, model_type)
    pooling = getattr(module, "pooling", None)  # HFEmbedder
    if pooling in ("mean", "cls"):
        fast: nn.Module = FastSentenceEncoder(encoder, pooling, bool(getattr(module, "normalize", False)))
    else:
        fast = _classifier(hf, model_type, encoder)
    return fast.eval()


def _classifier(hf: Any, model_type: str, encoder: FastBert) -> FastClsClassifier:
    """The ``*ForSequenceClassification`` head as :class:`FastClsClassifier` (dense → activation → out)."""
    if model_type == "bert":
        if getattr(hf.bert, "pooler", None) is None:
            raise Unsupported("a BertForSequenceClassification without its pooler")
        dense, out, act = hf.bert.pooler.dense, hf.classifier, "tanh"
    elif model_type == "distilbert":
        dense, out, act = hf.pre_classifier, hf.classifier, "relu"
    else:  # RobertaClassificationHead / ElectraClassificationHead
        head = hf.classifier
        if not hasattr(head, "dense") or not hasattr(head, "out_proj"):
            raise Unsupported(f"a {type(head).__name__} head (expected dense + out_proj)")
        act = "gelu" if model_type == "electra" else "tanh"
        if model_type == "electra" and str(getattr(hf.config, "hidden_act", "gelu")) != "gelu":
            raise Unsupported("an ELECTRA head with an activation other than GELU")
        dense, out = head.dense, head.out_proj
    fast = FastClsClassifier(encoder, out.out_features, act)
    with torch.no_grad():
        fast.dense.load_state_dict(dense.state_dict())
        fast.out.load_state_dict(out.state_dict())
    return fast


def _new_encoder(cfg: Any, *, hidden: int, layers: int, heads: int, intermediate: int, **kw: Any) -> FastBert:
    return FastBert(
        cfg.vocab_size, hidden, layers, heads, intermediate, cfg.max_position_embeddings,
        kw.pop("type_vocab", getattr(cfg, "type_vocab_size", 1) or 1), kw.pop("eps", 1e-12), **kw,
    )  # fmt: skip


@torch.no_grad()
def _copy_bert_like(base: Any, model_type: str) -> FastBert:
    cfg = base.config
    emb = base.embeddings
    width = int(emb.word_embeddings.embedding_dim)
    offset = int(cfg.pad_token_id) + 1 if model_type in ROBERTA_LIKE else 0
    fast = _new_encoder(
        cfg, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
        intermediate=cfg.intermediate_size, eps=cfg.layer_norm_eps, position_offset=offset,
        embedding_size=width if width != cfg.hidden_size else 0,
    )  # fmt: skip
    fast.word.weight.copy_(emb.word_embeddings.weight)
    fast.position.weight.copy_(emb.position_embeddings.weight)
    fast.token_type.weight.copy_(emb.token_type_embeddings.weight)
    fast.ln.load_state_dict(emb.LayerNorm.state_dict())
    if fast.project is not None:
        fast.project.load_state_dict(base.embeddings_project.state_dict())
    mine: FastBertLayer
    for mine, theirs in zip(fast.layers, base.encoder.layer, strict=True):  # type: ignore[assignment]
        att = theirs.attention
        _qkv(mine, att.self.query, att.self.key, att.self.value)
        mine.attn_out.load_state_dict(att.output.dense.state_dict())
        mine.ln1.load_state_dict(att.output.LayerNorm.state_dict())
        mine.ffn_in.load_state_dict(theirs.intermediate.dense.state_dict())
        mine.ffn_out.load_state_dict(theirs.output.dense.state_dict())
        mine.ln2.load_state_dict(theirs.output.LayerNorm.state_dict())
    return fast


@torch.no_grad()
def _copy_distilbert(base: Any) -> FastBert:
    cfg = base.config
    fast = _new_encoder(
        cfg, hidden=cfg.dim, layers=cfg.n_layers, heads=cfg.n_heads, intermediate=cfg.hidden_dim, type_vocab=1,
        eps=1e-12,
    )  # fmt: skip
    emb = base.embeddings
    fast.word.weight.copy_(emb.word_embeddings.weight)
    fast.position.weight.copy_(emb.position_embeddings.weight)
    fast.token_type.weight.zero_()
    fast.ln.load_state_dict(emb.LayerNorm.state_dict())
    mine: FastBertLayer
    for mine, theirs in zip(fast.layers, base.transformer.layer, strict=True):  # type: ignore[assignment]
        att = theirs.attention
        _qkv(mine, att.q_lin, att.k_lin, att.v_lin)
        mine.attn_out.load_state_dict(att.out_lin.state_dict())
        mine.ln1.load_state_dict(theirs.sa_layer_norm.state_dict())
        mine.ffn_in.load_state_dict(theirs.ffn.lin1.state_dict())
        mine.ffn_out.load_state_dict(theirs.ffn.lin2.state_dict())
        mine.ln2.load_state_dict(theirs.output_layer_norm.state_dict())
        mine.ln1.eps = mine.ln2.eps = float(theirs.sa_layer_norm.eps)
    fast.ln.eps = float(emb.LayerNorm.eps)
    return fast


def _qkv(layer: FastBertLayer, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
    layer.qkv.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
    layer.qkv.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
