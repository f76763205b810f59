"""A Triton GEMM for the encoder's few-row products (``x`` [M, K] @ ``w`` [N, K]ᵀ + bias, optional tanh GELU) with
small tiles and split K, for the rows an intent request has (M = batch × sequence ≈ 16–512).

Why: BERT-base fp16 at 1×128 on the H200 is 0.47 ms, ~290 µs of it in cuBLAS GEMMs of 128 rows at ~5 µs each
(``gpu_encoder_bert_fusedgelu_h200_s11f.json``): QKV 5.3, attention out 4.4, FFN in + GELU 5.7, FFN out 8.7 (split K:
the GEMM, a reduce kernel and a memset) per layer, against ~1 µs each for their weights at the HBM rate. At 128 rows
a 128-wide output tile leaves most of the 132 SMs idle; smaller tiles and K split over programs give them work. The
(1, 128) ≤ 0.35 ms goal needs about 10 µs per layer back.

Status: written after session 17's device time; arithmetic checked on the CPU under Triton's interpreter
(``tests/unit/test_skinny_gemm.py``); speed unmeasured — ``scripts/gpu/encoder_gemm_sweep.py`` times it against cuBLAS
(``run_h200.sh s18b``). Not wired into the engine.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

SkinnyConfig = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps)."""

SKINNY_SWEEP: list[SkinnyConfig] = [
    (bm, bn, bk, split, 4) for bm in (16, 32, 64) for bn in (32, 64, 128) for bk in (64, 128) for split in (1, 2, 4)
]
"""Every configuration ``scripts/gpu/encoder_gemm_sweep.py`` times (those with BLOCK_M ≤ M)."""

