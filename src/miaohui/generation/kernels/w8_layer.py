"""One-row int8 kernels that also do their layer's neighbouring work (``SlotEngineOptions.int8_kernel: gemv_layer``).

With only the RMSNorm and residual folded into the matrix-vector products
(:func:`miaohui.generation.kernels.w8a16.w8_gemv`), a decode layer at batch 1 is nine kernels: four products, RoPE of
the query, RoPE of the key with the KV-cache write, SiLU·up, and the attention's two; the small ones cost a launch and
a gap each for a few KB of work. Here two products take them in:

* :func:`w8_gemv_rope` — the QKV product with RMSNorm, bias, RoPE of the query and key heads, and the key/value
  written into the cache at the row's position; returns the query. Its weight rows are stored pair-wise per head
  (:func:`pair_halves`: row ``i`` next to row ``i + D/2``), so each program holds both halves that RoPE mixes.
* :func:`w8_gemv_glu` — the gate/up product with RMSNorm and SwiGLU: rows stored gate, up, gate, up…
  (:func:`interleave_glu`), the program's epilogue writes ``silu(gate) · up``.

So a layer is six kernels. Both keep the matrix-vector loop of :func:`~miaohui.generation.kernels.w8a16.w8_gemv` (one
slice of K per program, no split) and its measured tile per weight shape.

They sit behind custom ops (opaque to ``torch.compile``, captured by CUDA graphs); on the CPU, or without Triton, the
ops compute the same in torch. Checked on the CPU under Triton's interpreter and compiled for compute capability 9.0
(``tests/unit/test_w8_layer.py``); on the H200 in bf16 (``tests/gpu/test_w8_layer_gpu.py``).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from miaohui.generation.kernels.w8a16 import GemvConfig, gemv_config

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


ROPE_BEST: dict[tuple[int, int], GemvConfig] = {
    (2048, 1536): (4, 512, 1, 4),  # Qwen2.5-1.5B QKV: 3.68 µs as a plain product (scripts/gpu/gemv_sweep.py)
}
"""(N, K) → the tile of the QKV kernel: an even BLOCK_N (whole RoPE pairs per program); the one-row kernel's
sweep's best such tile for the shape (plain product, no epilogue)."""


