"""The static-KV decoder's layer functions: pure functions of their tensors (weights are arguments), so one compiled
graph serves every layer of :class:`~miaohui.generation.models.static_kv.StaticKVDecoder`.

* :func:`attn_in` — RMSNorm → fused QKV → RoPE (decode and prefill);
* :func:`make_decode_layer` — a whole decode layer, cache write included, around a decode attention
  (:data:`DECODE_ATTENTION`: ``matmul``, the reference, or ``triton``, miaohui's split-KV kernels);
* :func:`prefix_attention` — a prefix hit's rest over its slot (miaohui's prefix kernel on a GPU, SDPA elsewhere);
* :func:`attn_proj_mlp` — prefill's second half after SDPA;
* :func:`mlp_block` — the residual SwiGLU MLP, optionally handing its output to the next layer (:data:`Carry`);
* :func:`final_logits` — final RMSNorm and LM head.

Numerics follow HF: RMSNorm, RoPE and softmax in fp32, weights and cache in the model dtype.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
from torch.nn import functional as F

from miaohui.generation.kernels.decode_attention import decode_attention_op
from miaohui.generation.kernels.decode_attention import supported as prefix_kernel_supported
from miaohui.generation.kernels.int8_weights import (
    GluGemvWeight,
    Weight,
    add_residual,
    linear,
    norm_linear,
    residual_linear,
    rms_norm,
)
from miaohui.generation.kernels.prefix_attention import triton_prefix_attention
from miaohui.generation.kernels.w8_layer import w8_gemv_glu_op


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (HF's rotate_half convention) computed in fp32; ``cos``/``sin`` broadcast to x."""
    h = x.float()
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos + rotated * sin).to(x.dtype)


