"""``miaohui.models.skinny_ln``: the LayerNorm after a split-K GEMM done by the kernel that sums its partials, and the
add + LayerNorm kernel of the unfused form. Under Triton's interpreter against torch (ragged rows, N not a power of
two, split 2, 3, 4 and 6, with and without bias, fp16, a row whose mean is far from zero), compiled for the H200 on the CPU,
and the op's CPU form; the engine's CUDA path runs in ``tests/gpu/test_encoder_kernels_gpu.py`` and
``test_gpu_kernels_gpu.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.models import skinny_gemm as sk
from miaohui.models import skinny_ln as sl

CHECK = """
import torch
import torch.nn.functional as F
from miaohui.models import skinny_gemm as sk, skinny_ln as sl

torch.manual_seed(0)
cases = [  # rows, K, N, config (split > 1), bias, dtype
    (128, 96, 64, (16, 32, 32, 2, 4), True, torch.float32),
    (40, 100, 80, (16, 32, 32, 4, 4), True, torch.float32),  # ragged rows and K, N not a power of two
    (16, 256, 128, (16, 32, 64, 4, 4), True, torch.float16),
    (24, 64, 48, (32, 16, 32, 2, 4), False, torch.float16),  # no bias; a row block wider than the rows
    (32, 192, 96, (16, 32, 32, 3, 4), True, torch.float16),  # split 3 (a tuning file's forced split)
    (8, 192, 64, (16, 32, 32, 6, 4), True, torch.float32),  # split 6, one BLOCK_K a slice
]
for m, k, n, cfg, bias, dtype in cases:
    x, w = torch.randn(m, k).to(dtype), (torch.randn(n, k) * k**-0.5).to(dtype)
    b = (torch.randn(n) * 0.1).to(dtype) if bias else None
    r, g, beta = (torch.randn(m, n) + 0.5).to(dtype), (1 + 0.1 * torch.randn(n)).to(dtype), (0.1 * torch.randn(n)).to(dtype)
    lin = F.linear(x.float(), w.float(), None if b is None else b.float())
    want = F.layer_norm(r.float() + lin, (n,), g.float(), beta.float(), 1e-12)
    got = sk.skinny_linear(x, w, b, cfg, residual_ln=(r, g, beta, 1e-12))
    assert got.dtype == dtype and got.shape == (m, n), (got.dtype, got.shape)
    err = float((got.float() - want).abs().max())
    assert err < (2e-4 if dtype == torch.float32 else 2e-2), (m, k, n, cfg, dtype, err)
# a row whose mean is far from zero (BERT's hidden states have such dimensions): the variance stays exact
x, r = torch.randn(16, 64) * 0.1, torch.randn(16, 64) * 0.1 + 40.0
got = sk.skinny_linear(x, torch.eye(64), None, (16, 16, 32, 2, 4), residual_ln=(r, torch.ones(64), torch.zeros(64), 1e-12))
assert float((got - F.layer_norm(x + r, (64,), eps=1e-12)).abs().max()) < 1e-3
# the add + LayerNorm kernel of the unfused form, several rows a program and a ragged last program
a, r = torch.randn(37, 80), torch.randn(37, 80)
got = torch.empty(37, 80)
sl._add_ln_kernel[(5,)](a, r, torch.ones(80) * 2, torch.ones(80), got, 37, 80, 80, 80, 80, 1e-5, ROWS=8, BLOCK_N=128,
                        PDL=False)
assert float((got - F.layer_norm(a + r, (80,), torch.ones(80) * 2, torch.ones(80), 1e-5)).abs().max()) < 1e-4
print("ok", len(cases) + 2)
"""


def test_kernels_match_torch_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok 8"


def test_kernels_compile_for_the_h200() -> None:
    """The reduce + LayerNorm and the add + LayerNorm kernels down to sm_90 cubins at BERT-base's width, with PDL."""
    reduce_ln = compile_for_h200(
        sk._skinny_reduce_ln, [*["*fp32"], *["*fp16"] * 5, *["i32"] * 4, "fp32"],
        {"SPLIT": 4, "HAS_BIAS": True, "ROWS": 1, "BLOCK_N": 1024, "PDL": True}, divisible=("N",),
    )  # fmt: skip
    add_ln = compile_for_h200(
        sl._add_ln_kernel, [*["*fp16"] * 5, *["i32"] * 5, "fp32"], {"ROWS": 4, "BLOCK_N": 1024, "PDL": True},
        divisible=("N",),
    )  # fmt: skip
    for kernel in (reduce_ln, add_ln):
        ptx = kernel.asm["ptx"]
        assert "griddepcontrol.wait" in ptx and "st.global" in ptx


