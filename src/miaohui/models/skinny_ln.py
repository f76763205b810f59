"""The encoder's LayerNorms folded into the GEMMs around them, for the few-row products of an intent request.

``miaohui::proj_ln_proj(x, w1, b1, r, gamma, beta, eps, w2, b2, gelu) -> (y, h)`` computes
``h = LayerNorm(r + x @ w1ᵀ + b1)`` and ``y = h @ w2ᵀ + b2`` (then tanh GELU): a projection, the residual add and
LayerNorm after it, and the GEMM that reads the LayerNorm. In BERT that is the attention output → LayerNorm → FFN in,
and the FFN output → LayerNorm → the next layer's QKV. ``h`` is the next residual.

Where :data:`miaohui.models.skinny_gemm.SKINNY_BEST` has both products at these rows (CUDA), it is two kernels
instead of three:

1. the skinny GEMM with the residual added in its epilogue (or in its split-K reduce) stores ``s``, and each output
   tile its rows' partial mean and squared deviations (a few floats a row);
2. the skinny GEMM with the LayerNorm in its prologue: each program merges its rows' partials into mean and variance
   (Chan et al.), then normalizes every tile of ``s`` as it loads it for the product; the programs of the first
   column block also store the normalized tiles, ``h``.

Why: at 1×128 a BERT-base call is ~105 kernels of ~3.3 µs, latency rather than work, and 24 of them are add +
LayerNorm kernels (``benchmarks/NOTES_gpu.md``, sessions 23–26). Session 23's first try (``LayerNorm(residual + x @
wᵀ + b)`` in the GEMM's epilogue) was slower: a tile holds only part of a row, so the last program of each row block
normalized the whole block alone. Here nobody waits on anybody: the LayerNorm moves to where whole rows are read
anyway — every program of a K = hidden product reads all K of its rows. Its statistics come from the kernel before,
whose tiles see every value once: a first version that read the rows twice (statistics, then the product) was
slower than no fusion at all on the H200 (1×128 0.59 ms against 0.36, ``gpu_encoder_bert_ln_s30a.json``), the
statistics pass's loads waiting on L2 one chunk after another.

Elsewhere (other rows; a config that splits K for the second product) it runs what the engine ran before: the first
GEMM with its bias, one add + LayerNorm kernel (:func:`add_layer_norm`, Triton on CUDA), the second GEMM — each GEMM
through ``miaohui::skinny_linear``'s rule (its table's kernel, else cuBLAS), so the kernel count is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miaohui.models import skinny_gemm

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
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
    ) -> None:
        """``LayerNorm(a + r)`` for ROWS rows a program, in fp32 (two-pass variance), stored in out's dtype."""
        rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rn = tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        v = tl.load(a_ptr + rm[:, None] * stride_am + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        v += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(v, 1) / N
        d = tl.where(mask, v - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / N + eps)
        g = tl.load(g_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        b = tl.load(beta_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = d * rstd[:, None] * g[None, :] + b[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def add_layer_norm(
    a: torch.Tensor, r: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float
) -> torch.Tensor:
    """``F.layer_norm(a + r, (N,), gamma, beta, eps)``: one Triton kernel on CUDA (what Inductor makes of the add and
    the LayerNorm), torch elsewhere."""
    n = a.shape[-1]
    if not (a.is_cuda and triton is not None):
        return F.layer_norm(a + r, (n,), gamma, beta, eps)
    a2, r2 = a.reshape(-1, n), r.reshape(-1, n)
    a2 = a2 if a2.stride(-1) == 1 else a2.contiguous()
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    m = a2.shape[0]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    block_n = triton.next_power_of_2(n)
    rows = max(1, min(8, 4096 // block_n))
    _add_ln_kernel[(triton.cdiv(m, rows),)](
        a2, r2, gamma, beta, out, m, n, a2.stride(0), r2.stride(0), out.stride(0), eps,
        ROWS=rows, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out.view(a.shape)


def fused_configs(
    rows: int, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[skinny_gemm.SkinnyConfig, skinny_gemm.SkinnyConfig] | None:
    """The table's configurations for both products at ``rows`` rows, or None where the op runs unfused: either
    product missing, or the second one splitting K."""
    first = skinny_gemm.SKINNY_BEST.get((rows, w1.shape[0], w1.shape[1]))
    second = skinny_gemm.SKINNY_BEST.get((rows, w2.shape[0], w2.shape[1]))
    if first is None or second is None or second[3] != 1:
        return None
    return first, second


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``y``, ``h``): ``h = LayerNorm(r + x @ w1ᵀ + b1)``, ``y = h @ w2ᵀ + b2`` (then tanh GELU); see the module."""
    k = x.shape[-1]
    cfgs = fused_configs(x.numel() // k, w1, w2) if x.is_cuda and triton is not None else None
    if cfgs is not None:
        pdl = skinny_gemm.SKINNY_PDL
        s, stats = skinny_gemm.skinny_linear_stats(x, w1, b1, cfgs[0], residual=r, pdl=pdl)
        return skinny_gemm.skinny_ln_linear(s, stats, gamma, beta, eps, w2, b2, cfgs[1], gelu=gelu, pdl=pdl)
    h = add_layer_norm(skinny_gemm.skinny_op(x, w1, b1, False), r, gamma, beta, eps)
    return skinny_gemm.skinny_op(h, w2, b2, gelu), h


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
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((*x.shape[:-1], w2.shape[0])), x.new_empty((*x.shape[:-1], w1.shape[0]))