def attn_in(
    x: torch.Tensor,
    norm: torch.Tensor,
    qkv: Weight,
    qkv_bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First half of a layer: RMSNorm → fused QKV → RoPE. ``x`` [..., hidden] → q [..., H, D], k and v
    [..., KVH, D] (decode: ``[b]``, prefill: ``[n, S]`` leading dims; ``cos``/``sin`` broadcast to them). A pure
    function of its tensors, so one compiled graph serves every layer."""
    lead = x.shape[:-1]
    out = norm_linear(x, norm, qkv, qkv_bias, eps)
    d = out.shape[-1] // (heads + 2 * kv_heads)
    q = rope(out[..., : heads * d].reshape(*lead, heads, d), cos, sin)
    k = rope(out[..., heads * d : (heads + kv_heads) * d].reshape(*lead, kv_heads, d), cos, sin)
    v = out[..., (heads + kv_heads) * d :].reshape(*lead, kv_heads, d).contiguous()
    return q, k, v


Carry = tuple[torch.Tensor, torch.Tensor]
"""A layer's output as (residual stream, MLP output not yet added): the fused layers' ``carry`` form."""


def attn_out_mlp(
    x: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    o: Weight,
    post_norm: torch.Tensor,
    gate_up: Weight,
    down: Weight,
    eps: float,
    carry: bool = False,
) -> torch.Tensor | Carry:
    """Decode, second half of a layer: grouped-query attention of q [b, H, D] over the cache view
    ``keys``/``values`` [b, KVH, T, D] (``bias`` [b, 1, 1, T] masks slots past each row's position),
    output projection, residual, RMSNorm, SwiGLU MLP, residual."""
    b, heads, d = q.shape
    kv_heads = keys.shape[1]
    q4 = q.view(b, kv_heads, heads // kv_heads, d)
    scores = torch.matmul(q4, keys.transpose(-1, -2)).float() * (d**-0.5) + bias  # [b, KVH, G, T]
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    attn = torch.matmul(probs, values).reshape(b, heads * d)
    return mlp_block(residual_linear(x, attn, o, addmm=False), post_norm, gate_up, down, eps, carry)


@overload
def mlp_block(
    x: torch.Tensor, post_norm: torch.Tensor, gate_up: Weight, down: Weight, eps: float, carry: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def mlp_block(
    x: torch.Tensor, post_norm: torch.Tensor, gate_up: Weight, down: Weight, eps: float, carry: Literal[True]
) -> Carry: ...
@overload
def mlp_block(
    x: torch.Tensor, post_norm: torch.Tensor, gate_up: Weight, down: Weight, eps: float, carry: bool
) -> torch.Tensor | Carry: ...
def mlp_block(
    x: torch.Tensor, post_norm: torch.Tensor, gate_up: Weight, down: Weight, eps: float, carry: bool = False
) -> torch.Tensor | Carry:
    """Residual SwiGLU MLP: ``x + down(silu(gate) * up)`` of the RMS-normed ``x``.

    ``carry``: ``(x, down(...))`` instead, for the next layer to add (:func:`add_residual`) in its first kernel.
    Added here, the sum is cuBLAS's addmm with ``x`` as C, which PyTorch begins with a copy of ``x`` into its output:
    one memcpy node per layer in a CUDA graph."""
    if isinstance(gate_up, GluGemvWeight):
        h = w8_gemv_glu_op(x, gate_up.q, gate_up.scale, eps)
    else:
        gate, up = norm_linear(x, post_norm, gate_up, None, eps).chunk(2, dim=-1)
        h = F.silu(gate) * up
    if not carry:
        return residual_linear(x, h, down)
    return x, linear(h, down)  # a FusedGemvWeight's kernel without the residual it would add in its epilogue


def attn_proj_mlp(
    x: torch.Tensor,
    attn: torch.Tensor,
    o: Weight,
    post_norm: torch.Tensor,
    gate_up: Weight,
    down: Weight,
    eps: float,
) -> torch.Tensor:
    """Prefill, second half of a layer after attention: output projection of ``attn`` [n, H, S, D] (SDPA's
    layout), residual, RMSNorm, SwiGLU MLP, residual; ``x`` [n, S, hidden]."""
    n, heads, s, d = attn.shape
    h = attn.transpose(1, 2).reshape(n, s, heads * d)
    return mlp_block(residual_linear(x, h, o, addmm=False), post_norm, gate_up, down, eps)


def prefix_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    kv_len: int,
    kernel: bool | None = None,
) -> torch.Tensor:
    """Attention of a prefix hit's rest: ``q`` [n, S, H, D], token (i, s) at ``positions[i, s]`` of cache row
    ``rows[i, s]`` (both [n, S], contiguous), over that row of the layer's cache ``keys`` / ``values``
    [rows, KVH, max_len, D] up to its own position → [n, H, S, D].

    ``kernel`` (default: on CUDA where the kernel takes the head size): miaohui's split-KV prefix kernel
    (:mod:`~miaohui.generation.kernels.prefix_attention`: blocks of tokens read the row only up to their positions,
    the history spread over every SM). Else (the CPU; the reference) SDPA over the rows' first ``kv_len`` positions
    with a boolean mask. On a GPU the SDPA form was a fixed ~5 ms per hit at the 1.5B shape (H100): with GQA and a
    mask SDPA runs its math form, and folded per KV head it keeps a few programs busy over all ``kv_len``
    positions."""
    n, s, heads, d = q.shape
    if kernel is None:
        kernel = q.is_cuda and prefix_kernel_supported(q, keys)
    if kernel:
        return triton_prefix_attention(q, keys, values, positions, rows).view(n, s, heads, d).transpose(1, 2)
    allowed = torch.arange(kv_len, device=q.device)[None, None, :] <= positions[:, :, None]  # [n, S, T]
    slots = rows[:, 0]
    return F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys[slots, :, :kv_len],
        values[slots, :, :kv_len],
        attn_mask=allowed[:, None],
        enable_gqa=heads != keys.shape[1],
    )


def attn_out_mlp_triton(
    x: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    o: Weight,
    post_norm: torch.Tensor,
    gate_up: Weight,
    down: Weight,
    eps: float,
    carry: bool = False,
) -> torch.Tensor | Carry:
    """:func:`attn_out_mlp` with the attention as miaohui's split-KV decode kernels
    (:mod:`miaohui.generation.kernels.decode_attention`, a custom op: two Triton kernels that read each row's cache
    only up to its position), masked by ``positions`` [b] rather than an additive mask."""
    b, heads, d = q.shape
    attn = decode_attention_op(q, keys, values, positions).reshape(b, heads * d)
    return mlp_block(residual_linear(x, attn, o, addmm=False), post_norm, gate_up, down, eps, carry)


DECODE_ATTENTION: dict[str, Any] = {"matmul": attn_out_mlp, "triton": attn_out_mlp_triton}
"""Decode's second layer half by attention kernel (``SlotEngineOptions.decode_attention``); the last-but-one
argument is the additive mask [b, 1, 1, T] for ``matmul`` and the positions [b] for ``triton``."""


def make_decode_layer(attend: Any) -> Any:
    """A whole decode layer as one function, compiled into one graph: :func:`attn_in`, the new keys/values written
    into the cache, then ``attend`` (a :data:`DECODE_ATTENTION` half). The write is ``cache[rows, :, positions] = k``
    (``index_put_`` on the cache passed in, gpt-fast's KV update): Inductor turns the functional scatter back into an
    in-place store fused into the RoPE kernel, so the cache write costs no launch of its own. (A write through a
    *view* of the cache, ``index_copy_`` on ``cache.view(-1, D)``, makes a compiled graph copy the whole cache.)

    The layer takes the residual stream and the previous layer's MLP output (``x``, ``delta``: zeros for the first)
    and returns the pair for the next (:data:`Carry`, ``mlp_block``'s ``carry``): the sum happens in its first
    RMSNorm's kernel instead of as an addmm, whose copy of ``x`` would be a memcpy node per layer."""

    def decode_layer(
        x: torch.Tensor,
        delta: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        in_norm: torch.Tensor,
        qkv: Weight,
        qkv_bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        o: Weight,
        post_norm: torch.Tensor,
        gate_up: Weight,
        down: Weight,
        eps: float,
        kv_len: int,
        *,
        heads: int,
    ) -> Carry:
        b, kv_heads = x.shape[0], k_cache.shape[1]
        x = add_residual(x, delta)  # the previous layer's MLP output (its carry), in the RMSNorm's kernel
        q, k, v = attn_in(x, in_norm, qkv, qkv_bias, cos, sin, eps, heads, kv_heads)
        k_cache[rows, :, positions] = k  # [b, KVH, D] at (row, every head, position)
        v_cache[rows, :, positions] = v
        keys, values = k_cache[:b, :, :kv_len], v_cache[:b, :, :kv_len]
        return attend(x, q, keys, values, mask, o, post_norm, gate_up, down, eps, carry=True)

    return decode_layer


def final_logits(x: torch.Tensor, norm: torch.Tensor, head: Weight, eps: float) -> torch.Tensor:
    return linear(rms_norm(x, norm, eps), head).float()
