"""The weight-only int8 Triton GEMM (``miaohui.generation.w8a16``) checked on the CPU with Triton's interpreter: every
rows bucket (1, 5, 33, 64 rows), ragged N and K (masks), with and without bias, fp32 and fp16 activations, leading
dims, against ``F.linear`` with the dequantized weight. The interpreter must be switched on before Triton is imported,
so the check runs in a child process. (bf16 activations read back garbage under the interpreter, which has no bf16
arithmetic; on the GPU ``scripts/gpu/decode_quant_probe.py`` checks bf16 against the same reference.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from miaohui.generation.static_kv import quantize_int8
from miaohui.generation.w8a16 import w8a16_linear

CHECK = """
import torch
from torch.nn import functional as F
from miaohui.generation.static_kv import quantize_int8
from miaohui.generation.w8a16 import w8a16_linear

torch.manual_seed(0)
cases = [  # rows, N, K, bias, dtype, config
    ((1,), 48, 256, False, torch.float32, dict(BLOCK_N=16, BLOCK_K=128)),
    ((5,), 40, 200, True, torch.float32, dict(BLOCK_N=32, BLOCK_K=128)),
    ((33,), 64, 130, False, torch.float32, dict(BLOCK_N=64, BLOCK_K=256)),
    ((64,), 100, 384, True, torch.float32, dict(BLOCK_N=128, BLOCK_K=128, num_warps=8)),
    ((2, 3), 40, 200, True, torch.float16, dict(BLOCK_N=16, BLOCK_K=128)),
]
for lead, n, k, bias, dtype, cfg in cases:
    q, s = quantize_int8(torch.randn(n, k) * 0.02)
    s = s.to(dtype)
    x = torch.randn(*lead, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = w8a16_linear(x, q, s, b, config=cfg)
    want = F.linear(x.float(), q.float() * s.float()[:, None], None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (*lead, n), (got.dtype, got.shape)
    err = float((got.float() - want).abs().max())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert err < tol * max(1.0, float(want.abs().max())), (lead, n, k, dtype, err)
print("ok", len(cases))
"""


def test_kernel_matches_the_dequantized_linear_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok 5"


def test_triton_is_installed() -> None:
    """A dev dependency (pyproject ``[dev]``): without it the interpreter check above could not run."""
    from miaohui.generation import w8a16

    assert w8a16.available()


def test_bad_operands_are_named() -> None:
    q, s = quantize_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"need q int8 \[N, K\]"):
        w8a16_linear(torch.randn(2, 15), q, s)
    with pytest.raises(ValueError, match="need q int8"):
        w8a16_linear(torch.randn(2, 16), q.float(), s)
