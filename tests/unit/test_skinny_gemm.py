"""The encoder's few-row Triton GEMM (``miaohui.models.skinny_gemm``) checked on the CPU under Triton's interpreter:
split K or not, ragged M/N/K, bias, tanh GELU, leading dims, fp32 and fp16, against ``F.linear`` (+ ``F.gelu``
tanh). The interpreter must be on before Triton is imported, so the check runs in a child process."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

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
    assert run_interpreted(CHECK) == "ok 4"


def test_bad_operands_are_named() -> None:
    with pytest.raises(ValueError, match=r"need w \[N, K\] and x \[..., K\] of the same dtype"):
        skinny_linear(torch.randn(4, 15), torch.randn(8, 16), None, SKINNY_SWEEP[0])
    with pytest.raises(ValueError, match="same dtype"):
        skinny_linear(torch.randn(4, 16), torch.randn(8, 16).half(), None, SKINNY_SWEEP[0])


def test_skinny_layers_compile_and_stay_close_to_the_plain_model_on_the_cpu() -> None:
    """``use_skinny``: the four GEMMs go through ``miaohui::skinny_linear`` (on the CPU: ``F.linear`` with tanh GELU),
    which ``torch.compile(fullgraph=True)`` takes as one opaque op; logits within tanh-vs-erf GELU of the plain model."""
    from miaohui.models import fast_bert
    from miaohui.models.intent import IntentClassifier, random_bert

    enc = random_bert(hidden=64, layers=2, heads=4, vocab=1000, intermediate=256, seed=0)
    model = fast_bert.from_module(IntentClassifier(enc, 5).eval())
    ids = torch.randint(5, 1000, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.inference_mode():
        want = model(ids, mask)
        fast_bert.use_skinny(model)
        got = torch.compile(model, fullgraph=True, dynamic=False)(ids, mask)
    err = float((got - want).norm() / want.norm())
    assert 0 < err < 2e-3, err  # not 0: the skinny path's GELU is the tanh form


def test_table_from_sweep_keeps_only_the_products_that_beat_cublas() -> None:
    from miaohui.models.skinny_gemm import table_from_sweep

    report = {"best": [
        {"m": 128, "n": 2304, "k": 768, "config": [32, 64, 64, 1, 4], "us": 3.1, "cublas_us": 5.3},
        {"m": 512, "n": 2304, "k": 768, "config": [64, 128, 64, 1, 4], "us": 7.0, "cublas_us": 6.2},
    ]}  # fmt: skip
    assert table_from_sweep(report) == {(128, 2304, 768): (32, 64, 64, 1, 4)}


@pytest.mark.parametrize(("gelu", "pdl"), [(False, False), (True, False), (True, True)])
def test_kernels_compile_for_the_h200(gelu: bool, pdl: bool) -> None:
    """The tile kernel and the split-K reduction with and without the GELU epilogue, compiled down to a cubin for
    compute capability 9.0 on the CPU: with GELU both failed on the H200 in session 18 (the epilogue helper's type
    annotations read as globals by ``@jit``), which the interpreter tests above never saw. With ``PDL`` both begin
    with Hopper's grid-dependency instructions (and only then)."""
    from miaohui.models import skinny_gemm as sk

    tile = compile_for_h200(
        sk._skinny_kernel,
        ["*fp16", "*fp16", "*fp16", "*fp16", "*fp32", *["i32"] * 6],
        {"K_ITERS": 6, "SPLIT": 1, "HAS_BIAS": True, "GELU": gelu, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128,
         "PDL": pdl},
    )  # fmt: skip
    reduce = compile_for_h200(
        sk._skinny_reduce, ["*fp32", "*fp16", "*fp16", "i32", "i32", "i32"],
        {"SPLIT": 4, "HAS_BIAS": True, "GELU": gelu, "BLOCK": 1024, "PDL": pdl},
    )  # fmt: skip
    for kernel in (tile, reduce):
        ptx = kernel.asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) is pdl and ("griddepcontrol.launch_dependents" in ptx) is pdl


def test_pdl_probe_smoke_runs_on_the_cpu(tmp_path: Path) -> None:
    """``scripts/gpu/pdl_probe.py``'s CPU mode (one layer under Triton's interpreter, no timing, no PDL): the chain of
    skinny GEMMs gives cuBLAS's (here ``F.linear``'s) output, so a script error shows here, not in device time."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "src")}
    done = subprocess.run(
        [sys.executable, "pdl_probe.py", "--device", "cpu", "--out", str(tmp_path)],
        cwd=root / "scripts" / "gpu", env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "pdl_probe.json").read_text())["rows"]
    assert {(r["rows"], r["variant"]) for r in rows} == {
        (16, "cublas"),
        (16, "skinny"),
        (128, "cublas"),
        (128, "skinny"),
    }
    assert all(r["max_rel_err_vs_cublas"] < 1e-5 for r in rows)


def test_pdl_probe_takes_other_widths_with_a_sweeps_configurations(tmp_path: Path) -> None:
    """e5-small's widths (384 / 1536) with configurations from an ``encoder_gemm_sweep.py`` report (prepared for the
    H200, session 25): the chain runs and matches cuBLAS's output; other widths without ``--sweep`` are refused."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "src")}
    cfg = {16: [16, 32, 64, 1, 4], 128: [64, 64, 64, 2, 4]}
    sweep = {"best": [{"m": m, "gemm": g, "config": c} for m, c in cfg.items()
                      for g in ("qkv", "attn_out", "ffn_in", "ffn_out")]}  # fmt: skip
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    base = [sys.executable, "pdl_probe.py", "--device", "cpu", "--hidden", "384", "--inter", "1536"]
    run = functools.partial(subprocess.run, cwd=root / "scripts" / "gpu", env=env, capture_output=True, text=True)
    refused = run([*base, "--out", str(tmp_path)], timeout=120)
    assert refused.returncode != 0 and "--sweep" in refused.stderr
    done = run([*base, "--sweep", str(tmp_path / "sweep.json"), "--out", str(tmp_path)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "pdl_probe.json").read_text())
    assert (report["hidden"], report["intermediate"]) == (384, 1536)
    assert report["configs"]["128"]["ffn_out"] == cfg[128]
    assert len(report["rows"]) == 4 and all(r["max_rel_err_vs_cublas"] < 1e-5 for r in report["rows"])


@pytest.mark.slow
def test_encoder_variants_smoke_runs_the_new_variants_on_the_cpu(tmp_path: Path) -> None:
    """``scripts/gpu/encoder_variants.py``'s CPU mode (a tiny BERT, no timing) with the variants ``run_h200.sh s26b``
    and ``s26c`` measure (the skinny table from ``pdl_probe.py`` and Inductor's PDL switch set; the attention op):
    the compiled model's logits still the fp32 eager ones, so a script error shows here, not in device time."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run(
        [sys.executable, "scripts/gpu/encoder_variants.py", "--device", "cpu", "--tiny", "--variants",
         "static_skinny_pdl,static_triton_attn,static_skinny_ln_pdl_attn", "--shapes", "1x16", "--iters", "2", "--out", str(tmp_path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(128, 2304, 768)" in done.stdout  # the probe's table was installed
    rows = json.loads((tmp_path / "encoder_variants.json").read_text())["results"]
    assert [r["variant"] for r in rows] == ["static_skinny_pdl", "static_triton_attn", "static_skinny_ln_pdl_attn"]
    assert all("error" not in r and r["rel_err"] < 1e-4 for r in rows), rows
