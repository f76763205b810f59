"""``LayerNorm(residual + x @ wᵀ + bias)`` as one Triton kernel for the encoder's few-row products that a LayerNorm
reads next (BERT's attention-output and FFN-output projections), instead of a GEMM, maybe a split-K reduce, and an
add + LayerNorm kernel.

Why: at 1×128 the BERT-base call is ~120 kernels at ~3.4 µs each, latency rather than work (``NOTES_gpu.md``, session
18); 24 of them are the add + LayerNorm kernels and 12 more the split-K reduces of the FFN output. A LayerNorm needs
whole rows, which a small output tile does not hold, so the tiles finish the rows together: every program stores its
fp32 tile (over its slice of K) to a workspace and counts itself in at its row block's counter; the program that
arrives last sums the row block's slices, adds bias and residual, normalizes the whole rows and resets the counter
for the next call (the "last block does the fix-up" pattern, as CUTLASS's split-K serial reduction and stream-K do).
No memset: the counters start at zero once and every call leaves them at zero.

Status: arithmetic checked on the CPU under Triton's interpreter and compiled for compute capability 9.0
(``tests/unit/test_skinny_ln.py``); the ordering between programs (release/acquire on the counter, the fix-up's loads
bypassing L1) can only be checked on a GPU (``tests/gpu/test_skinny_ln_gpu.py``) and the speed only measured there
(``scripts/gpu/encoder_variants.py``'s ``static_skinny_ln``, ``run_h200.sh s26b``). Not in the engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miaohui.models.skinny_gemm import SkinnyConfig

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl

    from miaohui.models.skinny_gemm import _tile_product
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

LN_ROWS = 8
"""Rows the fix-up normalizes at a time (a [LN_ROWS, next_pow2(N)] fp32 block in registers)."""

SKINNY_LN_BEST: dict[tuple[int, int, int], SkinnyConfig] = {
    (16, 768, 768): (16, 32, 128, 2, 4),
    (16, 768, 3072): (16, 32, 128, 4, 4),
    (128, 768, 768): (16, 32, 128, 1, 4),
    (128, 768, 3072): (16, 32, 128, 4, 4),
}
"""(M, N, K) → (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps) for BERT-base's two products at 16 and 128 rows: 16-row
tiles so that the fix-up's serial part is short (a guess until ``encoder_variants.py`` has timed them); every other
product runs the unfused form."""

_counters: dict[torch.device, torch.Tensor] = {}
"""Zeroed int32 counters by device: each call leaves them at zero, so they are allocated (and zeroed) once, before a
CUDA graph's capture when the warm-up runs first, and the graph then holds no memset. One set per device: calls on
two streams at once would share them, which is why this stays out of the engine (one stream per instance) until the
counters belong to the layer."""


if triton is not None:

    @triton.jit
    def _skinny_ln_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        res_ptr,
        g_ptr,
        beta_ptr,
        out_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_rm,
        stride_om,
        eps,
        K_ITERS: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        N_POW2: tl.constexpr,
        LN_ROWS: tl.constexpr,
        PDL: tl.constexpr,
    ) -> None:
        """Program (row block, column tile, K slice): its fp32 tile to ``ws`` [SPLIT, M, N]; the last of the row
        block's ``tiles × SPLIT`` programs to arrive normalizes the block's rows into ``out``."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_product(
            x_ptr, w_ptr, rm, rn, pid_k, M, N, K, stride_xm, stride_wn, K_ITERS, BLOCK_M, BLOCK_N, BLOCK_K
        )
        tl.store(ws_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
        tl.debug_barrier()  # every thread's stores happen before the counter's release
        arrived = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) * SPLIT - 1:  # the last one: the row block's tiles are all in ws
            tl.debug_barrier()
            c = tl.arange(0, N_POW2)
            cmask = c < N
            bias = tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)
            gamma = tl.load(g_ptr + c, mask=cmask, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + c, mask=cmask, other=0.0).to(tl.float32)
            for r0 in tl.static_range(0, BLOCK_M, LN_ROWS):
                r = pid_m * BLOCK_M + r0 + tl.arange(0, LN_ROWS)
                m2 = (r[:, None] < M) & cmask[None, :]
                y = tl.load(res_ptr + r[:, None] * stride_rm + c[None, :], mask=m2, other=0.0).to(tl.float32)
                y += bias[None, :]
                for s in tl.static_range(SPLIT):  # other programs' tiles: from L2, not this SM's L1
                    y += tl.load(
                        ws_ptr + (s * M + r[:, None]) * N + c[None, :], mask=m2, other=0.0, cache_modifier=".cg"
                    )
                mean = tl.sum(y, axis=1) / N
                d = tl.where(m2, y - mean[:, None], 0.0)
                rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps)
                out = d * rstd[:, None] * gamma[None, :] + beta[None, :]
                tl.store(out_ptr + r[:, None] * stride_om + c[None, :], out.to(out_ptr.dtype.element_ty), mask=m2)
            tl.atomic_xchg(cnt_ptr + pid_m, 0)  # zero again for the next call (a CUDA graph replays these counters)