if triton is not None:

    @triton.jit
    def _gelu_tanh(v):  # no annotations: a @jit function reads them as globals
        inner = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        e = tl.exp(-2.0 * tl.abs(inner))  # tanh without overflow: sign(u) · (1 − e^{−2|u|}) / (1 + e^{−2|u|})
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(inner < 0, -t, t)
        return 0.5 * v * (1.0 + t)

    @triton.jit
    def _tile_product(
        x_ptr, w_ptr, rm, rn, pid_k, M, N, K, stride_xm, stride_wn, K_ITERS, BLOCK_M, BLOCK_N, BLOCK_K
    ):  # no annotations: a @jit function reads them as globals
        """``x[rm, ks] @ w[rn, ks]ᵀ`` in fp32 over the ``pid_k``-th slice of K (``K_ITERS`` steps of ``BLOCK_K``)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * (K_ITERS * BLOCK_K)
        for it in range(K_ITERS):
            rk = k_start + it * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
            )
            w = tl.load(
                w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0
            )
            acc += tl.dot(x, w)
        return acc

    @triton.jit
    def _tile_stats(v, mask, rm, pid_n, M, N, st_ptr, BLOCK_N):  # no annotations: see above
        """Store the mean and the sum of squared deviations of each row of tile ``v`` over its valid columns to
        ``st`` [M, T, 2] (T = column blocks; this tile is ``pid_n``), for :func:`_merged_stats` (Chan et al.)."""
        cnt = tl.sum(((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) < N).to(tl.float32), 0)
        mean = tl.sum(tl.where(mask, v, 0.0), 1) / cnt
        d = tl.where(mask, v - mean[:, None], 0.0)
        at = st_ptr + (rm * tl.num_programs(1) + pid_n) * 2
        tl.store(at, mean, mask=rm < M)
        tl.store(at + 1, tl.sum(d * d, 1), mask=rm < M)

    @triton.jit
    def _merged_stats(st_ptr, rm, M, K, T, PART_N, T_POW2):  # no annotations: see above
        """Rows ``rm``'s mean and sum of squared deviations over all K from their T partials in ``st`` [M, T, 2]
        (partial t covers columns t·PART_N … on, fewer in the last)."""
        rt = tl.arange(0, T_POW2)
        smask = (rm[:, None] < M) & (rt[None, :] < T)
        at = st_ptr + (rm[:, None] * T + rt[None, :]) * 2
        means = tl.load(at, mask=smask, other=0.0)
        m2s = tl.load(at + 1, mask=smask, other=0.0)
        cnt = tl.where(rt < T, tl.minimum(K - rt * PART_N, PART_N), 0).to(tl.float32)
        mean = tl.sum(means * cnt[None, :], 1) / K
        dm = means - mean[:, None]
        return mean, tl.sum(m2s, 1) + tl.sum(cnt[None, :] * dm * dm, 1)

    @triton.jit
    def _tile_product_ln(
        x_ptr,
        w_ptr,
        g_ptr,
        beta_ptr,
        h_ptr,
        mean,
        rstd,
        h_rows,
        rm,
        rn,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_hm,
        K_ITERS,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    ):  # no annotations: see above
        """``LayerNorm(x)[rm] @ w[rn]ᵀ`` in fp32 over all of K: each tile of ``x`` normalized (``mean``, ``rstd``,
        then ``g``, ``beta``) and rounded to x's dtype as it is loaded, as a LayerNorm kernel would have stored it;
        rows below ``h_rows``: also stored to ``h`` (M for one column block's programs, 0 for the others)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(K_ITERS):
            rk = it * BLOCK_K + tl.arange(0, BLOCK_K)
            kmask = rk < K
            xmask = (rm[:, None] < M) & kmask[None, :]
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=xmask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
            bb = tl.load(beta_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
            h = ((x - mean[:, None]) * rstd[:, None] * g[None, :] + bb[None, :]).to(x_ptr.dtype.element_ty)
            tl.store(h_ptr + rm[:, None] * stride_hm + rk[None, :], h, mask=(rm[:, None] < h_rows) & kmask[None, :])
            w = tl.load(
                w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & kmask[:, None], other=0.0
            )
            acc += tl.dot(h, w)
        return acc

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        ws_ptr,
        r_ptr,
        g_ptr,
        beta_ptr,
        h_ptr,
        st_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        stride_rm,
        stride_hm,
        eps,
        T,
        K_ITERS: tl.constexpr,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GELU: tl.constexpr,
        RESIDUAL: tl.constexpr,
        STATS_OUT: tl.constexpr,
        LN_IN: tl.constexpr,
        PART_N: tl.constexpr,
        T_POW2: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ) -> None:
        """A [BLOCK_M, BLOCK_N] output tile over one of SPLIT slices of K; SPLIT 1 applies bias/residual/GELU and
        stores, otherwise fp32 partials go to ``ws`` [SPLIT, M, N] for :func:`_skinny_reduce`. ``RESIDUAL``: adds
        ``r`` [M, N]. ``STATS_OUT`` (SPLIT 1): each tile also stores its rows' partial mean and squared deviations
        of what it stored to ``st`` [M, T, 2]. ``LN_IN`` (SPLIT 1): the product is ``LayerNorm(x)`` (``g``, ``beta``,
        ``eps``; the mean and variance merged from x's T partials in ``st``, each of PART_N columns) times ``w``ᵀ,
        and the first column block's programs store ``LayerNorm(x)`` to ``h``. ``PDL``: launched as a
        programmatic dependent of the kernel before it (see :func:`skinny_linear`)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch now; it waits as this one does
            tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x) are complete and visible
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if LN_IN:
            mean, m2 = _merged_stats(st_ptr, rm, M, K, T, PART_N, T_POW2)
            rstd = 1.0 / tl.sqrt(m2 / K + eps)
            acc = _tile_product_ln(
                x_ptr, w_ptr, g_ptr, beta_ptr, h_ptr, mean, rstd, M * (pid_n == 0).to(tl.int32), rm, rn, M, N, K,
                stride_xm, stride_wn, stride_hm, K_ITERS, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        else:
            acc = _tile_product(
                x_ptr, w_ptr, rm, rn, pid_k, M, N, K, stride_xm, stride_wn, K_ITERS, BLOCK_M, BLOCK_N, BLOCK_K
            )
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if RESIDUAL:
                acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
            if GELU:
                acc = _gelu_tanh(acc)
            v = acc.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], v, mask=mask)
            if STATS_OUT:
                _tile_stats(v.to(tl.float32), mask, rm, pid_n, M, N, st_ptr, BLOCK_N)
        else:
            tl.store(ws_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)

    @triton.jit
    def _skinny_reduce(
        ws_ptr,
        b_ptr,
        r_ptr,
        out_ptr,
        M,
        N,
        stride_om,
        stride_rm,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GELU: tl.constexpr,
        RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ) -> None:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.static_range(SPLIT):
            acc += tl.load(ws_ptr + i * M * N + offs, mask=mask, other=0.0)
        col = offs % N
        if HAS_BIAS:
            acc += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:
            acc += tl.load(r_ptr + (offs // N) * stride_rm + col, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            acc = _gelu_tanh(acc)
        tl.store(out_ptr + (offs // N) * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _skinny_reduce_rows(
        ws_ptr,
        b_ptr,
        r_ptr,
        out_ptr,
        st_ptr,
        M,
        N,
        stride_om,
        stride_rm,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RESIDUAL: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,
    ) -> None:
        """:func:`_skinny_reduce` for whole rows (ROWS a program, BLOCK_N ≥ N), which also stores each row's mean and
        squared deviations to ``st`` [M, 1, 2] (``STATS_OUT`` for a split-K product)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rn = tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for i in tl.static_range(SPLIT):
            acc += tl.load(ws_ptr + (i * M + rm[:, None]) * N + rn[None, :], mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if RESIDUAL:
            acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        v = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], v, mask=mask)
        _tile_stats(v.to(tl.float32), mask, rm, 0, M, N, st_ptr, BLOCK_N)


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    gelu: bool = False,
    pdl: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` (plus ``residual`` [..., N] when given, then tanh GELU when ``gelu``) for ``x``
    [..., K] and ``w`` [N, K] of one dtype, with ``config`` (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps); SPLIT > 1
    adds a kernel that sums fp32 partials (and adds bias and residual).

    ``pdl``: Hopper's programmatic dependent launch. The kernels are launched with
    ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` and begin with ``griddepcontrol.launch_dependents`` then
    ``griddepcontrol.wait``: a kernel may be launched while the one before it still runs, and waits on the GPU for
    that one's writes, instead of launching after it has ended (a latency of each of the ~120 kernels of a 1×128
    BERT-base call; ``scripts/gpu/pdl_probe.py`` measures it)."""
    return _launch(x, w, bias, config, gelu, pdl, residual).out


RowStats = tuple[torch.Tensor, int]
"""A tensor's per-row partial statistics for a LayerNorm: [M, T, 2] fp32 (each partial's mean and sum of squared
deviations) and how many columns each partial covers (the last may cover fewer)."""


def skinny_linear_stats(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    residual: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, RowStats]:
    """:func:`skinny_linear` (no GELU) that also returns its output rows' statistics for
    :func:`skinny_ln_linear`: each output tile stores its rows' partial mean and squared deviations (of the values
    as stored), or with split K the reduce does it for whole rows."""
    done = _launch(x, w, bias, config, False, pdl, residual, stats=True)
    assert done.stats is not None
    return done.out, done.stats


def skinny_ln_linear(
    x: torch.Tensor,
    stats: RowStats,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    gelu: bool = False,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = F.layer_norm(x, (K,), gamma, beta, eps)`` and ``F.linear(h, w, bias)`` (then tanh GELU) as one kernel,
    with ``x``'s row statistics from the kernel that wrote it (:func:`skinny_linear_stats`): each program merges its
    rows' partials into mean and variance, then normalizes each tile of ``x`` as it loads it for the product (rounded
    to x's dtype, as a LayerNorm kernel stores it); the first column block's programs also store ``h``. Returns
    (output, h). ``config``'s SPLIT must be 1."""
    if config[3] != 1:
        raise ValueError(f"skinny_ln_linear: config {config} splits K; the LayerNorm in the prologue needs SPLIT 1")
    k = x.shape[-1]
    if gamma.shape != (k,) or beta.shape != (k,):
        raise ValueError(f"skinny_ln_linear: gamma {tuple(gamma.shape)}, beta {tuple(beta.shape)}: need ({k},)")
    rows = x.numel() // k
    if stats[0].dim() != 3 or stats[0].shape[0] != rows or stats[0].shape[2] != 2 or stats[0].shape[1] * stats[1] < k:
        raise ValueError(
            f"skinny_ln_linear: stats {tuple(stats[0].shape)} of {stats[1]} columns each do not cover x "
            f"{tuple(x.shape)}: pass what skinny_linear_stats returned with x"
        )
    done = _launch(x, w, bias, config, gelu, pdl, None, ln=(gamma, beta, eps, stats))
    assert done.h is not None
    return done.out, done.h