def pair_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows ``[heads · D, ...]`` (or a bias ``[heads · D]``) reordered per head as ``0, D/2, 1, D/2 + 1, …``: the
    pair that RoPE rotates together sits in adjacent rows."""
    half = head_dim // 2
    rest = w.shape[1:]
    return w.reshape(-1, 2, half, *rest).transpose(1, 2).reshape(w.shape)


def unpair_halves(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """:func:`pair_halves` undone on the last dim of ``y``."""
    half = head_dim // 2
    lead = y.shape[:-1]
    return y.reshape(*lead, -1, half, 2).transpose(-1, -2).reshape(*lead, y.shape[-1])


def interleave_glu(w: torch.Tensor) -> torch.Tensor:
    """A gate/up weight ``[2I, K]`` (gate rows, then up rows) as gate 0, up 0, gate 1, up 1, …"""
    half = w.shape[0] // 2
    return w.reshape(2, half, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


if triton is not None:

    @triton.jit
    def _row_products(
        x_ptr,
        w_ptr,
        rn,
        nmask,
        K,
        stride_wn,
        eps,
        K_ITERS: tl.constexpr,
        RMS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """``x · w[rn]`` in fp32 (times ``rsqrt(mean(x²) + eps)`` with ``RMS``), as in ``w8a16._gemv_kernel``."""
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        sumsq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for it in range(K_ITERS):
            rk = it * BLOCK_K + tl.arange(0, BLOCK_K)
            kmask = rk < K
            x = tl.load(x_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
            acc += w.to(tl.float32) * x[None, :]
            if RMS:
                sumsq += x * x
        row = tl.sum(acc, axis=1)
        if RMS:
            row = row * tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
        return row

    @triton.jit
    def _gemv_glu_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        N,
        K,
        stride_wn,
        eps,
        K_ITERS: tl.constexpr,
        RMS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ) -> None:
        """``BLOCK_N`` interleaved gate/up rows per program → ``BLOCK_N / 2`` outputs ``silu(gate) · up``."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        row = _row_products(x_ptr, w_ptr, rn, nmask, K, stride_wn, eps, K_ITERS, RMS, BLOCK_N, BLOCK_K)
        row = row * tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        gate, up = tl.split(tl.reshape(row, (BLOCK_N // 2, 2)))
        ro = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + ro, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ro < N // 2)

    @triton.jit
    def _gemv_rope_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        N,
        K,
        stride_wn,
        stride_cos,
        stride_kh,
        stride_kt,
        stride_vh,
        stride_vt,
        eps,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        K_ITERS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RMS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ) -> None:
        """``BLOCK_N / 2`` RoPE pairs (rows stored by :func:`pair_halves`) per program: products, scale, bias, then
        the rotation for query and key heads; queries go to ``q``, keys and values into cache row 0 at the
        position ``pos_ptr[0]``."""
        P: tl.constexpr = BLOCK_N // 2
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        row = _row_products(x_ptr, w_ptr, rn, nmask, K, stride_wn, eps, K_ITERS, RMS, BLOCK_N, BLOCK_K)
        row = row * tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            row += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(row, (P, 2)))  # dims i and i + HALF of head h
        p = pid * P + tl.arange(0, P)
        pmask = p < N // 2
        h = p // HALF
        i = p % HALF
        pos = tl.load(pos_ptr)
        cos_a = tl.load(cos_ptr + pos * stride_cos + i)
        cos_b = tl.load(cos_ptr + pos * stride_cos + i + HALF)
        sin_a = tl.load(sin_ptr + pos * stride_cos + i)
        sin_b = tl.load(sin_ptr + pos * stride_cos + i + HALF)
        rotate = h < HEADS + KV_HEADS
        out_a = tl.where(rotate, a * cos_a - b * sin_a, a)
        out_b = tl.where(rotate, b * cos_b + a * sin_b, b)
        is_q = pmask & (h < HEADS)
        is_k = pmask & (h >= HEADS) & rotate
        is_v = pmask & (h >= HEADS + KV_HEADS)
        dt = q_ptr.dtype.element_ty
        qo = h * (2 * HALF) + i
        tl.store(q_ptr + qo, out_a.to(dt), mask=is_q)
        tl.store(q_ptr + qo + HALF, out_b.to(dt), mask=is_q)
        ko = (h - HEADS) * stride_kh + pos * stride_kt + i
        tl.store(k_ptr + ko, out_a.to(dt), mask=is_k)
        tl.store(k_ptr + ko + HALF, out_b.to(dt), mask=is_k)
        vo = (h - HEADS - KV_HEADS) * stride_vh + pos * stride_vt + i
        tl.store(v_ptr + vo, out_a.to(dt), mask=is_v)
        tl.store(v_ptr + vo + HALF, out_b.to(dt), mask=is_v)


def _tile(n: int, k: int, config: GemvConfig | None, best: dict[tuple[int, int], GemvConfig]) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): ``config`` or the measured tile, BLOCK_N a power of two of at least 2 (whole
    pairs; ``tl.arange`` takes powers of two)."""
    block_n, block_k, _, warps = config or best.get((n, k)) or gemv_config(n, k)
    return max(2, 1 << (block_n - 1).bit_length()), block_k, warps


def _check(name: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    n, k = q.shape
    if q.dtype != torch.int8 or x.numel() != k or x.shape[-1] != k or scale.shape != (n,) or n % 2:
        raise ValueError(
            f"{name}: x {tuple(x.shape)}, q {tuple(q.shape)} {q.dtype}, scale {tuple(scale.shape)}: "
            "need one row x [..., K], q int8 [N, K] with N even, scale [N]"
        )
    return n, k


def w8_gemv_glu(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rms_eps: float | None, config: GemvConfig | None = None
) -> torch.Tensor:
    """One row's ``silu(gate) · up`` [..., N/2] of ``(rsqrt(mean(x²) + eps) ·)? x @ (q * scale).T`` with ``q``'s rows
    stored by :func:`interleave_glu` (and the RMSNorm's weight folded into them)."""
    if triton is None:
        raise RuntimeError("w8_gemv_glu needs Triton (it comes with CUDA builds of torch)")
    n, k = _check("w8_gemv_glu", x, q, scale)
    block_n, block_k, warps = _tile(n, k, config, {})
    out = torch.empty(n // 2, dtype=x.dtype, device=x.device)
    _gemv_glu_kernel[(triton.cdiv(n, block_n),)](
        x.reshape(k).contiguous(), q, scale, out, n, k, q.stride(0), 0.0 if rms_eps is None else float(rms_eps),
        K_ITERS=triton.cdiv(k, block_k), RMS=rms_eps is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n // 2)


def w8_gemv_rope(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    rms_eps: float | None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """One row's QKV product (rows by :func:`pair_halves`), RoPE at ``positions[0]`` (``cos``/``sin`` tables
    [max_len, D]), keys and values written into row 0 of ``k_cache``/``v_cache`` [slots, KVH, T, D] at that position;
    returns the rotated query [1, heads, D]."""
    if triton is None:
        raise RuntimeError("w8_gemv_rope needs Triton (it comes with CUDA builds of torch)")
    n, k = _check("w8_gemv_rope", x, q, scale)
    kv_heads, d = k_cache.shape[1], k_cache.shape[3]
    if n != (heads + 2 * kv_heads) * d or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or d % 2:
        raise ValueError(
            f"w8_gemv_rope: q {tuple(q.shape)} for {heads} heads and caches {tuple(k_cache.shape)}: need "
            f"N = (heads + 2 · KV heads) · D = {(heads + 2 * kv_heads) * d} and contiguous head dims"
        )
    block_n, block_k, warps = _tile(n, k, config, ROPE_BEST)
    out = torch.empty((1, heads, d), dtype=x.dtype, device=x.device)
    _gemv_rope_kernel[(triton.cdiv(n, block_n),)](
        x.reshape(k).contiguous(), q, scale, bias if bias is not None else scale, positions, cos, sin, out,
        k_cache, v_cache, n, k, q.stride(0), cos.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1),
        v_cache.stride(2), 0.0 if rms_eps is None else float(rms_eps),
        HEADS=heads, KV_HEADS=kv_heads, HALF=d // 2, K_ITERS=triton.cdiv(k, block_k), HAS_BIAS=bias is not None,
        RMS=rms_eps is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return out


def _product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """The ops' torch form of the product: fp32 RMS of x (``rms_eps`` > 0), then ``F.linear`` in x's dtype."""
    h = x
    if rms_eps > 0:
        hf = x.float()
        h = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + rms_eps)).to(x.dtype)
    return F.linear(h, q.to(x.dtype)) * scale


@torch.library.custom_op("miaohui::w8_gemv_glu", mutates_args=())
def w8_gemv_glu_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """:func:`w8_gemv_glu` on CUDA (``rms_eps`` ≤ 0: no norm); the same arithmetic in torch elsewhere."""
    if x.is_cuda and triton is not None:
        return w8_gemv_glu(x, q, scale, rms_eps if rms_eps > 0 else None)
    y = _product(x, q, scale, rms_eps).float()
    gate, up = y.reshape(*y.shape[:-1], -1, 2).unbind(-1)
    return (F.silu(gate) * up).to(x.dtype)


@w8_gemv_glu_op.register_fake
def _w8_gemv_glu_fake(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rms_eps: float) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], q.shape[0] // 2))


@torch.library.custom_op("miaohui::w8_gemv_rope", mutates_args=("k_cache", "v_cache"))
def w8_gemv_rope_op(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    rms_eps: float,
) -> torch.Tensor:
    """:func:`w8_gemv_rope` on CUDA (``rms_eps`` ≤ 0: no norm); the same in torch elsewhere (RoPE in fp32 of the
    product rounded to x's dtype, as the layer's :func:`~miaohui.generation.models.static_kv_layers.attn_in` computes
    it)."""
    if x.is_cuda and triton is not None:
        return w8_gemv_rope(x, q, scale, bias, positions, cos, sin, k_cache, v_cache, heads, rms_eps or None)
    kv_heads, d = k_cache.shape[1], k_cache.shape[3]
    y = _product(x, q, scale, rms_eps)
    if bias is not None:
        y = y + bias
    y = unpair_halves(y.reshape(-1), d).reshape(heads + 2 * kv_heads, d)
    pos = positions.reshape(-1)[:1]
    c, s = cos[pos], sin[pos]  # [1, D]
    half = d // 2

    def rope(t: torch.Tensor) -> torch.Tensor:
        h = t.float()
        return (h * c + torch.cat((-h[:, half:], h[:, :half]), dim=-1) * s).to(t.dtype)

    qr, kr, v = rope(y[:heads]), rope(y[heads : heads + kv_heads]), y[heads + kv_heads :]
    k_cache[0, :, pos] = kr[:, None].to(k_cache.dtype)
    v_cache[0, :, pos] = v[:, None].to(v_cache.dtype)
    return qr[None]


@w8_gemv_rope_op.register_fake
def _w8_gemv_rope_fake(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    rms_eps: float,
) -> torch.Tensor:
    return x.new_empty((1, heads, k_cache.shape[3]))