def _counters_for(device: torch.device, blocks: int) -> torch.Tensor:
    have = _counters.get(device)
    if have is None or have.numel() < blocks:
        have = torch.zeros(max(blocks, 64), dtype=torch.int32, device=device)
        _counters[device] = have
    return have


def skinny_linear_ln(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    config: SkinnyConfig,
    pdl: bool = False,
) -> torch.Tensor:
    """``F.layer_norm(residual + F.linear(x, w, bias), (N,), gamma, beta, eps)`` for ``x`` [..., K], ``w`` [N, K] and
    ``residual`` [..., N] of one dtype, as one kernel with ``config`` (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps);
    ``pdl`` as :func:`~miaohui.models.skinny_gemm.skinny_linear`'s."""
    if triton is None:
        raise RuntimeError("skinny_linear_ln needs Triton (it comes with CUDA builds of torch)")
    n, k = w.shape
    if x.shape[-1] != k or residual.shape != (*x.shape[:-1], n) or x.dtype != w.dtype or residual.dtype != x.dtype:
        raise ValueError(
            f"skinny_linear_ln: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, residual "
            f"{tuple(residual.shape)} {residual.dtype}: need x [..., K], w [N, K], residual [..., N], one dtype"
        )
    block_m, block_n, block_k, split, warps = config
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = residual.reshape(-1, n)
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    blocks = triton.cdiv(m, block_m)
    counters = _counters_for(x.device, blocks)
    _skinny_ln_kernel[(blocks, triton.cdiv(n, block_n), split)](
        x2, w, bias, r2, gamma, beta, out, ws, counters, m, n, k, x2.stride(0), w.stride(0), r2.stride(0),
        out.stride(0), eps, K_ITERS=triton.cdiv(triton.cdiv(k, split), block_k), SPLIT=split, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, N_POW2=triton.next_power_of_2(n), LN_ROWS=min(LN_ROWS, block_m), PDL=pdl,
        launch_pdl=pdl, num_warps=warps,
    )  # fmt: skip
    return out.reshape(residual.shape)


SKINNY_LN_PDL = False
"""Launch :data:`SKINNY_LN_BEST`'s kernels as programmatic dependents (bench-only, as ``skinny_gemm.SKINNY_PDL``)."""


@torch.library.custom_op("miaohui::skinny_linear_ln", mutates_args=())
def skinny_ln_op(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The encoder's ``LayerNorm(residual + linear(x))``: :func:`skinny_linear_ln` where :data:`SKINNY_LN_BEST` has the
    product's (rows, N, K), else the unfused form."""
    k = x.shape[-1]
    cfg = SKINNY_LN_BEST.get((x.numel() // k, w.shape[0], k)) if x.is_cuda and triton is not None else None
    if cfg is not None:
        return skinny_linear_ln(x, w, bias, residual, gamma, beta, eps, cfg, pdl=SKINNY_LN_PDL)
    return F.layer_norm(residual + F.linear(x, w, bias), (w.shape[0],), gamma, beta, eps)


@skinny_ln_op.register_fake
def _skinny_ln_fake(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    return torch.empty_like(residual)
