"""``int8_kernel: gemv_layer``'s kernels (``miaohui.generation.kernels.w8_layer``): the QKV product with RMSNorm, bias, RoPE
and the KV-cache write, and the gate/up product with SwiGLU, checked against the layer's own torch arithmetic
(:func:`~miaohui.generation.models.static_kv_layers.attn_in` and the MLP's ``silu(gate) · up``) under Triton's interpreter
(fp32), on the ops' CPU paths, and compiled for the H200."""

from __future__ import annotations

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.generation.kernels.int8_weights import quantize_int8
from miaohui.generation.kernels.w8_layer import (
    interleave_glu,
    pair_halves,
    unpair_halves,
    w8_gemv_glu,
    w8_gemv_glu_op,
    w8_gemv_rope,
    w8_gemv_rope_op,
)

# the reference: the unfused layer's arithmetic on the original (unpermuted) int8 weight
REFERENCE = """
import torch
from torch.nn import functional as F
from miaohui.generation.kernels.int8_weights import quantize_int8
from miaohui.generation.models.static_kv_layers import rope as _rope
from miaohui.generation.kernels.w8_layer import interleave_glu, pair_halves

def qkv_reference(x, q, s, b, pos, cos, sin, heads, kv_heads, d):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = F.linear(h, q.float() * s.float()[:, None], b).reshape(heads + 2 * kv_heads, d)
    c, sn = cos[pos][None], sin[pos][None]
    return _rope(y[:heads], c, sn), _rope(y[heads:heads + kv_heads], c, sn), y[heads + kv_heads:]

def glu_reference(x, q, s, rms):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) if rms else x
    gate, up = F.linear(h, q.float() * s.float()[:, None]).chunk(2, dim=-1)
    return F.silu(gate) * up

def tables(t, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.cat([torch.arange(t, dtype=torch.float64)[:, None] * inv[None]] * 2, dim=-1)
    return emb.cos().float(), emb.sin().float()
"""

CHECK = (
    REFERENCE
    + """
from miaohui.generation.kernels.w8_layer import w8_gemv_glu, w8_gemv_rope
torch.manual_seed(0)
cases = [  # heads, kv heads, D, K, bias, position, (BLOCK_N, BLOCK_K, SPLIT, warps)
    (4, 2, 16, 64, True, 5, (4, 32, 1, 4)),  # GQA, bias, K in two blocks
    (2, 1, 32, 100, False, 0, (2, 64, 1, 4)),  # ragged K, position 0, one pair per program
    (3, 3, 16, 48, True, 9, (3, 64, 1, 4)),  # odd BLOCK_N rounded up to 4; N not a multiple of the tile
]
for heads, kvh, d, k, bias, pos, cfg in cases:
    n = (heads + 2 * kvh) * d
    w = torch.randn(n, k) * 0.05
    q, s = quantize_int8(w)
    b = torch.randn(n) * 0.1 if bias else None
    x = torch.randn(1, k) * 2
    cos, sin = tables(16, d)
    kc, vc = torch.zeros(3, kvh, 16, d), torch.zeros(3, kvh, 16, d)
    got = w8_gemv_rope(x, pair_halves(q, d), pair_halves(s, d), None if b is None else pair_halves(b, d),
                       torch.tensor([pos]), cos, sin, kc, vc, heads, 1e-6, config=cfg)
    want_q, want_k, want_v = qkv_reference(x, q, s, b, pos, cos, sin, heads, kvh, d)
    assert got.shape == (1, heads, d), got.shape
    for name, a, e in (("q", got[0], want_q), ("k", kc[0, :, pos], want_k), ("v", vc[0, :, pos], want_v)):
        err = float((a - e).abs().max())
        assert err < 1e-5 * max(1.0, float(e.abs().max())), (heads, kvh, d, name, err)
    kc[0, :, pos] = 0
    vc[0, :, pos] = 0
    assert not kc.any() and not vc.any(), "wrote outside row 0 at the position"
rope_cases = len(cases)

cases = [  # intermediate, K, rms, (BLOCK_N, BLOCK_K, SPLIT, warps)
    (24, 64, True, (8, 32, 1, 4)),
    (21, 100, False, (4, 64, 1, 4)),  # ragged K, 42 rows not a multiple of the tile
    (5, 48, True, (2, 64, 1, 4)),  # one pair per program
]
for inter, k, rms, cfg in cases:
    q, s = quantize_int8(torch.randn(2 * inter, k) * 0.05)
    x = torch.randn(1, k) * 2
    got = w8_gemv_glu(x, interleave_glu(q), interleave_glu(s), 1e-6 if rms else None, config=cfg)
    want = glu_reference(x, q, s, rms)
    err = float((got - want).abs().max())
    assert got.shape == (1, inter) and err < 1e-5 * max(1.0, float(want.abs().max())), (inter, k, err)
print("ok", rope_cases, len(cases))
"""
)


def test_qkv_rope_and_glu_kernels_match_the_layer_under_the_interpreter() -> None:
    """Both kernels in one child process (one start of torch and Triton): the QKV kernel against the layer's
    RMSNorm → QKV → RoPE and its cache write (nothing written elsewhere), the gate/up kernel against
    ``silu(gate) · up``."""
    assert run_interpreted(CHECK) == "ok 3 3"