def test_op_on_the_cpu_is_the_unfused_form() -> None:
    """Off CUDA the op is its three parts (``skinny_linear``'s CPU form: ``F.linear``, tanh GELU)."""
    gen = torch.Generator().manual_seed(0)
    x, w1, b1 = torch.randn(2, 8, 64, generator=gen), torch.randn(32, 64, generator=gen) * 0.125, torch.randn(32)
    r, g, beta = torch.randn(2, 8, 32, generator=gen), torch.rand(32, generator=gen) + 0.5, torch.randn(32)
    w2, b2 = torch.randn(48, 32, generator=gen) * 0.2, torch.randn(48)
    y, h = sl.proj_ln_proj(x, w1, b1, r, g, beta, 1e-12, w2, b2, True)
    h_want = F.layer_norm(r + F.linear(x, w1, b1), (32,), g, beta, 1e-12)
    assert torch.equal(h, h_want)
    assert torch.equal(y, F.gelu(F.linear(h_want, w2, b2), approximate="tanh"))


def test_fused_only_where_the_table_splits_the_first_product(monkeypatch: pytest.MonkeyPatch) -> None:
    w1 = torch.empty(768, 3072)
    monkeypatch.setattr(
        sk, "SKINNY_BEST", {(128, 768, 3072): (64, 32, 128, 4, 4), (16, 768, 3072): (16, 32, 128, 1, 4)}
    )
    assert sl.fused_config(128, w1) == (64, 32, 128, 4, 4)
    assert sl.fused_config(16, w1) is None  # no split: no reduce to do the LayerNorm
    assert sl.fused_config(256, w1) is None  # not in the table
    # a forced split for the fused form (a tuning file's ln_split) wins over the plain product's entry
    monkeypatch.setattr(sl, "LN_SPLIT_BEST", {(16, 768, 3072): (16, 32, 64, 6, 4)})
    assert sl.fused_config(16, w1) == (16, 32, 64, 6, 4)
    assert sl.fused_config(128, w1) == (64, 32, 128, 4, 4)


def test_bad_operands_are_named() -> None:
    if sk.triton is None:
        pytest.skip("needs Triton (CUDA builds of torch)")
    x, w, r = torch.randn(2, 8, 64), torch.randn(32, 64), torch.randn(2, 8, 32)
    with pytest.raises(ValueError, match=r"needs a config that splits K and no GELU, not \(16, 32, 64, 1, 4\)"):
        sk.skinny_linear(x, w, None, (16, 32, 64, 1, 4), residual_ln=(r, torch.ones(32), torch.zeros(32), 1e-5))
    with pytest.raises(ValueError, match=r"residual \(2, 8, 31\), gamma \(32,\), beta \(32,\): need \(2, 8, 32\)"):
        sk.skinny_linear(
            x, w, None, (16, 32, 64, 2, 4), residual_ln=(r[..., :31], torch.ones(32), torch.zeros(32), 1e-5)
        )


def test_exported_stack_has_one_op_per_inner_layer_norm() -> None:
    """``use_kernels(skinny=True)`` on a 3-layer FastBert, exported with dynamic sizes as the engine does: the five inner
    LayerNorms are ``proj_ln_proj`` calls; only the embeddings' and the last one stay LayerNorms."""
    from miaohui.models import fast_bert
    from miaohui.models.intent import IntentClassifier, random_bert

    enc = random_bert(hidden=64, layers=3, heads=4, vocab=500, intermediate=128, seed=0)
    model = fast_bert.use_kernels(fast_bert.from_module(IntentClassifier(enc, 24).eval()), skinny=True, attention=False)
    ids, mask = torch.randint(5, 500, (2, 12)), torch.ones(2, 12, dtype=torch.int64)
    dims = {0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("sequence", max=64)}
    with torch.no_grad():
        ep = torch.export.export(model, (ids, mask), dynamic_shapes=(dims, dims))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("miaohui.proj_ln_proj.default") == 5
    assert sum("layer_norm" in t for t in targets) == 2
    assert torch.equal(ep.module()(ids, mask), model(ids, mask))
