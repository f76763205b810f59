"""miaohui's one-row weight-only int8 kernel for decode steps (``SlotEngineOptions.int8_batch1``): ``out = x @ (q *
scale).T (+ bias)`` for a single row, reading the int8 weight bytes and widening them in registers.

:func:`w8_gemv` is a matrix-vector kernel, ``BLOCK_N`` outputs per program, K optionally split over programs, no
tensor cores (at one row they would only pad the row to 16); one tile per weight shape (:data:`GEMV_BEST`, measured
by ``scripts/gpu/gemv_sweep.py``). Its fused forms take the RMS of the input (an RMSNorm whose weight is folded into
the int8 copy) and add the residual in the epilogue. It sits behind the custom op
``torch.ops.miaohui.w8_gemv_fused`` (opaque to ``torch.compile``, so compiled decode pieces call it and CUDA graphs
capture it); on the CPU, or without Triton, the op computes the same arithmetic in torch. Checked on the CPU under
Triton's interpreter and compiled for compute capability 9.0 (``tests/unit/test_w8a16.py``); on the H200 inside the
engine's graphs (``tests/gpu/test_slot_engine_gpu.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        r_ptr,
        out_ptr,
        ws_ptr,
        N,
        K,
        stride_wn,
        eps,
        K_ITERS: tl.constexpr,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        RMS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ) -> None:
        """One row: ``BLOCK_N`` outputs × one of ``SPLIT`` slices of K per program; products accumulate in a
        [BLOCK_N, BLOCK_K] fp32 tile summed once at the end. SPLIT 1 stores the finished row; otherwise fp32 partials
        go to ``ws`` [SPLIT, N] for :func:`_gemv_reduce`. ``RMS`` (SPLIT 1 only): the row is ``x``'s RMS-normalized
        product, ``rsqrt(mean(x²) + eps) · (q x)`` — the norm's own weight folded into ``q`` beforehand — with the sum
        of squares taken from the same loads of x. ``HAS_RES``: the residual ``r`` is added last."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        sumsq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        k_start = pid_k * (K_ITERS * BLOCK_K)
        for it in range(K_ITERS):  # a compile-time trip count per (K, SPLIT, BLOCK_K): K is one of a model's widths
            rk = k_start + it * BLOCK_K + tl.arange(0, BLOCK_K)
            kmask = rk < K
            x = tl.load(x_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
            acc += w.to(tl.float32) * x[None, :]
            if RMS:
                sumsq += x * x
        row = tl.sum(acc, axis=1)
        if SPLIT == 1:
            row = row * tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
            if RMS:
                row = row * tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
            if HAS_BIAS:
                row += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
            if HAS_RES:
                row += tl.load(r_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rn, row.to(out_ptr.dtype.element_ty), mask=nmask)
        else:
            tl.store(ws_ptr + pid_k * N + rn, row, mask=nmask)

    @triton.jit
    def _gemv_reduce(
        ws_ptr,
        s_ptr,
        b_ptr,
        r_ptr,
        out_ptr,
        N,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
    ) -> None:
        rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        nmask = rn < N
        row = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.static_range(SPLIT):
            row += tl.load(ws_ptr + i * N + rn, mask=nmask, other=0.0)
        row = row * tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            row += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        if HAS_RES:
            row += tl.load(r_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, row.to(out_ptr.dtype.element_ty), mask=nmask)


GemvConfig = tuple[int, int, int, int]
"""(BLOCK_N, BLOCK_K, SPLIT, num_warps) of the one-row kernel."""

GEMV_SWEEP: list[GemvConfig] = [
    (bn, bk, split, warps)
    for bn in (1, 2, 4, 8, 16, 32)
    for bk in (256, 512, 1024, 2048, 4096)
    for split in (1, 2, 4, 8)
    for warps in (4, 8)
    if bn * bk <= 16384 and (warps == 4 or bn * bk >= 4096)  # 8 warps only for tiles that give them work
]
"""Every configuration ``scripts/gpu/gemv_sweep.py`` times on the GPU."""

GEMV_BEST: dict[tuple[int, int], GemvConfig] = {
    (2048, 1536): (1, 512, 1, 4),  # Qwen2.5-1.5B QKV: 3.4 µs
    (1536, 1536): (1, 512, 1, 4),  # o: 3.2 µs
    (17920, 1536): (8, 512, 1, 4),  # gate/up: 11.2 µs
    (1536, 8960): (1, 1024, 1, 4),  # down: 7.5 µs
    (151936, 1536): (32, 256, 2, 8),  # LM head: 70.7 µs
}
"""(N, K) → the fastest configuration measured for that weight shape: the 1.5B Qwen2.5 shape's five GEMMs on the
H200 (``scripts/gpu/gemv_sweep.py``)."""


def gemv_config(n: int, k: int) -> GemvConfig:
    """The measured choice for (N, K), else the one measured for the nearest class of N: one output per program up to
    4,096 outputs (BLOCK_K 1,024 for K over 4,096), 8 up to 32,768, a vocabulary's 32 with K split in two."""
    if (n, k) in GEMV_BEST:
        return GEMV_BEST[(n, k)]
    if n <= 4096:
        return (1, 1024 if k > 4096 else 512, 1, 4)
    return (8, 512, 1, 4) if n <= 32768 else (32, 256, 2, 8)


def best_from_sweeps(reports: list[dict[str, Any]]) -> dict[tuple[int, int], GemvConfig]:
    """The fastest configuration per (N, K) over ``gemv_sweep.py`` reports (their ``best`` entries)."""
    found: dict[tuple[int, int], tuple[float, GemvConfig]] = {}
    for report in reports:
        for entry in report["best"].values():
            key = (int(entry["n"]), int(entry["k"]))
            if key not in found or entry["us"] < found[key][0]:
                bn, bk, split, warps = (int(v) for v in entry["config"])
                found[key] = (float(entry["us"]), (bn, bk, split, warps))
    return {key: cfg for key, (_, cfg) in found.items()}


def w8_gemv(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    *,
    residual: torch.Tensor | None = None,
    rms_eps: float | None = None,
) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T (+ bias)`` for one row (``x`` [K] or [1, K]; ``q`` int8 [N, K], ``scale`` [N]).
    ``config`` (BLOCK_N, BLOCK_K, SPLIT, num_warps) defaults to :func:`gemv_config`'s choice for the weight's shape;
    SPLIT > 1 splits K over that many programs per output block and adds a second small kernel that sums their fp32
    partials.

    Fused forms: ``rms_eps`` multiplies the product by ``rsqrt(mean(x²) + eps)`` — an RMSNorm of x whose weight was
    folded into ``q`` — before the bias (forces SPLIT 1: every program sees all of K); ``residual`` [N] (or x's
    leading dims × N) is added to the result."""
    if triton is None:
        raise RuntimeError("w8_gemv needs Triton (it comes with CUDA builds of torch)")
    n, k = q.shape
    if q.dtype != torch.int8 or x.numel() != k or x.shape[-1] != k or scale.shape != (n,):
        raise ValueError(
            f"w8_gemv: x {tuple(x.shape)}, q {tuple(q.shape)} {q.dtype}, scale {tuple(scale.shape)}: "
            "need one row x [..., K] (1 row), q int8 [N, K], scale [N]"
        )
    if residual is not None and residual.numel() != n:
        raise ValueError(f"w8_gemv: residual {tuple(residual.shape)} for {n} outputs: need N = {n} values")
    block_n, block_k, split, warps = config or gemv_config(n, k)
    if rms_eps is not None:
        split = 1
    x1 = x.reshape(k)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    res = residual.reshape(n).contiguous() if residual is not None else scale
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    k_iters = triton.cdiv(triton.cdiv(k, split), block_k)  # BLOCK_K steps per slice of K
    ws = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else scale
    flags = {"HAS_BIAS": bias is not None, "HAS_RES": residual is not None}
    _gemv_kernel[(triton.cdiv(n, block_n), split)](
        x1, q, scale, b, res, out, ws, n, k, q.stride(0), 0.0 if rms_eps is None else float(rms_eps),
        K_ITERS=k_iters, SPLIT=split, RMS=rms_eps is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **flags,
    )  # fmt: skip
    if split > 1:
        _gemv_reduce[(triton.cdiv(n, 1024),)](ws, scale, b, res, out, n, SPLIT=split, BLOCK=1024, **flags)
    return out.reshape(*x.shape[:-1], n)


@torch.library.custom_op("miaohui::w8_gemv_fused", mutates_args=())
def w8_gemv_fused_op(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    rms_eps: float,
) -> torch.Tensor:
    """One row's ``[residual +] (rsqrt(mean(x²) + eps) ·)? x @ (q * scale).T [+ bias]`` (``rms_eps`` ≤ 0: no norm):
    :func:`w8_gemv` on CUDA, the same arithmetic in torch elsewhere (the RMSNorm's weight is folded into ``q``)."""
    if x.is_cuda and triton is not None:
        return w8_gemv(x, q, scale, bias, residual=residual, rms_eps=rms_eps if rms_eps > 0 else None)
    h = x
    if rms_eps > 0:
        hf = x.float()
        h = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + rms_eps)).to(x.dtype)
    out = F.linear(h, q.to(x.dtype)) * scale
    if bias is not None:
        out = out + bias
    return out if residual is None else residual + out


@w8_gemv_fused_op.register_fake
def _w8_gemv_fused_fake(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    rms_eps: float,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], q.shape[0]))