def test_pairing_is_undone_by_unpair() -> None:
    w = torch.arange(2 * 3 * 8 * 5).reshape(2 * 3 * 8, 5)  # 6 heads of D 8
    paired = pair_halves(w, 8)
    assert torch.equal(paired[:4, 0], torch.tensor([0, 4, 1, 5]) * 5)  # head 0: rows 0, 4, 1, 5, ...
    assert torch.equal(unpair_halves(paired.T, 8).T, w)
    assert torch.equal(interleave_glu(torch.arange(6)), torch.tensor([0, 3, 1, 4, 2, 5]))


def test_ops_on_the_cpu_match_the_layer_arithmetic() -> None:
    """The custom ops' torch paths (what CPU engines and the GPU tests' references run)."""
    from miaohui.generation.models.static_kv_layers import rope as _rope

    torch.manual_seed(2)
    heads, kvh, d, k = 4, 2, 16, 32
    n = (heads + 2 * kvh) * d
    norm = torch.rand(k) + 0.5
    q, s = quantize_int8(torch.randn(n, k) * 0.05 * norm[None, :])
    b = torch.randn(n) * 0.1
    x = torch.randn(1, k)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.cat([torch.arange(8, dtype=torch.float64)[:, None] * inv[None]] * 2, dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    kc, vc = torch.zeros(2, kvh, 8, d), torch.zeros(2, kvh, 8, d)
    got = w8_gemv_rope_op(x, pair_halves(q, d), pair_halves(s, d), pair_halves(b, d), torch.tensor([3]), cos, sin, kc,
                          vc, heads, 1e-6)  # fmt: skip
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = torch.nn.functional.linear(h, q.float() * s[:, None], b).reshape(heads + 2 * kvh, d)
    assert torch.allclose(got[0], _rope(y[:heads], cos[3], sin[3]), atol=1e-5)
    assert torch.allclose(kc[0, :, 3], _rope(y[heads : heads + kvh], cos[3], sin[3]), atol=1e-5)
    assert torch.allclose(vc[0, :, 3], y[heads + kvh :], atol=1e-6)
    qg, sg = quantize_int8(torch.randn(2 * 12, k) * 0.05)
    gate, up = torch.nn.functional.linear(x, qg.float() * sg[:, None]).chunk(2, dim=-1)
    got_glu = w8_gemv_glu_op(x, interleave_glu(qg), interleave_glu(sg), 0.0)
    assert torch.allclose(got_glu, torch.nn.functional.silu(gate) * up, atol=1e-6)


def test_bad_shapes_are_named() -> None:
    q, s = quantize_int8(torch.randn(8 * 16, 32))
    kc = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"N = \(heads \+ 2 · KV heads\) · D = 96"):
        w8_gemv_rope(torch.randn(1, 32), q, s, None, torch.tensor([0]), torch.ones(8, 16), torch.ones(8, 16), kc,
                     kc.clone(), 2, 1e-6)  # fmt: skip
    with pytest.raises(ValueError, match=r"need one row x \[\.\.\., K\], q int8 \[N, K\] with N even"):
        w8_gemv_glu(torch.randn(2, 32), q, s, None)


def test_kernels_compile_for_the_h200() -> None:
    """Both kernels (1.5B shapes: QKV 2,048 × 1,536 with bias, gate/up 17,920 × 1,536), compiled to a cubin for
    compute capability 9.0 with 16-byte int8 loads."""
    from miaohui.generation.kernels import w8_layer

    rope = compile_for_h200(
        w8_layer._gemv_rope_kernel,
        ["*bf16", "*i8", "*bf16", "*bf16", "*i64", "*fp32", "*fp32", "*bf16", "*bf16", "*bf16", "i32", "i32",
         "i32", "i32", "i32", "i32", "i32", "i32", "fp32"],
        {"HEADS": 12, "KV_HEADS": 2, "HALF": 64, "K_ITERS": 3, "HAS_BIAS": True, "RMS": True, "BLOCK_N": 4,
         "BLOCK_K": 512},
        divisible=("N", "K"),
    )  # fmt: skip
    glu = compile_for_h200(
        w8_layer._gemv_glu_kernel,
        ["*bf16", "*i8", "*bf16", "*bf16", "i32", "i32", "i32", "fp32"],
        {"K_ITERS": 3, "RMS": True, "BLOCK_N": 8, "BLOCK_K": 512},
        divisible=("N", "K"),
    )
    for kernel in (rope, glu):
        assert "ld.global.v4.b32" in kernel.asm["ptx"]


def test_tiles_hold_whole_pairs_in_a_power_of_two() -> None:
    from miaohui.generation.kernels.w8_layer import ROPE_BEST, _tile

    assert _tile(2048, 1536, None, ROPE_BEST) == (4, 512, 4)  # the measured QKV tile
    assert _tile(17920, 1536, None, {}) == (8, 512, 4)  # the one-row kernel's gate/up tile
    assert [_tile(64, 64, (b, 64, 1, 4), {})[0] for b in (1, 3, 5, 16)] == [2, 4, 8, 16]
