"""The encoder's few-row Triton GEMM (``miaohui.models.skinny_gemm``) checked on the CPU under Triton's interpreter:
split K or not, ragged M/N/K, bias, tanh GELU, leading dims, fp32 and fp16, against ``F.linear`` (+ ``F.gelu``
tanh). The interpreter must be on before Triton is imported, so the check runs in a child process."""

from __future__ import annotations

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
    """``use_kernels(skinny=True)``: the GEMMs go through ``miaohui::skinny_linear`` and ``miaohui::proj_ln_proj`` (on
    the CPU: ``F.linear`` with tanh GELU, the add + LayerNorm), which ``torch.compile(fullgraph=True)`` takes as opaque
    ops; logits within tanh-vs-erf GELU of the plain model."""
    from miaohui.models import fast_bert
    from miaohui.models.intent import IntentClassifier, random_bert

    enc = random_bert(hidden=64, layers=2, heads=4, vocab=1000, intermediate=256, seed=0)
    model = fast_bert.from_module(IntentClassifier(enc, 5).eval())
    ids = torch.randint(5, 1000, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.inference_mode():
        want = model(ids, mask)
        fast_bert.use_kernels(model, skinny=True, attention=False)
        got = torch.compile(model, fullgraph=True, dynamic=False)(ids, mask)
    err = float((got - want).norm() / want.norm())
    assert 0 < err < 2e-3, err  # not 0: the skinny path's GELU is the tanh form


@pytest.mark.parametrize(("gelu", "pdl"), [(False, False), (True, False), (True, True)])
def test_kernels_compile_for_the_h200(gelu: bool, pdl: bool) -> None:
    """The tile kernel and the split-K reduction with and without the GELU epilogue, compiled down to a cubin for
    compute capability 9.0 on the CPU: a kernel can fail to compile for the GPU (e.g. an ``@jit`` helper's type
    annotations read as globals) where the interpreter tests above pass. With ``PDL`` both begin
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
