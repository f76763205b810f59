"""A small Llama forward in plain torch with the KV cache as explicit inputs and outputs (gpt-fast style).

Why not export HF's ``LlamaForCausalLM``: transformers 5 keeps the cache in ``Cache`` objects whose
Python-side bookkeeping the ONNX exporter cannot see. This module reads the same weights (embeddings and
norms shared; the fused, transposed projections are copies) and computes HF's math with the cache as tensors::

    forward(input_ids [B,S], attention_mask [B,P+S], position_ids [B,S], past_0_k, past_0_v, ...)
        -> (logits [B,V] at the last position, present_0_k [B,KVH,P+S,D], present_0_v, ...)

One graph serves prefill (P = 0) and decode (S = 1). Rows may be left-padded: ``attention_mask`` marks
the real cache slots, ``position_ids`` are each row's own positions, and query ``i`` may attend to cache
slot ``j`` when ``j <= P + i`` and the slot is real. Masked scores get the most negative float32 rather
than -inf, so a padding row (all slots masked) yields a harmless uniform softmax, never NaN.

Only the last position's logits are computed: the 576 × 49152 head is the largest matmul of the model,
and the server never needs logits of prompt tokens. Q/K/V and gate/up projections are fused into one
matmul each (fewer, larger GEMMs: faster on a 2-core CPU, and the same math).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from miaohui.generation.models.dims import DecoderDims

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


def _frozen(t: torch.Tensor) -> nn.Parameter:
    """A non-trainable parameter; transposed views are made contiguous (a plain MatMul weight in ONNX)."""
    return nn.Parameter(t.detach().contiguous(), requires_grad=False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = int(x.shape[-1]) // 2  # a constant in the ONNX graph: head_dim is not a dynamic axis
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qkv_heads(
    h: torch.Tensor,
    qkv: torch.Tensor,
    d: DecoderDims,
    bias: torch.Tensor | None = None,
    rows: tuple[Any, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused Q/K/V projection of ``h`` [B, S, hidden] (plus Qwen2's ``bias``, if any), split into heads:
    q [B, H, S, D], k and v [B, KVH, S, D]. ``rows``: (B, S) read once from the model's input, so that an
    exported graph computes them once rather than in every layer (ONNX Runtime then merges the layers' reshapes)."""
    b, s = rows if rows is not None else (h.shape[0], h.shape[1])
    proj = h @ qkv if bias is None else h @ qkv + bias
    q, k, v = torch.split(
        proj, [d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim], -1
    )
    return (
        q.view(b, s, d.num_heads, d.head_dim).transpose(1, 2),
        k.view(b, s, d.num_kv_heads, d.head_dim).transpose(1, 2),
        v.view(b, s, d.num_kv_heads, d.head_dim).transpose(1, 2),
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def rope_turned(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """:func:`rope` in fewer graph nodes: the halves of the last axis swapped by one ``Gather`` (``turn``:
    :func:`half_turn`), the sign of the first half carried by ``signed_sin`` (computed once for every layer). The same
    products with their sign moved, so exactly the same numbers; 4 ONNX nodes where :func:`rope` exports 7."""
    return x * cos + x.index_select(-1, turn) * signed_sin


def half_turn(head_dim: int) -> torch.Tensor:
    """Indices that swap the two halves of a head: ``x[..., half_turn(d)] == cat(x[..., d/2:], x[..., :d/2])``."""
    half = head_dim // 2
    return torch.cat([torch.arange(half, head_dim), torch.arange(0, half)])


def gqa_attention(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
    rows: tuple[Any, Any] | None = None,
) -> torch.Tensor:
    """Grouped-query attention without repeating K/V: head h reads KV head h // groups (HF's ``repeat_kv``).
    ``q`` [B, H, S, D], ``k_all``/``v_all`` [B, KVH, T, D], ``bias`` [B, 1, 1, S, T] → [B, S, H·D].
    ``rows``: (B, S) as in :func:`qkv_heads`; the head counts and size are constants of the graph."""
    b, s = rows if rows is not None else (q.shape[0], q.shape[2])
    heads, d, kv_heads = int(q.shape[1]), int(q.shape[3]), int(k_all.shape[1])
    q5 = q.reshape(b, kv_heads, heads // kv_heads, s, d)
    scores = q5 @ k_all.unsqueeze(2).transpose(-1, -2) * scaling  # [B, KVH, G, S, T]
    probs = torch.softmax(scores + bias, dim=-1)
    out = (probs @ v_all.unsqueeze(2)).reshape(b, heads, s, d)
    return out.transpose(1, 2).reshape(b, s, heads * d)


class _Layer(nn.Module):
    def __init__(self, dims: DecoderDims, hf_layer: Any) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.dims = dims
        self.in_norm = _frozen(hf_layer.input_layernorm.weight)
        self.post_norm = _frozen(hf_layer.post_attention_layernorm.weight)
        self.qkv = _frozen(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).t())
        biases = [getattr(attn, f"{n}_proj").bias for n in "qkv"]
        self.qkv_bias = _frozen(torch.cat(biases)) if all(b is not None for b in biases) else None  # Qwen2
        self.o = _frozen(attn.o_proj.weight.t())  # [H D, hidden]
        self.gate_up = _frozen(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t())  # [hidden, 2 I]
        self.down = _frozen(mlp.down_proj.weight.t())  # [I, hidden]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        turn: torch.Tensor,
        bias: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        rows: tuple[Any, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.dims
        q, k, v = qkv_heads(_rms_norm(x, self.in_norm, d.rms_eps), self.qkv, d, self.qkv_bias, rows)
        q, k = rope_turned(q, cos, signed_sin, turn), rope_turned(k, cos, signed_sin, turn)
        k_all = torch.cat([past_k, k], dim=2)  # [B, KVH, T, D]
        v_all = torch.cat([past_v, v], dim=2)
        x = x + gqa_attention(q, k_all, v_all, bias, d.head_dim**-0.5, rows) @ self.o
        h = _rms_norm(x, self.post_norm, d.rms_eps)
        gate, up = torch.split(h @ self.gate_up, [d.intermediate, d.intermediate], -1)
        x = x + (nn.functional.silu(gate) * up) @ self.down
        return x, k_all, v_all


class KVLlama(nn.Module):
    """Llama decoder with an explicit KV cache; built from (and sharing weights with) an HF model."""

    inv_freq: torch.Tensor
    turn: torch.Tensor
    sin_sign: torch.Tensor

    def __init__(self, hf_model: LlamaForCausalLM) -> None:
        super().__init__()
        self.dims = DecoderDims.from_hf(hf_model.config)
        base = hf_model.model
        self.embed = _frozen(base.embed_tokens.weight)
        self.layers = nn.ModuleList([_Layer(self.dims, layer) for layer in base.layers])
        self.norm = _frozen(base.norm.weight)
        # a separate [hidden, vocab] head (even when tied) so the ONNX graph holds a plain MatMul with a
        # constant weight, which the int8 quantizer can find
        self.head = _frozen(hf_model.lm_head.weight.t())
        d = self.dims
        rotary = getattr(base, "rotary_emb", None)
        if rotary is not None and getattr(rotary, "rope_type", "default") != "default":
            # scaled RoPE (linear, llama3): HF's own frequencies, static for every position
            inv_freq = rotary.inv_freq.detach().float().cpu().clone()
        else:
            inv_freq = 1.0 / (d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.int64).float() / d.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("turn", half_turn(d.head_dim), persistent=False)
        half = d.head_dim // 2
        self.register_buffer("sin_sign", torch.cat([-torch.ones(half), torch.ones(half)]), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        d = self.dims
        b, s, t = input_ids.shape[0], input_ids.shape[1], attention_mask.shape[1]
        x = nn.functional.embedding(input_ids, self.embed)
        freqs = position_ids.unsqueeze(-1).float() * self.inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, S, D]
        cos, signed_sin = emb.cos(), emb.sin() * self.sin_sign
        kv_idx = torch.arange(t, device=input_ids.device)
        q_idx = torch.arange(s, device=input_ids.device) + (t - s)
        allowed = (kv_idx.unsqueeze(0) <= q_idx.unsqueeze(1)).unsqueeze(0) & (attention_mask.unsqueeze(1) > 0)
        neg = torch.finfo(torch.float32).min
        bias = torch.where(allowed, 0.0, neg).to(torch.float32)[:, None, None]  # [B, 1, 1, S, T]
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, signed_sin, self.turn, bias, past[2 * i], past[2 * i + 1], (b, s))
            presents += [k, v]
        last = _rms_norm(x[:, -1, :], self.norm, d.rms_eps)
        return (last @ self.head, *presents)

    def empty_past(self, batch: int) -> list[torch.Tensor]:
        d = self.dims
        shape = (batch, d.num_kv_heads, 0, d.head_dim)
        return [torch.zeros(shape, dtype=torch.float32) for _ in range(2 * d.num_layers)]
