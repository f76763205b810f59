"""Mixed steps: a decode step and new prompts' tokens as one batch of rows (``SlotEngineOptions.mixed_prefill_tokens``).

A separate prefill reads every weight once more for a handful of prompts: one short prompt's prefill takes about as
long as a 64-row decode step on a GPU, because both are bound by reading the weights, while the two as one mixed step
take little more than the decode step alone. Here the prompts' tokens become extra rows of the decode step —
vLLM's chunked-prefill / Sarathi idea on a static cache: every row is one token with a position and a cache row, so

* the GEMMs, norms and MLP run once over ``decode rows + prompt tokens``;
* each row writes its key/value at ``(cache_rows[r], positions[r])``; a decode row then attends in its cache row up
  to its position (the decode kernel, :func:`~miaohui.generation.kernels.decode_attention.decode_attention`), and a
  prompt's tokens attend causally to the prompt's tokens, whose keys the layer has just written
  (:mod:`~miaohui.generation.kernels.prompt_attention`): one op, :func:`mixed_attention_op`;
* the LM head runs on the rows named by ``out_rows`` only (each decode row and each prompt's last token).

Padding rows (decode rows of slots that hold no sequence, prompt rows past the prompts' tokens) write into the
cache's scratch row (:attr:`StaticKVDecoder.scratch_row`), never into a slot: a slot prefilled in this step is also
a padding row of its decode half.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from miaohui.generation.kernels.decode_attention import decode_attention
from miaohui.generation.kernels.int8_weights import Weight, add_residual, residual_linear
from miaohui.generation.kernels.prompt_attention import prompt_attention
from miaohui.generation.models.constants import with_constants
from miaohui.generation.models.static_kv import StaticKVDecoder, _Layer
from miaohui.generation.models.static_kv_layers import Carry, attn_in, mlp_block


@torch.library.custom_op("miaohui::mixed_attention", mutates_args=())
def mixed_attention_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    decode_rows: int,
) -> torch.Tensor:
    """A mixed step's attention, rows ``q`` [R, H, D], each row's key and value already at ``(cache_rows[r],
    positions[r])`` of ``keys``/``values`` [S, KVH, T, D]: the first ``decode_rows`` attend in their cache rows up to
    their positions; the rest are packed prompts (positions from 0 per prompt) attending within their prompt."""
    out = torch.empty_like(q)
    b = decode_rows
    decode_attention(q[:b], keys, values, positions[:b], cache_rows[:b], out[:b])
    prompt_attention(q[b:], keys, values, positions[b:], cache_rows[b:], out[b:])
    return out


@mixed_attention_op.register_fake
def _mixed_attention_fake(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    decode_rows: int,
) -> torch.Tensor:
    return torch.empty_like(q)


def mixed_layer(
    x: torch.Tensor,
    delta: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,
    positions: torch.Tensor,
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
    decode_rows: int,
    *,
    heads: int,
) -> Carry:
    """One layer over rows ``x + delta`` [R, hidden] (the residual stream and the previous layer's MLP output, as the
    fused decode layer takes them), row r at ``positions[r]`` of cache row ``cache_rows[r]``: RMSNorm → QKV →
    RoPE, the keys/values written (``index_put_`` into the cache passed in, as the fused decode layer does), the
    attention (:func:`mixed_attention_op`: the first ``decode_rows`` over their cache row's first ``kv_len``
    positions up to their own, the prompt rows within their prompt), then O, residual and MLP, whose output it
    returns unadded (``mlp_block``'s ``carry``). A pure function of its tensors (the cache writes aside), so one
    compiled graph serves every layer."""
    rows, kv_heads = x.shape[0], k_cache.shape[1]
    x = add_residual(x, delta)
    q, k, v = attn_in(x, in_norm, qkv, qkv_bias, cos, sin, eps, heads, kv_heads)
    k_cache[cache_rows, :, positions] = k  # [R, KVH, D] at (cache row, every head, position)
    v_cache[cache_rows, :, positions] = v
    keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
    attn = mixed_attention_op(q, keys, values, positions, cache_rows, decode_rows)
    return mlp_block(residual_linear(x, attn.reshape(rows, -1), o, addmm=False), post_norm, gate_up, down, eps, True)


def use_compiled(model: StaticKVDecoder, compile_fn: Any) -> None:
    """Run ``model``'s mixed steps through ``compile_fn(mixed_layer)`` (as :meth:`StaticKVDecoder.use_compiled`)."""
    model._mixed_layer = compile_fn(with_constants(mixed_layer, heads=model.dims.num_heads))


def mixed_forward(
    model: StaticKVDecoder,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    out_rows: torch.Tensor,
    kv_len: int,
    decode_rows: int,
) -> torch.Tensor:
    """Rows ``tokens``/``positions``/``cache_rows`` [R] (int64) through every layer; fp32 logits [len(out_rows),
    vocab] of the rows ``out_rows``. The first ``decode_rows`` are decode rows; ``kv_len``: the cache positions they
    attend (above each one's position). The other rows are packed prompts, each from position 0."""
    d = model.dims
    run = model._mixed_layer or with_constants(mixed_layer, heads=d.num_heads)
    x = F.embedding(tokens, model.embed)  # [R, hidden]
    cos = model.cos_table[positions][:, None, :]  # [R, 1, D]
    sin = model.sin_table[positions][:, None, :]
    weights, head = model._decode_weights(tokens.shape[0])
    delta = torch.zeros_like(x)  # the last layer's MLP output, added by the next one
    for i, (layer, (qkv, o, gate_up, down)) in enumerate(zip(model.layers, weights, strict=True)):
        assert isinstance(layer, _Layer)
        x, delta = run(
            x, delta, model.k_cache[i], model.v_cache[i], cache_rows, positions, layer.in_norm, qkv, layer.qkv_bias,
            cos, sin, o, layer.post_norm, gate_up, down, d.rms_eps, kv_len, decode_rows,
        )  # fmt: skip
    return model._final(add_residual(x, delta).index_select(0, out_rows), model.norm, head, d.rms_eps)
