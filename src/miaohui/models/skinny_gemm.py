"""A Triton GEMM for the encoder's few-row products (``x`` [M, K] @ ``w`` [N, K]ᵀ + bias, optional tanh GELU) with
small tiles and split K, for the rows an intent request has (M = batch × sequence ≈ 16–512).

Why: at 128 rows a library GEMM's 128-wide output tile leaves most of a large GPU's SMs idle (an H200 has 132), and
each of BERT-base's GEMMs then takes several times what reading its weights at the HBM rate would; smaller tiles and
K split over programs give the SMs work. cuBLAS stays the reference form (``miaohui::skinny_linear`` runs it for every
product the tuning file has no entry for).

In the engine with ``gpu_kernels tuned`` at the rows of the GPU's tuning file (:mod:`miaohui.models.tuning`),
launched with PDL; arithmetic checked on the CPU under Triton's interpreter (``tests/unit/test_skinny_gemm.py``,
``test_skinny_ln.py``); ``scripts/gpu/tune.py`` times it against cuBLAS.
"""

from __future__ import annotations

import functools

import torch

from miaohui.models.cublaslt import Algo, LtLinear
from miaohui.models.tuning import SkinnyConfig

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

SKINNY_SWEEP: list[SkinnyConfig] = [
    (bm, bn, bk, split, 4) for bm in (16, 32, 64) for bn in (32, 64, 128) for bk in (64, 128) for split in (1, 2, 4)
]
"""The configurations ``scripts/gpu/tune.py`` times per product (those with BLOCK_M ≤ M)."""

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
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        ws_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        K_ITERS: tl.constexpr,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GELU: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ) -> None:
        """A [BLOCK_M, BLOCK_N] output tile over one of SPLIT slices of K; SPLIT 1 applies bias/GELU and stores,
        otherwise fp32 partials go to ``ws`` [SPLIT, M, N] for :func:`_skinny_reduce`. ``PDL``: launched as a
        programmatic dependent of the kernel before it (see :func:`skinny_linear`)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch now; it waits as this one does
            tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x) are complete and visible
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_product(
            x_ptr, w_ptr, rm, rn, pid_k, M, N, K, stride_xm, stride_wn, K_ITERS, BLOCK_M, BLOCK_N, BLOCK_K
        )
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if GELU:
                acc = _gelu_tanh(acc)
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)

    @triton.jit
    def _skinny_reduce(
        ws_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        stride_om,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GELU: tl.constexpr,
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
        if GELU:
            acc = _gelu_tanh(acc)
        tl.store(out_ptr + (offs // N) * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _layer_norm_rows(v, mask, rn, N, g_ptr, beta_ptr, eps):  # no annotations: see above
        """LayerNorm of the fp32 rows ``v`` [rows, BLOCK_N ≥ N] (columns ``rn``, valid where ``mask``): two-pass
        variance, then ``g`` and ``beta``."""
        mean = tl.sum(v, 1) / N
        d = tl.where(mask, v - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / N + eps)
        g = tl.load(g_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        return d * rstd[:, None] * g[None, :] + beta[None, :]

    @triton.jit
    def _skinny_reduce_ln(
        ws_ptr,
        b_ptr,
        r_ptr,
        g_ptr,
        beta_ptr,
        out_ptr,
        M,
        N,
        stride_rm,
        stride_om,
        eps,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,
    ) -> None:
        """``LayerNorm(Σ partials + bias + r)`` for ROWS whole rows a program (BLOCK_N ≥ N): a split-K product's
        reduce that also does the residual add and the LayerNorm after it (fp32, two-pass variance)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rn = tl.arange(0, BLOCK_N)
        cmask = rn < N
        mask = (rm[:, None] < M) & cmask[None, :]
        v = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += tl.load(b_ptr + rn, mask=cmask, other=0.0).to(tl.float32)[None, :]
        for i in tl.static_range(SPLIT):
            v += tl.load(ws_ptr + (i * M + rm[:, None]) * N + rn[None, :], mask=mask, other=0.0)
        y = _layer_norm_rows(v, mask, rn, N, g_ptr, beta_ptr, eps)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    gelu: bool = False,
    pdl: bool = False,
    residual_ln: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` (then tanh GELU when ``gelu``) for ``x`` [..., K] and ``w`` [N, K] of one dtype, with
    ``config`` (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps); SPLIT > 1 adds a kernel that sums fp32 partials.

    ``residual_ln`` (residual [..., N], gamma, beta, eps; SPLIT > 1, no GELU): ``F.layer_norm(residual + F.linear(x,
    w, bias))`` instead, the residual add and the LayerNorm done by the kernel that sums the partials (it holds whole
    rows): the add + LayerNorm kernel after the product is gone.

    ``pdl``: Hopper's programmatic dependent launch. The kernels are launched with
    ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` and begin with ``griddepcontrol.launch_dependents`` then
    ``griddepcontrol.wait``: a kernel may be launched while the one before it still runs, and waits on the GPU for
    that one's writes, instead of launching after it has ended (a latency of each of the ~120 kernels of a 1×128
    BERT-base call)."""
    if triton is None:
        raise RuntimeError("skinny_linear needs Triton (it comes with CUDA builds of torch)")
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or x.dtype != w.dtype:
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}: need w [N, K] and x [..., K] "
            "of the same dtype"
        )
    block_m, block_n, block_k, split, warps = config
    lead = x.shape[:-1]
    x2 = rows_of(x)
    w = w if w.stride(-1) == 1 else w.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if residual_ln is not None:
        residual = residual_ln[0]
        if split < 2 or gelu:
            raise ValueError(f"skinny_linear: residual_ln needs a config that splits K and no GELU, not {config}")
        if residual.shape != (*lead, n) or residual_ln[1].shape != (n,) or residual_ln[2].shape != (n,):
            raise ValueError(
                f"skinny_linear: residual {tuple(residual.shape)}, gamma {tuple(residual_ln[1].shape)}, beta "
                f"{tuple(residual_ln[2].shape)}: need {(*lead, n)}, ({n},), ({n},)"
            )
    k_iters = triton.cdiv(triton.cdiv(k, split), block_k)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else w
    flags = {"HAS_BIAS": bias is not None, "GELU": gelu}
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _skinny_kernel[grid](
        x2, w, b, out, ws, m, n, k, x2.stride(0), w.stride(0), out.stride(0),
        K_ITERS=k_iters, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, PDL=pdl,
        launch_pdl=pdl, **flags,
    )  # fmt: skip
    if residual_ln is not None:
        r2 = rows_of(residual_ln[0])
        _skinny_reduce_ln[(m,)](
            ws, b, r2, residual_ln[1], residual_ln[2], out, m, n, r2.stride(0), out.stride(0), residual_ln[3],
            SPLIT=split, HAS_BIAS=bias is not None, ROWS=1, BLOCK_N=triton.next_power_of_2(n), num_warps=4, PDL=pdl,
            launch_pdl=pdl,
        )  # fmt: skip
    elif split > 1:
        _skinny_reduce[(triton.cdiv(m * n, 1024),)](
            ws, b, out, m, n, out.stride(0), SPLIT=split, BLOCK=1024, PDL=pdl, launch_pdl=pdl, **flags
        )
    return out.reshape(*lead, n)


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last dim] with unit stride along the last dim (a view where it can be), as kernels read it."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


SKINNY_BEST: dict[tuple[int, int, int], SkinnyConfig] = {}
"""(M, N, K) → the configuration to run, for the products where the tuning file has one; every other product keeps
cuBLAS. Filled by ``kernel_tables.apply``."""


SKINNY_PDL = False
"""Launch the table's kernels as programmatic dependents (:func:`skinny_linear`'s ``pdl``): set with the table by
``kernel_tables.apply``."""


LT_BEST: dict[tuple[int, int, int, bool], str] = {}
"""(M, N, K, GELU) → the cuBLASLt algorithm to run (:mod:`miaohui.models.cublaslt`), as its 64 bytes in hex, for the
products where the tuning file timed one faster than the heuristic's pick that torch runs; a call with ``lt`` True
runs it (fp16 only, where :data:`SKINNY_BEST` has no entry). Filled by ``kernel_tables.apply`` when this process's
cuBLASLt is the version the file was measured with."""

_LT_PLANS: dict[tuple[int, int, int, bool, torch.dtype], LtLinear] = {}


def lt_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, gelu: bool, algo: Algo | str) -> torch.Tensor:
    """``linear(x, w, bias)`` (+ tanh GELU) as one cuBLASLt call with ``algo`` (its plan cached per problem)."""
    k = x.shape[-1]
    m, n = x.numel() // k, w.shape[0]
    key = (m, n, k, gelu, x.dtype)
    plan = _LT_PLANS.get(key)
    if plan is None:
        plan = _LT_PLANS[key] = LtLinear(m, n, k, x.dtype, "gelu_bias" if gelu else "bias")
    algo = _algo(algo) if isinstance(algo, str) else algo
    out = plan(x.reshape(m, k).contiguous(), w.contiguous(), bias.contiguous(), algo)
    return out.view(*x.shape[:-1], n)


@functools.cache
def _algo(text: str) -> Algo:
    """A table's algorithm, parsed once (an eager call, e.g. a ``fast_start`` engine's, runs this per GEMM)."""
    return Algo.from_hex(text)


@torch.library.custom_op("miaohui::skinny_linear", mutates_args=())
def skinny_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, gelu: bool, lt: bool = False) -> torch.Tensor:
    """:func:`skinny_call` as an op of its own (opaque to ``torch.export`` and Inductor)."""
    return skinny_call(x, w, bias, gelu, lt)


def skinny_call(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, gelu: bool, lt: bool = False) -> torch.Tensor:
    """The encoder's ``linear(x, w, bias)`` (+ tanh GELU): :func:`skinny_linear` where :data:`SKINNY_BEST` has the
    product's (rows, N, K); else, with ``lt``, cuBLASLt with :data:`LT_BEST`'s algorithm where it has one; else what
    the engine runs without either (cuBLAS; its GELU epilogue for the FFN)."""
    k = x.shape[-1]
    m = x.numel() // k
    cfg = SKINNY_BEST.get((m, w.shape[0], k)) if x.is_cuda and triton is not None else None
    if cfg is not None:
        return skinny_linear(x, w, bias, cfg, gelu=gelu, pdl=SKINNY_PDL)
    algo = LT_BEST.get((m, w.shape[0], k, gelu)) if lt and x.is_cuda and x.dtype == torch.float16 else None
    if algo is not None:
        return lt_linear(x, w, bias, gelu, algo)
    if gelu:
        if x.is_cuda:  # cuBLASLt's GEMM + bias + GELU (tanh) epilogue, as fast_bert's fused_gelu
            out = torch._addmm_activation(bias, x.reshape(m, k), w.t(), use_gelu=True)
            return out.view(*x.shape[:-1], w.shape[0])
        return torch.nn.functional.gelu(torch.nn.functional.linear(x, w, bias), approximate="tanh")
    return torch.nn.functional.linear(x, w, bias)


@skinny_op.register_fake
def _skinny_fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, gelu: bool, lt: bool = False) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))
