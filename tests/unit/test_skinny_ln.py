"""``miaohui.models.skinny_ln``: GEMM + bias + residual + LayerNorm in one kernel. Under Triton's interpreter (which runs
the programs one after another, so the last program of a row block does the fix-up) against the unfused torch form,
twice in a row on the same counters (each call must leave them at zero); compiled for the H200 on the CPU; the op's
CPU path (FastBert with the switch on: ``test_fast_bert_switches.py``). How the programs order their writes on a real
GPU is a GPU test's job (``tests/gpu/test_skinny_ln_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.models import skinny_ln as sl

CHECK = """
import torch
import torch.nn.functional as F
from miaohui.models import skinny_ln as sl

torch.manual_seed(0)
cases = [  # rows, N, K, config (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, warps), dtype
    (128, 96, 64, (16, 32, 32, 1, 4), torch.float32),   # whole row blocks, three column tiles, no split
    (40, 80, 96, (16, 32, 32, 3, 4), torch.float32),    # rows and N not multiples of the tiles; K split in 3
    (16, 64, 128, (16, 64, 64, 2, 4), torch.float16),   # one column tile, fp16
    (24, 48, 32, (32, 16, 32, 1, 4), torch.float16),    # a row block wider than the rows; LN_ROWS chunks past M
]
for m, n, k, cfg, dtype in cases:
    x, w = torch.randn(m, k).to(dtype), (torch.randn(n, k) * k**-0.5).to(dtype)
    b, res = (torch.randn(n) * 0.1).to(dtype), torch.randn(m, n).to(dtype)
    g, beta = (1 + 0.1 * torch.randn(n)).to(dtype), (0.1 * torch.randn(n)).to(dtype)
    want = F.layer_norm(res.float() + F.linear(x.float(), w.float(), b.float()), (n,), g.float(), beta.float(), 1e-12)
    for call in range(2):  # the counters must be back at zero after each call
        got = sl.skinny_linear_ln(x, w, b, res, g, beta, 1e-12, cfg)
        assert got.dtype == dtype and got.shape == (m, n), (got.dtype, got.shape)
        err = float((got.float() - want).abs().max())
        assert err < (2e-4 if dtype == torch.float32 else 2e-2), (m, n, k, cfg, dtype, call, err)
    assert int(sl._counters[x.device].abs().sum()) == 0
# leading dims are kept: [B, S, K] in, [B, S, N] out
x, w, b = torch.randn(2, 8, 64), torch.randn(32, 64) * 0.125, torch.zeros(32)
res, g, beta = torch.randn(2, 8, 32), torch.ones(32), torch.zeros(32)
got = sl.skinny_linear_ln(x, w, b, res, g, beta, 1e-5, (16, 32, 64, 1, 4))
assert got.shape == (2, 8, 32)
assert float((got - F.layer_norm(res + F.linear(x, w, b), (32,), g, beta, 1e-5)).abs().max()) < 2e-4
print("ok", len(cases) + 1)
"""


def test_kernel_matches_the_unfused_form_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok 5"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("config", [(16, 32, 128, 1, 4), (16, 32, 128, 4, 4)])
def test_kernel_compiles_for_the_h200(dtype: str, config: tuple[int, int, int, int, int]) -> None:
    """Triton's whole pipeline down to a cubin for compute capability 9.0, on the CPU: BERT-base's attention-output
    shape (N = 768), without and with split K, and with PDL."""
    bm, bn, bk, split, _ = config
    ptr = f"*{dtype}"
    for pdl in (False, True):
        kernel = compile_for_h200(
            sl._skinny_ln_kernel,
            [ptr, ptr, ptr, ptr, ptr, ptr, ptr, "*fp32", "*i32", "i32", "i32", "i32", *["i32"] * 4, "fp32"],
            {
                "K_ITERS": 768 // split // bk,
                "SPLIT": split,
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "N_POW2": 1024,
                "LN_ROWS": sl.LN_ROWS,
                "PDL": pdl,
            },
            divisible=("M", "N", "K"),
        )
        ptx = kernel.asm["ptx"]
        assert "atom" in ptx and ("griddepcontrol.wait" in ptx) == pdl


def test_op_on_the_cpu_is_the_unfused_form() -> None:
    x, w, b = torch.randn(2, 8, 64), torch.randn(32, 64) * 0.125, torch.randn(32)
    res, g, beta = torch.randn(2, 8, 32), torch.rand(32) + 0.5, torch.randn(32)
    want = torch.nn.functional.layer_norm(res + torch.nn.functional.linear(x, w, b), (32,), g, beta, 1e-12)
    assert torch.equal(sl.skinny_ln_op(x, w, b, res, g, beta, 1e-12), want)


def test_mismatched_inputs_are_refused_with_their_shapes() -> None:
    if sl.triton is None:
        pytest.skip("needs Triton (CUDA builds of torch)")
    with pytest.raises(ValueError, match=r"residual \(2, 8, 31\)"):
        sl.skinny_linear_ln(
            torch.randn(2, 8, 64), torch.randn(32, 64), torch.zeros(32), torch.randn(2, 8, 31), torch.ones(32),
            torch.zeros(32), 1e-5, (16, 32, 64, 1, 4),
        )  # fmt: skip
