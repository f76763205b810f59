"""The encoder's LayerNorms folded into the split-K GEMMs before them, for the few-row products of an intent request.

``miaohui::proj_ln_proj(x, w1, b1, r, gamma, beta, eps, w2, b2, gelu) -> (y, h)`` computes
``h = LayerNorm(r + x @ w1ᵀ + b1)`` and ``y = h @ w2ᵀ + b2`` (then tanh GELU): a projection, the residual add and
LayerNorm after it, and the GEMM that reads the LayerNorm. In BERT that is the attention output → LayerNorm → FFN in,
and the FFN output → LayerNorm → the next layer's QKV. ``h`` is the next residual.

Where :data:`miaohui.models.skinny_gemm.SKINNY_BEST` has the first product at these rows with K split over programs,
or :data:`LN_SPLIT_BEST` has a split for it (CUDA), the kernel that sums the split's partials — it holds whole rows —
also adds bias and residual and normalizes (``skinny_linear(..., residual_ln=...)``): the add + LayerNorm kernel is
gone, two or three kernels instead of three or four. The splits come from the GPU's tuning file: the skinny table's
own, and forced splits (``ln_split``) where the fused pair measured faster. The second GEMM runs by
``miaohui::skinny_linear``'s rule.

Elsewhere (other rows; a first product without split K) it runs the reference form: the first GEMM, one add +
LayerNorm kernel (:func:`add_layer_norm`, Triton on CUDA, as Inductor would make of them; its launch by
:func:`add_ln_launch`), the second GEMM.

Why: at 1×128 a BERT-base call is ~105 kernels of ~3.3 µs, latency rather than work, and 24 of them are add +
LayerNorm kernels. A LayerNorm in the GEMM's epilogue (a tile holds only part of a row) or in the next GEMM's prologue
(the operand normalized in registers before ``tl.dot``) measured slower than the unfused pair; the split's reduce,
which holds whole rows, is where it pays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miaohui.models import skinny_gemm

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl

    from miaohui.models.skinny_gemm import _layer_norm_rows
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


if triton is not None:

    @triton.jit
    def _add_ln_kernel(
        a_ptr,
        r_ptr,
        g_ptr,
        beta_ptr,
        out_ptr,
        M,
        N,
        stride_am,
        stride_rm,
        stride_om,
        eps,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,
    ) -> None:
        """``LayerNorm(a + r)`` for ROWS rows a program, in fp32 (two-pass variance), stored in out's dtype."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rn = tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        v = tl.load(a_ptr + rm[:, None] * stride_am + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        v += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        y = _layer_norm_rows(v, mask, rn, N, g_ptr, beta_ptr, eps)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


AddLnLaunch = tuple[int, int]
"""(rows a program, num_warps) of :func:`add_layer_norm`'s kernel."""


def add_ln_launch(m: int, n: int) -> AddLnLaunch:
    """The launch of :func:`add_layer_norm` for ``m`` rows of ``n``: one row a program below 1,024 rows, two from
    there; a warp per 1,024 elements of the program's power-of-two block (timed on the H200 within a few percent of
    the fastest launch at 512 and 4,096 rows of 768 and 384, and of Inductor's own kernel for the add + LayerNorm)."""
    block_n = 1 << max(0, n - 1).bit_length()
    rows = 1 if m < 1024 else 2
    return rows, max(1, rows * block_n // 1024)


def add_layer_norm(
    a: torch.Tensor,
    r: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    pdl: bool = False,
) -> torch.Tensor:
    """``F.layer_norm(a + r, (N,), gamma, beta, eps)``: one Triton kernel on CUDA (what Inductor makes of the add and
    the LayerNorm; ``pdl``: launched as a programmatic dependent; its launch by :func:`add_ln_launch`), torch
    elsewhere."""
    n = a.shape[-1]
    if not (a.is_cuda and triton is not None):
        return F.layer_norm(a + r, (n,), gamma, beta, eps)
    a2, r2 = skinny_gemm.rows_of(a), skinny_gemm.rows_of(r)
    m = a2.shape[0]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    rows, warps = add_ln_launch(m, n)
    _add_ln_kernel[(triton.cdiv(m, rows),)](
        a2, r2, gamma, beta, out, m, n, a2.stride(0), r2.stride(0), out.stride(0), eps,
        ROWS=rows, BLOCK_N=triton.next_power_of_2(n), PDL=pdl, num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip
    return out.view(a.shape)


LN_SPLIT_BEST: dict[tuple[int, int, int], skinny_gemm.SkinnyConfig] = {}
"""(M, N, K) → the first product's configuration when the LayerNorm after it is fused: a split of K that the plain
product's entry in :data:`~miaohui.models.skinny_gemm.SKINNY_BEST` does not have, measured to pay as a pair (the
split costs less than the add + LayerNorm kernel it removes). Filled by ``kernel_tables.apply`` from the tuning
file's ``ln_split``."""


def fused_config(rows: int, w1: torch.Tensor) -> skinny_gemm.SkinnyConfig | None:
    """The first product's configuration at ``rows`` rows where it splits K (the reduce then does the LayerNorm):
    :data:`LN_SPLIT_BEST`'s, else the skinny table's if that splits; None: the op runs unfused."""
    key = (rows, w1.shape[0], w1.shape[1])
    cfg = LN_SPLIT_BEST.get(key) or skinny_gemm.SKINNY_BEST.get(key)
    return cfg if cfg is not None and cfg[3] > 1 else None


@torch.library.custom_op("miaohui::proj_ln_proj", mutates_args=())
def proj_ln_proj(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    r: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    w2: torch.Tensor,
    b2: torch.Tensor,
    gelu: bool,
    lt: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`proj_ln_proj_call` as an op of its own (opaque to ``torch.export`` and Inductor)."""
    return proj_ln_proj_call(x, w1, b1, r, gamma, beta, eps, w2, b2, gelu, lt)


def proj_ln_proj_call(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    r: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    w2: torch.Tensor,
    b2: torch.Tensor,
    gelu: bool,
    lt: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``y``, ``h``): ``h = LayerNorm(r + x @ w1ᵀ + b1)``, ``y = h @ w2ᵀ + b2`` (then tanh GELU); see the module.
    ``lt``: the GEMMs that run cuBLAS run cuBLASLt's timed algorithm where it has one (``skinny_op``'s ``lt``)."""
    k = x.shape[-1]
    cfg = fused_config(x.numel() // k, w1) if x.is_cuda and triton is not None else None
    if cfg is not None:
        h = skinny_gemm.skinny_linear(x, w1, b1, cfg, pdl=skinny_gemm.SKINNY_PDL, residual_ln=(r, gamma, beta, eps))
    else:  # PDL where the first product ran the skinny kernel: a chain of small kernels, as the ops around it
        pdl = skinny_gemm.SKINNY_PDL and (x.numel() // k, *w1.shape) in skinny_gemm.SKINNY_BEST
        h = add_layer_norm(skinny_gemm.skinny_call(x, w1, b1, False, lt), r, gamma, beta, eps, pdl=pdl)
    return skinny_gemm.skinny_call(h, w2, b2, gelu, lt), h


@proj_ln_proj.register_fake
def _proj_ln_proj_fake(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    r: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    w2: torch.Tensor,
    b2: torch.Tensor,
    gelu: bool,
    lt: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((*x.shape[:-1], w2.shape[0])), x.new_empty((*x.shape[:-1], w1.shape[0]))
