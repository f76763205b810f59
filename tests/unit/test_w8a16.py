"""miaohui's one-row int8 kernel (``miaohui.generation.kernels.w8a16.w8_gemv``) checked on the CPU with Triton's interpreter
against ``F.linear`` with the dequantized weight: plain, with split K (ragged N and K, bias, fp16, leading dims), and
its fused forms (the RMS of x with the norm weight folded into the int8 weight; the residual in the epilogue, also
through the split-K reduce kernel). The interpreter must be switched on before Triton is imported, so the checks run
in one child process. (bf16 activations read back garbage under the interpreter, which has no bf16 arithmetic; on the
GPU ``tests/gpu/test_slot_engine_gpu.py`` runs the kernel in bf16.)"""

from __future__ import annotations

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.generation.kernels.int8_weights import quantize_int8
from miaohui.generation.kernels.w8a16 import GEMV_BEST, best_from_sweeps, gemv_config, w8_gemv, w8_gemv_fused_op

CHECK = """
import torch
from torch.nn import functional as F
from miaohui.generation.kernels.int8_weights import quantize_int8
from miaohui.generation.kernels.w8a16 import w8_gemv

torch.manual_seed(0)
plain = [  # x shape, N, K, bias, dtype, (BLOCK_N, BLOCK_K, SPLIT, warps)
    ((1, 200), 40, 200, True, torch.float32, (8, 64, 1, 4)),  # ragged K, bias, [1, K]
    ((1, 1, 96), 37, 96, True, torch.float16, (16, 32, 3, 4)),  # split 3, ragged N, bias, fp16, [1, 1, K]
    ((130,), 5, 130, False, torch.float32, (1, 64, 8, 2)),  # more slices than blocks of K: empty slices add 0
]
for shape, n, k, bias, dtype, cfg in plain:
    q, s = quantize_int8(torch.randn(n, k) * 0.02)
    s = s.to(dtype)
    x = torch.randn(*shape).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = w8_gemv(x, q, s, b, config=cfg)
    want = F.linear(x.float(), q.float() * s.float()[:, None], None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (*shape[:-1], n), (got.dtype, got.shape)
    err = float((got.float() - want).abs().max())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert err < tol * max(1.0, float(want.abs().max())), (shape, n, k, dtype, cfg, err)

fused = [  # K, N, bias, residual, rms, config (split > 1 with rms runs as split 1)
    (200, 40, True, False, True, (8, 64, 4, 4)),  # QKV-like: norm folded, bias, ragged K; the split is dropped
    (96, 37, False, True, False, (2, 64, 1, 4)),  # o/down-like: residual epilogue
    (160, 20, False, True, False, (1, 32, 4, 4)),  # residual through the split-K reduce kernel
]
for k, n, bias, res, rms, cfg in fused:
    norm = torch.rand(k) + 0.5
    w = torch.randn(n, k) * 0.02
    q, s = quantize_int8(w * norm[None, :] if rms else w)
    x = torch.randn(1, k) * 3
    b = torch.randn(n) if bias else None
    r = torch.randn(1, n) if res else None
    got = w8_gemv(x, q, s, b, config=cfg, residual=r, rms_eps=1e-6 if rms else None)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) if rms else x
    want = F.linear(h, q.float() * s[:, None], b)  # norm's weight inside q
    want = want + r if res else want
    err = float((got - want).abs().max())
    assert got.shape == (1, n) and err < 1e-5 * max(1.0, float(want.abs().max())), (k, n, cfg, err)
print("ok", len(plain), len(fused))
"""


def test_one_row_kernel_and_its_fused_forms_match_the_dequantized_linear_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok 3 3"


def test_triton_is_installed() -> None:
    """A dev dependency (pyproject ``[dev]``): without it the interpreter check above could not run."""
    from miaohui.generation.kernels import w8a16

    assert w8a16.available()