class _Launched(NamedTuple):
    out: torch.Tensor
    h: torch.Tensor | None
    stats: RowStats | None


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    gelu: bool,
    pdl: bool,
    residual: torch.Tensor | None,
    stats: bool = False,
    ln: tuple[torch.Tensor, torch.Tensor, float, RowStats] | None = None,
) -> _Launched:
    if triton is None:
        raise RuntimeError("skinny_linear needs Triton (it comes with CUDA builds of torch)")
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or x.dtype != w.dtype:
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}: need w [N, K] and x [..., K] "
            "of the same dtype"
        )
    block_m, block_n, block_k, split, warps = config
    lead = x.shape[:-1]
    x2 = _rows(x)
    w = w if w.stride(-1) == 1 else w.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r2 = out
    if residual is not None:
        if residual.shape != (*lead, n):
            raise ValueError(f"skinny_linear: residual {tuple(residual.shape)}, need {(*lead, n)}")
        r2 = _rows(residual)
    g, beta, eps, (st_in, part_n) = ln if ln is not None else (w, w, 0.0, (out, 1))
    h = torch.empty_like(x2) if ln is not None else None
    tiles_n = triton.cdiv(n, block_n)
    st_out = torch.empty((m, tiles_n if split == 1 else 1, 2), dtype=torch.float32, device=x.device) if stats else None
    st = st_in if ln is not None else (st_out if st_out is not None else out)
    t_in = st_in.shape[1] if ln is not None else 1
    k_iters = triton.cdiv(triton.cdiv(k, split), block_k)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else w
    flags = {"HAS_BIAS": bias is not None, "RESIDUAL": residual is not None}
    _skinny_kernel[(triton.cdiv(m, block_m), tiles_n, split)](
        x2, w, b, out, ws, r2, g, beta, h if h is not None else x2, st, m, n, k, x2.stride(0), w.stride(0),
        out.stride(0), r2.stride(0), x2.stride(0) if h is None else h.stride(0), eps, t_in,
        K_ITERS=k_iters, SPLIT=split, GELU=gelu, STATS_OUT=stats and split == 1, LN_IN=ln is not None,
        PART_N=part_n, T_POW2=max(2, triton.next_power_of_2(t_in)), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, PDL=pdl, launch_pdl=pdl, **flags,
    )  # fmt: skip
    if split > 1 and stats:
        rows = 4
        _skinny_reduce_rows[(triton.cdiv(m, rows),)](
            ws, b, r2, out, st, m, n, out.stride(0), r2.stride(0), SPLIT=split, ROWS=rows,
            BLOCK_N=triton.next_power_of_2(n), num_warps=4, PDL=pdl, launch_pdl=pdl, **flags,
        )  # fmt: skip
    elif split > 1:
        _skinny_reduce[(triton.cdiv(m * n, 1024),)](
            ws, b, r2, out, m, n, out.stride(0), r2.stride(0), SPLIT=split, GELU=gelu, BLOCK=1024, PDL=pdl,
            launch_pdl=pdl, **flags,
        )  # fmt: skip
    row_stats = None if st_out is None else (st_out, block_n if split == 1 else n)
    return _Launched(out.reshape(*lead, n), None if h is None else h.reshape(x.shape), row_stats)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last dim] with unit stride along the last dim."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


