"""The encoder's few-row Triton GEMM (``miaohui.models.skinny_gemm``) checked on the CPU under Triton's interpreter:
split K or not, ragged M/N/K, bias, tanh GELU, leading dims, fp32 and fp16, against ``F.linear`` (+ ``F.gelu``
tanh). The interpreter must be on before Triton is imported, so the check runs in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from miaohui.models.skinny_gemm import SKINNY_SWEEP, skinny_linear

CHECK = """
import torch
from torch.nn import functional as F
from miaohui.models.skinny_gemm import skinny_linear

torch.manual_seed(0)
cases = [  # x shape, N, bias, gelu, dtype, (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, warps)
    ((16, 64), 48, True, False, torch.float32, (16, 32, 32, 1, 4)),
    ((2, 9, 100), 40, True, True, torch.float32, (16, 32, 32, 2, 4)),  # ragged M, K; split; GELU in the reduce
    ((33, 96), 70, False, True, torch.float32, (32, 64, 32, 1, 4)),  # GELU in the tile's epilogue
    ((20, 300), 24, True, False, torch.float16, (16, 32, 64, 4, 4)),  # fp16, split 4 (one slice partly empty)
]
for shape, n, bias, gelu, dtype, cfg in cases:
    k = shape[-1]
    x = torch.randn(*shape).to(dtype)
    w = (torch.randn(n, k) * 0.05).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = skinny_linear(x, w, b, cfg, gelu=gelu)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    want = F.gelu(want, approximate="tanh") if gelu else want
    assert got.dtype == dtype and got.shape == (*shape[:-1], n), (got.dtype, got.shape)
    err = float((got.float() - want).abs().max())
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    assert err < tol * max(1.0, float(want.abs().max())), (shape, n, cfg, err)
print("ok", len(cases))
"""


def test_kernel_matches_linear_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok 4"


def test_bad_operands_are_named() -> None:
    with pytest.raises(ValueError, match=r"need w \[N, K\] and x \[..., K\] of the same dtype"):
        skinny_linear(torch.randn(4, 15), torch.randn(8, 16), None, SKINNY_SWEEP[0])
    with pytest.raises(ValueError, match="same dtype"):
        skinny_linear(torch.randn(4, 16), torch.randn(8, 16).half(), None, SKINNY_SWEEP[0])