def test_one_row_kernel_refuses_more_rows_and_bad_operands() -> None:
    q, s = quantize_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"need one row x \[..., K\] \(1 row\)"):
        w8_gemv(torch.randn(2, 16), q, s)
    with pytest.raises(ValueError, match=r"need one row x \[..., K\] \(1 row\), q int8 \[N, K\]"):
        w8_gemv(torch.randn(1, 16), q.float(), s)


def test_gemv_configs_come_from_the_measured_table_else_the_nearest_class_of_n() -> None:
    assert gemv_config(1536, 8960) == GEMV_BEST[(1536, 8960)] == (1, 1024, 1, 4)
    assert gemv_config(576, 1536) == (1, 512, 1, 4)  # SmolLM2-sized: few outputs, one per program
    assert gemv_config(3072, 9000) == (1, 1024, 1, 4)  # long K: wider K blocks
    assert gemv_config(20000, 2048) == (8, 512, 1, 4)
    assert gemv_config(49152, 576) == (32, 256, 2, 8)  # a vocabulary


def test_best_from_sweeps_keeps_the_fastest_per_shape() -> None:
    def report(*entries: tuple[str, int, int, list[int], float]) -> dict[str, object]:
        return {"best": {name: {"n": n, "k": k, "config": cfg, "us": us} for name, n, k, cfg, us in entries}}

    first = report(("qkv", 2048, 1536, [1, 512, 1, 4], 3.4), ("down", 1536, 8960, [1, 1024, 1, 4], 7.5))
    wide = report(("qkv", 2048, 1536, [2, 2048, 1, 8], 3.8), ("down", 1536, 8960, [2, 2048, 1, 4], 7.1))
    assert best_from_sweeps([first, wide]) == {(2048, 1536): (1, 512, 1, 4), (1536, 8960): (2, 2048, 1, 4)}


def test_fused_op_on_the_cpu_computes_the_same_arithmetic() -> None:
    """The custom op's CPU path (what compiled CPU engines run) against the unfused reference."""
    torch.manual_seed(1)
    norm, w = torch.rand(64) + 0.5, torch.randn(24, 64) * 0.02
    q, s = quantize_int8(w * norm[None, :])
    x, b, r = torch.randn(1, 64), torch.randn(24), torch.randn(1, 24)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    want = r + torch.nn.functional.linear(h, q.float() * s[:, None] / norm[None, :], b)
    got = w8_gemv_fused_op(x, q, s, b, r, 1e-6)
    assert float((got - want).abs().max()) < 1e-5
    plain = w8_gemv_fused_op(x, q, s, None, None, 0.0)
    assert float((plain - torch.nn.functional.linear(x, q.float() * s[:, None])).abs().max()) < 1e-6


def test_residual_of_the_wrong_size_is_named() -> None:
    q, s = quantize_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"residual \(7,\) for 8 outputs: need N = 8 values"):
        w8_gemv(torch.randn(1, 16), q, s, residual=torch.randn(7))


@pytest.mark.parametrize("fused", [False, True])
def test_one_row_kernels_compile_for_the_h200(fused: bool) -> None:
    """``_gemv_kernel`` (plain with split K, and with the RMS and residual) and its split-K reduction, compiled down
    to a cubin for compute capability 9.0 on the CPU (``tests/triton_checks.py``)."""
    from miaohui.generation.kernels import w8a16

    flags = {"HAS_BIAS": not fused, "HAS_RES": fused}
    gemv = compile_for_h200(
        w8a16._gemv_kernel,
        ["*bf16", "*i8", "*bf16", "*bf16", "*bf16", "*bf16", "*fp32", "i32", "i32", "i32", "fp32"],
        {"K_ITERS": 3, "SPLIT": 1 if fused else 2, "RMS": fused, "BLOCK_N": 8, "BLOCK_K": 512, **flags},
        divisible=("N", "K"),
    )
    reduce = compile_for_h200(
        w8a16._gemv_reduce, ["*fp32", "*bf16", "*bf16", "*bf16", "*bf16", "i32"], {"SPLIT": 2, "BLOCK": 1024, **flags}
    )
    assert reduce
    assert "ld.global.v4.b32" in gemv.asm["ptx"]  # int8 weights 16 bytes per thread per load (8 rows × 512)