SKINNY_BEST: dict[tuple[int, int, int], SkinnyConfig] = {}
"""(M, N, K) → the configuration to run, for the products where the sweep found it faster than cuBLAS; every other
product keeps cuBLAS. Filled by ``kernel_tables.apply`` (the engine) or the benchmarks
(``scripts/gpu/encoder_gemm_sweep.py``; :func:`table_from_sweep`)."""


SKINNY_PDL = False
"""Launch the table's kernels as programmatic dependents (:func:`skinny_linear`'s ``pdl``): set with the table by
``kernel_tables.apply`` and by ``scripts/gpu/encoder_variants.py``'s ``*_pdl*`` variants."""


def table_from_sweep(report: dict[str, Any]) -> dict[tuple[int, int, int], SkinnyConfig]:
    """``encoder_gemm_sweep.py``'s ``best`` entries that beat cuBLAS, as :data:`SKINNY_BEST` entries."""
    out: dict[tuple[int, int, int], SkinnyConfig] = {}
    for e in report["best"]:
        if e["us"] < e["cublas_us"]:
            bm, bn, bk, split, warps = (int(v) for v in e["config"])
            out[(int(e["m"]), int(e["n"]), int(e["k"]))] = (bm, bn, bk, split, warps)
    return out


@torch.library.custom_op("miaohui::skinny_linear", mutates_args=())
def skinny_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    """The encoder's ``linear(x, w, bias)`` (+ tanh GELU): :func:`skinny_linear` where :data:`SKINNY_BEST` has the
    product's (rows, N, K), else what the engine runs without it (cuBLAS; its GELU epilogue for the FFN)."""
    k = x.shape[-1]
    m = x.numel() // k
    cfg = SKINNY_BEST.get((m, w.shape[0], k)) if x.is_cuda and triton is not None else None
    if cfg is not None:
        return skinny_linear(x, w, bias, cfg, gelu=gelu, pdl=SKINNY_PDL)
    if gelu:
        if x.is_cuda:  # cuBLASLt's GEMM + bias + GELU (tanh) epilogue, as fast_bert's fused_gelu
            out = torch._addmm_activation(bias, x.reshape(m, k), w.t(), use_gelu=True)
            return out.view(*x.shape[:-1], w.shape[0])
        return torch.nn.functional.gelu(torch.nn.functional.linear(x, w, bias), approximate="tanh")
    return torch.nn.functional.linear(x, w, bias)


@skinny_op.register_fake
def _skinny_fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))
