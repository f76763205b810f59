"""The decoder's weights for decode steps: a plain model-dtype tensor, or an int8 copy tagged with the kernel that
reads it (``SlotEngineOptions.int8_kernel``), and the products that dispatch on that tag. The static-KV decoder
(:mod:`miaohui.generation.models.static_kv`) keeps the copies; its compiled layer functions call :func:`linear`,
:func:`norm_linear` and :func:`residual_linear`, which Dynamo traces through (the tag is the tuple's type)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from miaohui.errors import ConfigError
from miaohui.generation.kernels.w8_layer import interleave_glu, pair_halves
from miaohui.generation.kernels.w8a16 import w8_gemv_fused_op


class FusedGemvWeight(NamedTuple):
    """An int8 weight read by miaohui's one-row kernel (:func:`~miaohui.generation.kernels.w8a16.w8_gemv`) with the
    layer's neighbours folded in: for QKV and gate/up the preceding RMSNorm (its weight multiplied into the columns
    before quantization, the RMS taken inside the kernel), for O and down the residual add after them; the LM head's
    copy has neither."""

    q: torch.Tensor
    scale: torch.Tensor


class RopeGemvWeight(NamedTuple):
    """``int8_kernel: gemv_layer``'s QKV weight: :class:`FusedGemvWeight`'s RMSNorm fold, its rows (and bias) stored
    pair-wise per head (:func:`~miaohui.generation.kernels.w8_layer.pair_halves`) for the kernel that also applies RoPE
    and writes the key and value into the cache (:func:`~miaohui.generation.kernels.w8_layer.w8_gemv_rope`)."""

    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None


class GluGemvWeight(NamedTuple):
    """``int8_kernel: gemv_layer``'s gate/up weight: the RMSNorm fold, rows stored gate, up, gate, up…
    (:func:`~miaohui.generation.kernels.w8_layer.interleave_glu`) for the kernel whose epilogue writes
    ``silu(gate) · up``."""

    q: torch.Tensor
    scale: torch.Tensor


Weight = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | FusedGemvWeight | RopeGemvWeight | GluGemvWeight
"""A weight ``[out, in]`` in the model dtype, or int8 values with one scale per output row (weight-only int8, read by
one-row decode steps only): a plain tuple (``int8_kernel: inductor``), or tagged for one of miaohui's one-row kernels
(``gemv_layer``). :func:`linear` takes every kind but :class:`RopeGemvWeight` and :class:`GluGemvWeight`, which the
decoder hands to their own ops."""


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for every kind of :data:`Weight` but the two that have their own ops. A plain int8 tuple takes
    gpt-fast's form, ``F.linear(x, q.to(x.dtype)) * scale``: compiled with coordinate-descent tuning, Inductor turns it
    into one Triton reduction that reads the int8 bytes (``int8_kernel: inductor``). A :class:`FusedGemvWeight` goes
    to miaohui's one-row kernel (the custom op :func:`~miaohui.generation.kernels.w8a16.w8_gemv_fused_op`, no norm, no
    residual)."""
    if isinstance(w, FusedGemvWeight):
        return w8_gemv_fused_op(x, w.q, w.scale, bias, None, 0.0)
    if isinstance(w, tuple):
        out = F.linear(x, w[0].to(x.dtype)) * w[1]
        return out if bias is None else out + bias
    return F.linear(x, w, bias)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 of a ``[out, in]`` weight: (int8 values, scales in the weight's dtype)."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(w.dtype)


def norm_linear(x: torch.Tensor, norm: torch.Tensor, w: Weight, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``linear(RMSNorm(x), w, bias)``."""
    return linear(rms_norm(x, norm, eps), w, bias)


def residual_linear(x: torch.Tensor, h: torch.Tensor, w: Weight, *, addmm: bool = True) -> torch.Tensor:
    """``x + linear(h, w)``; a :class:`FusedGemvWeight` adds ``x`` in the kernel's epilogue.

    ``addmm=False``: the product is rounded to x's dtype, then added in fp32 (HF's arithmetic), so Inductor cannot
    make the sum cuBLAS's addmm with ``x`` as C. PyTorch's addmm first copies a full C into its output: one memcpy
    node per call in a CUDA graph. Unfused, the add goes into the kernel of the RMSNorm that follows (the attention's
    output projection)."""
    if isinstance(w, FusedGemvWeight):
        return w8_gemv_fused_op(h, w.q, w.scale, None, x, 0.0)
    if not addmm:
        return add_residual(x, linear(h, w))
    return x + linear(h, w)


def add_residual(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``x + delta`` in fp32, rounded to x's dtype once (what a bf16 add does). A layer that begins with it and then
    an RMSNorm gets both in one kernel: how the fused layers take the previous layer's MLP output (``carry``)."""
    return (x.float() + delta.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _fold(w: torch.Tensor, norm: torch.Tensor | None) -> FusedGemvWeight:
    """:class:`FusedGemvWeight` of ``w`` with the RMSNorm's weight multiplied in before rounding to int8."""
    q, scale = quantize_int8(w.float() if norm is None else w.float() * norm.float()[None, :])
    return FusedGemvWeight(q, scale.to(w.dtype))


def _pack(kernel: str, w: torch.Tensor, norm: torch.Tensor | None = None) -> Weight:
    return _fold(w, norm) if kernel == "gemv_layer" else quantize_int8(w)


def int8_layer(
    kernel: str,
    head_dim: int,
    qkv: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    in_norm: torch.Tensor,
    o: torch.Tensor,
    gate_up: torch.Tensor,
    post_norm: torch.Tensor,
    down: torch.Tensor,
) -> dict[str, Weight]:
    """One layer's int8 copies for ``int8_kernel`` ``kernel``: ``gemv_layer`` folds each RMSNorm's weight into the QKV
    and gate/up copies and reorders their rows for its kernels' RoPE and SwiGLU epilogues
    (:mod:`miaohui.generation.kernels.w8_layer`); ``inductor`` keeps plain (int8, scale) tuples."""
    if kernel not in ("inductor", "gemv_layer"):
        raise ConfigError(f"int8_kernel {kernel!r} is not one of 'inductor', 'gemv_layer'", "use one of those two")
    q_kv: Weight = _pack(kernel, qkv, in_norm)
    g_u: Weight = _pack(kernel, gate_up, post_norm)
    if kernel == "gemv_layer":
        bias = None if qkv_bias is None else pair_halves(qkv_bias, head_dim)
        q_kv = RopeGemvWeight(pair_halves(q_kv[0], head_dim), pair_halves(q_kv[1], head_dim), bias)
        g_u = GluGemvWeight(interleave_glu(g_u[0]), interleave_glu(g_u[1]))
    return {"qkv": q_kv, "o": _pack(kernel, o), "gate_up": g_u, "down": _pack(kernel, down)}


def int8_head(kernel: str, head: torch.Tensor) -> Weight:
    """The LM head's int8 copy (no norm folded in: the final RMSNorm runs before it)."""
    return _pack(kernel, head)
