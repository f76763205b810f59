"""``int8_kernel: gemv_layer``'s kernels on CUDA in bf16 at the 1.5B shape's sizes, against their ops' torch form
computed on the CPU in fp32 from the same bf16 inputs (the CPU tests run the kernels in fp32 under the interpreter,
which has no bf16)."""

from __future__ import annotations

import pytest
import torch

from miaohui.generation.kernels.int8_weights import quantize_int8
from miaohui.generation.kernels.w8_layer import interleave_glu, pair_halves, w8_gemv_glu_op, w8_gemv_rope_op

pytestmark = pytest.mark.gpu


def _tables(t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.cat([torch.arange(t, dtype=torch.float64)[:, None] * inv[None]] * 2, dim=-1)
    return emb.cos().float(), emb.sin().float()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float()).norm() / want.float().norm())


def test_qkv_rope_kernel_matches_its_torch_form_in_bf16() -> None:
    torch.manual_seed(0)
    heads, kvh, d, k, pos = 12, 2, 128, 1536, 300
    n = (heads + 2 * kvh) * d
    q, s = quantize_int8(torch.randn(n, k) * 0.02)
    q, s, b = pair_halves(q, d), pair_halves(s, d).bfloat16(), pair_halves(torch.randn(n) * 0.1, d).bfloat16()
    x = (torch.randn(1, k) * 2).bfloat16()
    cos, sin = _tables(1024, d)
    positions = torch.tensor([pos])
    caches = [torch.zeros(4, kvh, 1024, d, dtype=torch.bfloat16) for _ in range(2)]
    want_caches = [c.float() for c in caches]
    want = w8_gemv_rope_op(x.float(), q, s.float(), b.float(), positions, cos, sin, *want_caches, heads, 1e-6)
    gpu_caches = [c.cuda() for c in caches]
    got = w8_gemv_rope_op(
        x.cuda(), q.cuda(), s.cuda(), b.cuda(), positions.cuda(), cos.cuda(), sin.cuda(), *gpu_caches, heads, 1e-6
    )
    torch.cuda.synchronize()
    assert _rel(got, want) < 1e-2, _rel(got, want)
    for mine, ref in zip(gpu_caches, want_caches, strict=True):
        assert _rel(mine[0, :, pos], ref[0, :, pos]) < 1e-2
        mine[0, :, pos] = 0
        assert not mine.any(), "the kernel wrote outside row 0 at the position"


def test_glu_kernel_matches_its_torch_form_in_bf16() -> None:
    torch.manual_seed(1)
    inter, k = 8960, 1536
    q, s = quantize_int8(torch.randn(2 * inter, k) * 0.02)
    q, s = interleave_glu(q), interleave_glu(s).bfloat16()
    x = (torch.randn(1, k) * 2).bfloat16()
    want = w8_gemv_glu_op(x.float(), q, s.float(), 1e-6)
    got = w8_gemv_glu_op(x.cuda(), q.cuda(), s.cuda(), 1e-6)
    torch.cuda.synchronize()
    assert got.shape == (1, inter) and got.dtype == torch.bfloat16
    assert _rel(got, want) < 1e-2, _rel(got, want)
