"""The encoder's many-row persistent TMA GEMM (``miaohui.models.wide_gemm``) on the CPU: its arithmetic under Triton's
interpreter (tiles clipped at ragged M and N, several tiles per program, bias, tanh GELU, the halved epilogue store,
fp32 and fp16) against ``F.linear``, and the kernel compiled to an sm_90 cubin, where it must use the Hopper paths it
exists for (TMA loads, wgmma)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.models.wide_gemm import WIDE_SWEEP, table_from_sweep, wide_linear

CHECK = """
import torch
from torch.nn import functional as F
from miaohui.models.wide_gemm import wide_linear

torch.manual_seed(0)
cases = [  # x shape, N, bias, gelu, dtype, (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps, SUBTILE)
    ((64, 64), 48, True, False, torch.float32, (16, 16, 32, 2, 3, 4, 0)),  # 12 tiles over 4 programs
    ((2, 45, 96), 40, True, True, torch.float32, (32, 16, 32, 8, 3, 4, 1)),  # ragged M and N, GELU, halves
    ((33, 48), 72, False, False, torch.float16, (16, 32, 16, 1, 4, 8, 1)),  # fp16, no bias, K in 3 steps
]
for shape, n, bias, gelu, dtype, cfg in cases:
    k = shape[-1]
    x = torch.randn(*shape).to(dtype)
    w = (torch.randn(n, k) * 0.05).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = wide_linear(x, w, b, cfg, gelu=gelu)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    want = F.gelu(want, approximate="tanh") if gelu else want
    assert got.dtype == dtype and got.shape == (*shape[:-1], n), (got.dtype, got.shape)
    err = float((got.float() - want).abs().max())
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    assert err < tol * max(1.0, float(want.abs().max())), (shape, n, cfg, err)
print("ok", len(cases))
"""


def test_kernel_matches_linear_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok 3"


def test_bad_operands_are_named() -> None:
    cfg = WIDE_SWEEP[0]
    with pytest.raises(ValueError, match=r"need w \[N, K\] and x \[..., K\] of the same dtype"):
        wide_linear(torch.randn(4, 16), torch.randn(8, 16).half(), None, cfg)
    with pytest.raises(ValueError, match="K=12 and N=8 must give rows of a multiple of 16 bytes"):
        wide_linear(torch.randn(4, 12).half(), torch.randn(8, 12).half(), None, cfg)


def test_table_from_sweep_keeps_the_products_that_beat_cublas_by_the_margin() -> None:
    report = {"best": [
        {"m": 4096, "n": 2304, "k": 768, "config": [128, 256, 64, 8, 3, 8, 1], "us": 16.0, "cublas_us": 19.0},
        {"m": 4096, "n": 768, "k": 768, "config": [128, 128, 64, 8, 4, 8, 0], "us": 6.0, "cublas_us": 6.2},
        {"m": 4096, "n": 768, "k": 3072, "config": [128, 128, 64, 8, 4, 8, 0], "us": 27.0, "cublas_us": 26.0},
    ]}  # fmt: skip
    assert table_from_sweep(report, min_gain=0.05) == {(4096, 2304, 768): (128, 256, 64, 8, 3, 8, 1)}
    assert set(table_from_sweep(report)) == {(4096, 2304, 768), (4096, 768, 768)}


@pytest.mark.parametrize("cfg", [(128, 256, 64, 8, 3, 8, 1), (128, 128, 64, 8, 4, 4, 0)])
def test_kernel_compiles_for_the_h200_with_tma_and_wgmma(cfg: tuple[int, ...]) -> None:
    """Compiled down to a cubin for compute capability 9.0 on the CPU, with the GELU epilogue: the loads and stores
    must be TMA's bulk tensor copies and the products Hopper's wgmma, or the kernel has no reason to exist."""
    from miaohui.models import wide_gemm as wg

    bm, bn, bk, group, stages, warps, sub = cfg
    kernel = compile_for_h200(
        wg._wide_kernel,
        [f"tensordesc<fp16[{bm}, {bk}]>", f"tensordesc<fp16[{bn}, {bk}]>",
         f"tensordesc<fp16[{bm}, {bn // 2 if sub else bn}]>", "*fp16", "i32", "i32", "i32"],
        {"HAS_BIAS": True, "GELU": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group,
         "SUBTILE": bool(sub), "NUM_PROGRAMS": 132},
        options={"num_warps": warps, "num_stages": stages},
    )  # fmt: skip
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx


def test_sweep_smoke_runs_on_the_cpu(tmp_path: Path) -> None:
    """``scripts/gpu/wide_gemm_sweep.py``'s CPU mode (a layer's four GEMMs at 1/24 width under Triton's interpreter, no
    timing): each product's chosen configuration matches fp32, so a script error shows here, not in device time."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "src")}
    done = subprocess.run(
        [sys.executable, "wide_gemm_sweep.py", "--device", "cpu", "--out", str(tmp_path)],
        cwd=root / "scripts" / "gpu", env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "wide_gemm_sweep.json").read_text())
    assert [e["gemm"] for e in report["best"]] == ["qkv", "attn_out", "ffn_in", "ffn_out"]
    assert all(e["rel_err"] < 1e-4 for e in report["best"]), report["best"]
