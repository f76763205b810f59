"""A compact BERT encoder for compiled engines: the same math as HF ``BertModel`` with Q/K/V fused into one
GEMM, SDPA attention with an additive padding bias, and no framework bookkeeping in the graph.

What TensorRT does by layer fusion we do in the model definition, so ``torch.export`` / AOTInductor see a
small, regular graph (fewer, larger kernels; one CUDA graph per bucket). Weights are copied from a trained
:class:`~miaohui.models.intent.IntentClassifier`; :func:`from_intent` checks nothing is left behind.

:func:`save_fast` / :func:`load_fast` keep a fast model as its weights + a small spec, so an engine can rebuild it
in a fraction of a second without the source checkpoint, ``transformers`` or ``torch.export.load`` (which took
8.6–12.6 s for the e5-shaped program on the H200; ``ModelConfig.fast_start``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load_file, save_file
from torch import nn

from miaohui.models.intent import IntentClassifier, SentenceEncoder

MASK_BIAS = -1e4
"""Added to attention scores of padding keys (finite, so half precision cannot overflow to NaN)."""


class FastBertLayer(nn.Module):
    fused_gelu: bool = False
    """The FFN's first GEMM, bias and GELU as one cuBLASLt call (``torch._addmm_activation``, the GEMM's GELU-bias
    epilogue; what TensorRT's GEMM+GELU fusion does): one kernel fewer per layer. On CUDA that GELU is the tanh form
    (|Δ| ≤ 5e-4 against erf); on the CPU the op computes erf GELU. Set by :func:`use_fused_gelu`: the GPU engine
    turns it on."""

    skinny: bool = False
    """The GEMMs through ``miaohui::skinny_linear`` (:mod:`miaohui.models.skinny_gemm`: a small-tile split-K Triton
    GEMM where the tuning file has the product's rows, cuBLAS elsewhere; the FFN's GELU as tanh), and each LayerNorm
    inside the stack with the GEMMs on either side of it as ``miaohui::proj_ln_proj`` (:mod:`miaohui.models.skinny_ln`:
    the residual add and LayerNorm done by the first GEMM's split-K reduce where it splits K; the same three kernels
    as without it elsewhere). That op spans layers (the FFN output, LayerNorm, the next layer's QKV), so
    :class:`FastBert` reads the flag from its first layer. Set by :func:`use_kernels`."""

    triton_attention: bool = False
    """The attention through ``miaohui::encoder_attention`` (:mod:`miaohui.models.encoder_attention`: one Triton
    kernel reading q, k, v from the QKV output, on CUDA; the same SDPA call elsewhere). Set by :func:`use_kernels`."""

    cublaslt: bool = False
    """With ``skinny``: the GEMMs that run cuBLAS run one cuBLASLt call with the algorithm the tuning file timed
    fastest for the product and rows, where it has one (:data:`miaohui.models.skinny_gemm.LT_BEST`), instead of the
    heuristic's pick. Set by :func:`use_kernels`."""

    direct_ops: bool = False
    """Call the functions behind miaohui's ops rather than the ops (``torch.library`` custom ops, which ``torch.export``
    and Inductor need): their Python dispatch cost ~0.6 ms a call on the H200 host, 7 s of a fast-graphs start that
    runs every bucket eagerly. Set by :func:`use_direct_ops` where nothing traces the model (``fast-graphs``)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.ffn_in = nn.Linear(hidden, intermediate)
        self.ffn_out = nn.Linear(intermediate, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self._proj_ln(self.attn_out, self.attention(self._proj(self.qkv, x), bias), x, self.ln1)
        return self._proj_ln(self.ffn_out, self._proj(self.ffn_in, x, gelu=True), x, self.ln2)

    def attention(self, qkv: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Multi-head attention over the QKV projection's output [B, S, 3H] → [B, S, H]."""
        b, s, h3 = qkv.shape
        if self.triton_attention:
            from miaohui.models import encoder_attention as ea  # Triton is imported only when asked for

            return (ea.encoder_attention_call if self.direct_ops else ea.encoder_attention_op)(qkv, bias, self.heads)
        q, k, v = qkv.view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, s, h3 // 3)

    def _proj_ln(self, lin: nn.Linear, h: torch.Tensor, residual: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
        """``ln(residual + lin(h))``."""
        return ln(residual + self._proj(lin, h))

    def _proj(self, lin: nn.Linear, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """``lin(x)`` (then GELU when ``gelu``) by the kernel the flags choose: ``skinny_linear`` (tanh GELU),
        cuBLASLt's GEMM+bias+GELU epilogue (``fused_gelu``), or ``nn.Linear`` and erf GELU."""
        if self.skinny:
            from miaohui.models import skinny_gemm  # Triton is imported only when asked for

            op = skinny_gemm.skinny_call if self.direct_ops else skinny_gemm.skinny_op
            return op(x, lin.weight, lin.bias, gelu, self.cublaslt)
        if gelu and self.fused_gelu:
            b, s, h = x.shape
            return torch._addmm_activation(lin.bias, x.reshape(b * s, h), lin.weight.t(), use_gelu=True).view(b, s, -1)
        out = lin(x)
        return F.gelu(out) if gelu else out


class FastBert(nn.Module):
    """Embeddings (word + position + token type 0) → LayerNorm → layers; returns the last hidden states.

    ``position_offset``: the first position id (RoBERTa / XLM-R count positions from ``pad_token_id + 1``);
    ``embedding_size``: embeddings narrower than the hidden size, projected up after their LayerNorm (ELECTRA-small's
    ``embeddings_project``); 0 = the hidden size. A model without token types (DistilBERT) has one all-zero row."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        layers: int,
        heads: int,
        intermediate: int,
        max_positions: int,
        type_vocab: int = 2,
        eps: float = 1e-12,
        *,
        init: bool = True,
        position_offset: int = 0,
        embedding_size: int = 0,
    ) -> None:
        super().__init__()
        width = embedding_size or hidden
        self.position_offset = position_offset
        self.word = _embedding(vocab, width, init)
        self.position = _embedding(max_positions, width, init)
        self.token_type = _embedding(type_vocab, width, init)
        self.ln = nn.LayerNorm(width, eps=eps)
        self.project = nn.Linear(width, hidden) if width != hidden else None
        self.layers = nn.ModuleList(FastBertLayer(hidden, heads, intermediate, eps) for _ in range(layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        off = self.position_offset
        x = self.word(input_ids) + self.position.weight[off : off + s] + self.token_type.weight[0]
        x = self.ln(x)
        if self.project is not None:
            x = self.project(x)
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * MASK_BIAS
        if self.layers[0].skinny:
            return _fused_stack(self.layers, x, bias)  # type: ignore[arg-type]
        for layer in self.layers:
            x = layer(x, bias)
        return x


def _fused_stack(layers: list[FastBertLayer], h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The layers with each inner LayerNorm and the GEMMs around it as one ``miaohui::proj_ln_proj``: attention output
    → LayerNorm → FFN in, and FFN output → LayerNorm → the next layer's QKV; the last LayerNorm stays as it was."""
    from miaohui.models import skinny_ln  # Triton is imported only when asked for

    proj_ln_proj = skinny_ln.proj_ln_proj_call if layers[0].direct_ops else skinny_ln.proj_ln_proj

    qkv = layers[0]._proj(layers[0].qkv, h)
    for i, layer in enumerate(layers):
        a = layer.attention(qkv, bias)
        lo, li = layer.attn_out, layer.ffn_in
        f, h = proj_ln_proj(a, lo.weight, lo.bias, h, layer.ln1.weight, layer.ln1.bias, layer.ln1.eps, li.weight,
                            li.bias, True, layer.cublaslt)  # fmt: skip
        if i + 1 == len(layers):
            return layer._proj_ln(layer.ffn_out, f, h, layer.ln2)
        fo, nq = layer.ffn_out, layers[i + 1].qkv
        qkv, h = proj_ln_proj(f, fo.weight, fo.bias, h, layer.ln2.weight, layer.ln2.bias, layer.ln2.eps, nq.weight,
                              nq.bias, False, layer.cublaslt)  # fmt: skip
    raise ValueError("FastBert without layers")


def _embedding(n: int, dim: int, init: bool) -> nn.Embedding:
    """``init=False``: no random init — the weights are loaded next. (An Embedding's init on the meta device runs
    ``normal_`` through torch's Python reference ops, whose first import took 1.2 s of a fast start on this CPU.)"""
    return nn.Embedding(n, dim) if init else nn.Embedding(n, dim, _weight=torch.empty(n, dim))


def _set_layer_flag(module: nn.Module, flag: str, on: bool) -> nn.Module:
    for layer in module.modules():
        if isinstance(layer, FastBertLayer):
            setattr(layer, flag, on)
    return module


def use_kernels(module: nn.Module, *, skinny: bool, attention: bool, cublaslt: bool = False) -> nn.Module:
    """Switch every :class:`FastBertLayer` of ``module`` to miaohui's ops: ``skinny`` (the GEMMs and the fused
    LayerNorms), ``attention`` (``triton_attention``), ``cublaslt`` (with ``skinny``: timed cuBLASLt algorithms)."""
    for flag, on in (("skinny", skinny), ("triton_attention", attention), ("cublaslt", cublaslt and skinny)):
        _set_layer_flag(module, flag, on)
    return module


def use_direct_ops(module: nn.Module, on: bool = True) -> nn.Module:
    """Switch every :class:`FastBertLayer` of ``module`` to call miaohui's ops' functions directly (``direct_ops``)."""
    return _set_layer_flag(module, "direct_ops", on)


def use_fused_gelu(module: nn.Module, on: bool = True) -> nn.Module:
    """Switch every :class:`FastBertLayer` of ``module`` to the fused GEMM+bias+GELU (see ``fused_gelu``)."""
    return _set_layer_flag(module, "fused_gelu", on)


def _pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


class FastIntentClassifier(nn.Module):
    def __init__(self, encoder: FastBert, num_labels: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.ln.normalized_shape[0], num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(_pool(self.encoder(input_ids, attention_mask), attention_mask))


HEAD_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"tanh": torch.tanh, "gelu": F.gelu,
                                                                        "relu": F.relu}  # fmt: skip


class FastClsClassifier(nn.Module):
    """The head of a Hugging Face ``*ForSequenceClassification`` on the first token: ``out(act(dense(h[:, 0])))``.
    BERT (pooler + classifier) and RoBERTa / XLM-R: tanh; ELECTRA: GELU; DistilBERT (pre_classifier): ReLU."""

    def __init__(self, encoder: FastBert, num_labels: int, activation: str) -> None:
        super().__init__()
        if activation not in HEAD_ACTIVATIONS:
            raise ValueError(f"head activation {activation!r}: one of {sorted(HEAD_ACTIVATIONS)}")
        first: FastBertLayer = encoder.layers[0]  # type: ignore[assignment]
        hidden = first.attn_out.in_features
        self.encoder = encoder
        self.activation = activation
        self.dense = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        first = self.encoder(input_ids, attention_mask)[:, 0]
        return self.out(HEAD_ACTIVATIONS[self.activation](self.dense(first)))


class FastSentenceEncoder(nn.Module):
    """Pooled (masked mean, or the first token: ``pooling``) and, with ``normalize``, L2-normalized embeddings."""

    def __init__(self, encoder: FastBert, pooling: Literal["mean", "cls"] = "mean", normalize: bool = True) -> None:
        super().__init__()
        self.encoder = encoder
        self.pooling = pooling
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids, attention_mask)
        pooled = hidden[:, 0] if self.pooling == "cls" else _pool(hidden, attention_mask)
        return F.normalize(pooled, dim=-1) if self.normalize else pooled


@torch.no_grad()
def _copy_encoder(hf: Any) -> FastBert:
    cfg = hf.config
    fast = FastBert(
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.intermediate_size,
        cfg.max_position_embeddings,
        cfg.type_vocab_size,
        cfg.layer_norm_eps,
    )
    emb = hf.embeddings
    fast.word.weight.copy_(emb.word_embeddings.weight)
    fast.position.weight.copy_(emb.position_embeddings.weight)
    fast.token_type.weight.copy_(emb.token_type_embeddings.weight)
    fast.ln.load_state_dict(emb.LayerNorm.state_dict())
    mine: FastBertLayer
    for mine, theirs in zip(fast.layers, hf.encoder.layer, strict=True):  # type: ignore[assignment]
        att = theirs.attention
        mine.qkv.weight.copy_(torch.cat([att.self.query.weight, att.self.key.weight, att.self.value.weight]))
        mine.qkv.bias.copy_(torch.cat([att.self.query.bias, att.self.key.bias, att.self.value.bias]))
        mine.attn_out.load_state_dict(att.output.dense.state_dict())
        mine.ln1.load_state_dict(att.output.LayerNorm.state_dict())
        mine.ffn_in.load_state_dict(theirs.intermediate.dense.state_dict())
        mine.ffn_out.load_state_dict(theirs.output.dense.state_dict())
        mine.ln2.load_state_dict(theirs.output.LayerNorm.state_dict())
    return fast


def from_module(module: Any) -> nn.Module:
    """The fast equivalent of a (HF-based) :class:`IntentClassifier` or :class:`SentenceEncoder`, eval mode."""
    model_type = getattr(module.encoder.config, "model_type", "bert")
    if model_type != "bert":  # RoBERTa's weights have BERT's names but its positions are offset: refuse, not copy
        raise ValueError(f"FastBert implements BERT, the model is a {model_type!r} encoder")
    act = getattr(module.encoder.config, "hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"FastBert implements erf GELU, the model uses {act!r}")
    encoder = _copy_encoder(module.encoder)
    if isinstance(module, IntentClassifier):
        classifier = FastIntentClassifier(encoder, module.head.out_features)
        with torch.no_grad():
            classifier.head.load_state_dict(module.head.state_dict())
        fast: nn.Module = classifier
    elif isinstance(module, SentenceEncoder):
        fast = FastSentenceEncoder(encoder)
    else:
        raise TypeError(f"cannot convert {type(module).__name__}")
    return fast.eval()


FAST_WEIGHTS = "eager.safetensors"
FAST_SPEC = "eager.json"


class FastSpec(BaseModel):
    """The architecture of a fast model: what :func:`load_fast` rebuilds it from (with its weights)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["intent", "encoder", "cls-classifier"]
    """``intent``: miaohui's classifier (mean pool + linear); ``cls-classifier``: a Hugging Face sequence classifier's
    head on the first token (:class:`FastClsClassifier`); ``encoder``: pooled embeddings."""
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int
    type_vocab: int
    eps: float
    num_labels: int = 0
    """Logits of a classifier; 0 for an ``encoder``."""
    fused_gelu: bool = False
    position_offset: int = 0
    embedding_size: int = 0
    head_activation: str = "tanh"
    """``cls-classifier``: the activation between its two linears."""
    pooling: Literal["mean", "cls"] = "mean"
    normalize: bool = True
    """``encoder``: how the hidden states are pooled, and whether the result is L2-normalized."""


def spec_of(module: nn.Module) -> FastSpec:
    """The spec of a :class:`FastIntentClassifier` or :class:`FastSentenceEncoder`."""
    if not isinstance(module, FastIntentClassifier | FastSentenceEncoder | FastClsClassifier):
        raise TypeError(f"not a fast model: {type(module).__name__}")
    enc: FastBert = module.encoder
    first: FastBertLayer = enc.layers[0]  # type: ignore[assignment]
    kind: Literal["intent", "encoder", "cls-classifier"] = (
        "intent" if isinstance(module, FastIntentClassifier)
        else "cls-classifier" if isinstance(module, FastClsClassifier) else "encoder"
    )  # fmt: skip
    num_labels = (
        module.head.out_features if isinstance(module, FastIntentClassifier)
        else module.out.out_features if isinstance(module, FastClsClassifier) else 0
    )  # fmt: skip
    return FastSpec(
        kind=kind,
        vocab=enc.word.num_embeddings,
        hidden=first.attn_out.in_features,
        layers=len(enc.layers),
        heads=first.heads,
        intermediate=first.ffn_in.out_features,
        max_positions=enc.position.num_embeddings,
        type_vocab=enc.token_type.num_embeddings,
        eps=float(enc.ln.eps),
        num_labels=num_labels,
        fused_gelu=first.fused_gelu,
        position_offset=enc.position_offset,
        embedding_size=enc.word.embedding_dim if enc.project is not None else 0,
        head_activation=module.activation if isinstance(module, FastClsClassifier) else "tanh",
        pooling=module.pooling if isinstance(module, FastSentenceEncoder) else "mean",
        normalize=module.normalize if isinstance(module, FastSentenceEncoder) else True,
    )


def build_head(spec: FastSpec, encoder: FastBert) -> nn.Module:
    """The model of kind ``spec.kind`` around ``encoder``."""
    if spec.kind == "intent":
        return FastIntentClassifier(encoder, spec.num_labels)
    if spec.kind == "cls-classifier":
        return FastClsClassifier(encoder, spec.num_labels, spec.head_activation)
    return FastSentenceEncoder(encoder, spec.pooling, spec.normalize)


def save_fast(module: nn.Module, directory: Path) -> None:
    """``module``'s weights (as they are: dtype included) and spec into ``directory``."""
    spec = spec_of(module)
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(Path(directory) / FAST_WEIGHTS))
    (Path(directory) / FAST_SPEC).write_text(spec.model_dump_json(indent=1), encoding="utf-8")


def has_fast(directory: Path) -> bool:
    return (Path(directory) / FAST_WEIGHTS).is_file() and (Path(directory) / FAST_SPEC).is_file()


def load_fast(directory: Path, device: torch.device | str) -> nn.Module:
    """The fast model saved by :func:`save_fast`, its weights read straight onto ``device``, in eval mode.

    Built on the meta device and given the loaded tensors (no random init, no second copy); a weight file that
    does not match the spec raises (``load_state_dict`` strict)."""
    spec = FastSpec.model_validate_json((Path(directory) / FAST_SPEC).read_text(encoding="utf-8"))
    with torch.device("meta"):
        encoder = FastBert(
            spec.vocab,
            spec.hidden,
            spec.layers,
            spec.heads,
            spec.intermediate,
            spec.max_positions,
            spec.type_vocab,
            spec.eps,
            init=False,
            position_offset=spec.position_offset,
            embedding_size=spec.embedding_size,
        )
        module = build_head(spec, encoder)
    state = load_file(str(Path(directory) / FAST_WEIGHTS), device=str(device))
    module.load_state_dict(state, strict=True, assign=True)
    use_fused_gelu(module, spec.fused_gelu)
    return module.eval().requires_grad_(False)
