"""``miaohui.models.skinny_ln``: the LayerNorm between two GEMMs folded into them (the residual in the first GEMM's
epilogue, the LayerNorm in the second's prologue). Under Triton's interpreter against the unfused torch form (ragged
rows and K, split K in the first GEMM, GELU, fp16), compiled for the H200 on the CPU, and the op's CPU form; the
engine's CUDA path runs in ``tests/gpu/test_gpu_kernels_gpu.py``."""

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
cases = [  # rows, hidden (K of the second product), N of the second, configs of the two, gelu, dtype
    (128, 96, 64, (16, 32, 32, 1, 4), (32, 32, 32, 1, 4), True, torch.float32),  # whole tiles, K in 3 chunks
    (40, 80, 48, (16, 32, 32, 2, 4), (16, 16, 32, 1, 4), False, torch.float32),  # ragged rows and K; split K first
    (16, 64, 128, (16, 32, 64, 4, 4), (16, 64, 64, 1, 4), True, torch.float16),  # fp16, split 4 with the residual
    (24, 48, 40, (32, 16, 32, 1, 4), (32, 16, 16, 1, 4), False, torch.float16),  # a row block wider than the rows
]
for m, hid, n2, cfg1, cfg2, gelu, dtype in cases:
    k1 = 2 * hid
    x, w1 = torch.randn(m, k1).to(dtype), (torch.randn(hid, k1) * k1**-0.5).to(dtype)
    b1, r = (torch.randn(hid) * 0.1).to(dtype), (torch.randn(m, hid) + 0.5).to(dtype)
    g, beta = (1 + 0.1 * torch.randn(hid)).to(dtype), (0.1 * torch.randn(hid)).to(dtype)
    w2, b2 = (torch.randn(n2, hid) * hid**-0.5).to(dtype), (torch.randn(n2) * 0.1).to(dtype)
    s_want = r.float() + F.linear(x.float(), w1.float(), b1.float())
    h_want = F.layer_norm(s_want, (hid,), g.float(), beta.float(), 1e-12)
    y_want = F.linear(h_want, w2.float(), b2.float())
    y_want = F.gelu(y_want, approximate="tanh") if gelu else y_want
    s, stats = sk.skinny_linear_stats(x, w1, b1, cfg1, residual=r)
    y, h = sk.skinny_ln_linear(s, stats, g, beta, 1e-12, w2, b2, cfg2, gelu=gelu)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    for name, got, want in (("s", s, s_want), ("h", h, h_want), ("y", y, y_want)):
        assert got.dtype == dtype and got.shape == want.shape, (name, got.dtype, got.shape)
        err = float((got.float() - want).abs().max())
        assert err < tol * max(1.0, float(want.abs().max())), (m, hid, cfg1, cfg2, dtype, name, err)
