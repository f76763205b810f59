"""Gemma 3 (text) in plain torch with the KV cache as explicit inputs and outputs: :class:`KVLlama`'s contract
(same inputs, outputs and names, so the ONNX export, the checks and the ONNX Runtime engine take either).

What differs from Llama, following HF's ``Gemma3ForCausalLM``:

* embeddings scaled by ``sqrt(hidden)``; RMSNorm weights are offsets (``x̂ · (1 + w)``, computed in fp32);
* four norms per layer: before and after attention, before and after the MLP (each output normed before the
  residual add); Q and K RMS-normed per head before RoPE; attention scaled by ``query_pre_attn_scalar ** -0.5``;
* GeGLU MLP (``gelu_tanh(gate) · up``);
* local layers (``layer_types == "sliding_attention"``) attend to the last ``sliding_window`` cache slots only
  (``kv > q − window``, in cache coordinates: left padding keeps a row's real tokens contiguous) and use the local
  RoPE base (10 000); global layers see the whole cache with the global base (1 000 000). The cache keeps every
  position for every layer; the mask does the windowing (no ring buffer).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from miaohui.errors import ArtifactError
from miaohui.generation.models.dims import DecoderDims
from miaohui.generation.models.llama import _frozen, gqa_attention, qkv_heads, rope


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: fp32, offset weight ``1 + w``."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


def _rope_theta(config: Any, layer_type: str) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        return float(params[layer_type]["rope_theta"])
    local = getattr(config, "rope_local_base_freq", None)
    if layer_type == "sliding_attention" and local is not None:
        return float(local)
    return float(getattr(config, "rope_theta", None) or 1_000_000.0)


def gemma_dims(config: Any) -> DecoderDims:
    """:class:`DecoderDims` of a Gemma 3 text config (``rope_theta`` = the global layers' base)."""
    return DecoderDims(
        num_layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size),
        num_heads=int(config.num_attention_heads),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(config.head_dim),
        intermediate=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        rope_theta=_rope_theta(config, "full_attention"),
        rms_eps=float(config.rms_norm_eps),
        max_positions=int(config.max_position_embeddings),
    )


class _Layer(nn.Module):
    def __init__(self, dims: DecoderDims, hf_layer: Any, scaling: float, sliding: bool) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.dims, self.scaling, self.sliding = dims, scaling, sliding
        self.in_norm = _frozen(hf_layer.input_layernorm.weight)
        self.post_attn_norm = _frozen(hf_layer.post_attention_layernorm.weight)
        self.pre_mlp_norm = _frozen(hf_layer.pre_feedforward_layernorm.weight)
        self.post_mlp_norm = _frozen(hf_layer.post_feedforward_layernorm.weight)
        self.q_norm = _frozen(attn.q_norm.weight)
        self.k_norm = _frozen(attn.k_norm.weight)
        self.qkv = _frozen(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).t())
        self.o = _frozen(attn.o_proj.weight.t())
        self.gate_up = _frozen(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t())
        self.down = _frozen(mlp.down_proj.weight.t())

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        rows: tuple[Any, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.dims
        q, k, v = qkv_heads(_norm(x, self.in_norm, d.rms_eps), self.qkv, d, rows=rows)
        # per-head norms (over head_dim), then RoPE
        q, k = rope(_norm(q, self.q_norm, d.rms_eps), cos, sin), rope(_norm(k, self.k_norm, d.rms_eps), cos, sin)
        k_all = torch.cat([past_k, k], dim=2)  # [B, KVH, T, D]
        v_all = torch.cat([past_v, v], dim=2)
        attn = gqa_attention(q, k_all, v_all, bias, self.scaling, rows) @ self.o
        x = x + _norm(attn, self.post_attn_norm, d.rms_eps)
        gate, up = torch.split(_norm(x, self.pre_mlp_norm, d.rms_eps) @ self.gate_up, [d.intermediate] * 2, -1)
        mlp = (nn.functional.gelu(gate, approximate="tanh") * up) @ self.down
        return x + _norm(mlp, self.post_mlp_norm, d.rms_eps), k_all, v_all


class KVGemma3(nn.Module):
    """Gemma 3 text decoder with an explicit KV cache; built from (and sharing weights with) an HF model."""

    local_inv_freq: torch.Tensor
    global_inv_freq: torch.Tensor

    def __init__(self, hf_model: Any) -> None:
        super().__init__()
        config = hf_model.config
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
            raise ArtifactError(
                "this Gemma config uses logit soft-capping, which the explicit-KV Gemma 3 module does not compute",
                "use a Gemma 3 checkpoint (soft-capping is a Gemma 2 feature)",
            )
        self.dims = d = gemma_dims(config)
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * d.num_layers)
        self.sliding = [t == "sliding_attention" for t in types]
        self.window = int(getattr(config, "sliding_window", None) or d.max_positions)
        scaling = float(config.query_pre_attn_scalar) ** -0.5
        base = hf_model.model
        self.embed = _frozen(base.embed_tokens.weight)
        self.embed_scale = math.sqrt(d.hidden)
        self.layers = nn.ModuleList(
            [_Layer(d, layer, scaling, sliding) for layer, sliding in zip(base.layers, self.sliding, strict=True)]
        )
        self.norm = _frozen(base.norm.weight)
        self.head = _frozen(hf_model.lm_head.weight.t())  # a separate [hidden, vocab] MatMul weight (see KVLlama)
        idx = torch.arange(0, d.head_dim, 2, dtype=torch.int64).float() / d.head_dim
        local, glob = _rope_theta(config, "sliding_attention"), _rope_theta(config, "full_attention")
        self.register_buffer("local_inv_freq", 1.0 / (local**idx), persistent=False)
        self.register_buffer("global_inv_freq", 1.0 / (glob**idx), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        d = self.dims
        b, s, t = input_ids.shape[0], input_ids.shape[1], attention_mask.shape[1]
        x = nn.functional.embedding(input_ids, self.embed) * self.embed_scale
        rope = {}
        for name, inv in (("local", self.local_inv_freq), ("global", self.global_inv_freq)):
            freqs = position_ids.unsqueeze(-1).float() * inv  # [B, S, D/2]
            emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, S, D]
            rope[name] = (emb.cos(), emb.sin())
        kv_idx = torch.arange(t, device=input_ids.device).unsqueeze(0)
        q_idx = (torch.arange(s, device=input_ids.device) + (t - s)).unsqueeze(1)
        real = attention_mask.unsqueeze(1) > 0  # [B, 1, T]
        causal = (kv_idx <= q_idx).unsqueeze(0) & real  # [B, S, T]
        window = causal & (kv_idx > q_idx - self.window).unsqueeze(0)
        neg = torch.finfo(torch.float32).min
        bias_global = torch.where(causal, 0.0, neg).to(torch.float32)[:, None, None]  # [B, 1, 1, S, T]
        bias_local = torch.where(window, 0.0, neg).to(torch.float32)[:, None, None]
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            cos, sin = rope["local" if self.sliding[i] else "global"]
            bias = bias_local if self.sliding[i] else bias_global
            x, k, v = layer(x, cos, sin, bias, past[2 * i], past[2 * i + 1], (b, s))
            presents += [k, v]
        last = _norm(x[:, -1, :], self.norm, d.rms_eps)
        return (last @ self.head, *presents)

    def empty_past(self, batch: int) -> list[torch.Tensor]:
        d = self.dims
        shape = (batch, d.num_kv_heads, 0, d.head_dim)
        return [torch.zeros(shape, dtype=torch.float32) for _ in range(2 * d.num_layers)]