# a row whose mean is far from zero (BERT's hidden states have such dimensions): the variance stays exact
x = torch.randn(16, 64) * 0.1 + 40.0
x, stats = sk.skinny_linear_stats(x, torch.eye(64), None, (16, 16, 32, 1, 4))  # four partials of 16 columns
y, h = sk.skinny_ln_linear(x, stats, torch.ones(64), torch.zeros(64), 1e-12, torch.eye(64), None, (16, 64, 16, 1, 4))
want = F.layer_norm(x, (64,), eps=1e-12)
assert float((h - want).abs().max()) < 1e-3 and float((y - want).abs().max()) < 1e-3
# the add + LayerNorm kernel of the unfused form
a, r = torch.randn(37, 80), torch.randn(37, 80)
got = sl._add_ln_kernel  # compiled below through add_layer_norm's CUDA branch is not reachable here: call it directly
out = torch.empty(37, 80)
sl._add_ln_kernel[(5,)](a, r, torch.ones(80) * 2, torch.ones(80), out, 37, 80, 80, 80, 80, 1e-5, ROWS=8, BLOCK_N=128)
assert float((out - F.layer_norm(a + r, (80,), torch.ones(80) * 2, torch.ones(80), 1e-5)).abs().max()) < 1e-4
print("ok", len(cases) + 2)
"""


def test_kernels_match_the_unfused_form_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok 6"


@pytest.mark.parametrize("gelu", [False, True])
def test_ln_prologue_kernel_compiles_for_the_h200(gelu: bool) -> None:
    """The LayerNorm-prologue GEMM and the add + LayerNorm kernel down to sm_90 cubins: BERT-base's FFN in (K = 768),
    with PDL; the prologue's GEMM still uses the tensor cores."""
    kernel = compile_for_h200(
        sk._skinny_kernel,
        ["*fp16", "*fp16", "*fp16", "*fp16", "*fp32", *["*fp16"] * 4, "*fp32", *["i32"] * 8, "fp32", "i32"],
        {"K_ITERS": 6, "SPLIT": 1, "HAS_BIAS": True, "GELU": gelu, "RESIDUAL": False, "STATS_OUT": False, "LN_IN": True, "PART_N": 32, "T_POW2": 32, "BLOCK_M": 64,
         "BLOCK_N": 64, "BLOCK_K": 128, "PDL": True},
        divisible=("M", "N", "K"),
    )  # fmt: skip
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and ("mma" in ptx or "wgmma" in ptx)
    producer = compile_for_h200(
        sk._skinny_kernel,
        ["*fp16", "*fp16", "*fp16", "*fp16", "*fp32", *["*fp16"] * 4, "*fp32", *["i32"] * 8, "fp32", "i32"],
        {"K_ITERS": 6, "SPLIT": 1, "HAS_BIAS": True, "GELU": False, "RESIDUAL": True, "STATS_OUT": True,
         "LN_IN": False, "PART_N": 1, "T_POW2": 2, "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "PDL": True},
        divisible=("M", "N", "K"),
    )  # fmt: skip
    reduce_rows = compile_for_h200(
        sk._skinny_reduce_rows, ["*fp32", "*fp16", "*fp16", "*fp16", "*fp32", *["i32"] * 4],
        {"SPLIT": 4, "HAS_BIAS": True, "RESIDUAL": True, "ROWS": 4, "BLOCK_N": 1024, "PDL": True},
        divisible=("N",),
    )  # fmt: skip
    for k in (producer, reduce_rows):
        assert "griddepcontrol.wait" in k.asm["ptx"] and "st.global" in k.asm["ptx"]
    add_ln = compile_for_h200(
        sl._add_ln_kernel, [*["*fp16"] * 5, *["i32"] * 5, "fp32"], {"ROWS": 4, "BLOCK_N": 1024}, divisible=("N",)
    )
    assert "st.global" in add_ln.asm["ptx"]


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


def test_fused_only_where_the_table_has_both_products_and_the_second_keeps_k_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w1, w2 = torch.empty(768, 3072), torch.empty(2304, 768)
    monkeypatch.setattr(
        sk, "SKINNY_BEST", {(128, 768, 3072): (64, 32, 128, 4, 4), (128, 2304, 768): (64, 64, 128, 1, 4)}
    )
    assert sl.fused_configs(128, w1, w2) == ((64, 32, 128, 4, 4), (64, 64, 128, 1, 4))
    assert sl.fused_configs(256, w1, w2) is None
    monkeypatch.setitem(sk.SKINNY_BEST, (128, 2304, 768), (64, 64, 128, 2, 4))
    assert sl.fused_configs(128, w1, w2) is None


def test_bad_operands_are_named() -> None:
    if sk.triton is None:
        pytest.skip("needs Triton (CUDA builds of torch)")
    with pytest.raises(ValueError, match=r"residual \(2, 8, 31\), need \(2, 8, 32\)"):
        sk.skinny_linear(
            torch.randn(2, 8, 64), torch.randn(32, 64), None, (16, 32, 64, 1, 4), residual=torch.randn(2, 8, 31)
        )
    x, stats, w = torch.randn(16, 64), (torch.zeros(16, 4, 2), 16), torch.randn(8, 64)
    with pytest.raises(ValueError, match="splits K"):
        sk.skinny_ln_linear(x, stats, torch.ones(64), torch.zeros(64), 1e-5, w, None, (16, 32, 64, 2, 4))
    with pytest.raises(ValueError, match=r"gamma \(63,\)"):
        sk.skinny_ln_linear(x, stats, torch.ones(63), torch.zeros(64), 1e-5, w, None, (16, 32, 64, 1, 4))
    with pytest.raises(ValueError, match=r"stats \(16, 3, 2\) of 16 columns each do not cover x \(16, 64\)"):
        sk.skinny_ln_linear(
            x, (stats[0][:, :3], 16), torch.ones(64), torch.zeros(64), 1e-5, w, None, (16, 32, 64, 1, 4)
        )


def test_exported_stack_has_one_op_per_inner_layer_norm() -> None:
    """``use_ln_fusion`` on a 3-layer FastBert, exported with dynamic sizes as the engine does: the five inner
    LayerNorms are ``proj_ln_proj`` calls; only the embeddings' and the last one stay LayerNorms."""
    from miaohui.models import fast_bert
    from miaohui.models.intent import IntentClassifier, random_bert

    enc = random_bert(hidden=64, layers=3, heads=4, vocab=500, intermediate=128, seed=0)
    model = fast_bert.use_ln_fusion(fast_bert.use_skinny(fast_bert.from_module(IntentClassifier(enc, 24).eval())))
    ids, mask = torch.randint(5, 500, (2, 12)), torch.ones(2, 12, dtype=torch.int64)
    dims = {0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("sequence", max=64)}
    with torch.no_grad():
        ep = torch.export.export(model, (ids, mask), dynamic_shapes=(dims, dims))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("miaohui.proj_ln_proj.default") == 5
    assert sum("layer_norm" in t for t in targets) == 2
    assert torch.equal(ep.module()(ids, mask), model(ids, mask))
