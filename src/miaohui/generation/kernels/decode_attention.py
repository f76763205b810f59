"""miaohui's decode attention (``SlotEngineOptions.decode_attention: triton``, the default): grouped-query attention of
one new token per row over the static KV cache, as split-KV flash decoding in two Triton kernels.

The reference form (``matmul``, :func:`matmul_decode_attention`) attends with two batched matmuls around a softmax:
three kernels per layer that read the whole attended-length bucket whatever each row's position. Here one program
takes a (row, KV head, slice of the cache) and all the query heads that share that KV head (padded to 16 rows for
``tl.dot``), runs an online softmax over the slice up to the row's own position only, and writes its running max, sum
and weighted values; a second kernel, one program per (row, query head), merges the slices. Slices are sized so that
rows × KV heads × slices fills the GPU even at batch 1.

Behind the custom op ``torch.ops.miaohui.decode_attention`` (opaque to ``torch.compile``, captured by CUDA graphs).
Elsewhere (the CPU, no Triton, a head size that is not a power of two) the op computes the same attention with
matmuls. Checked on the CPU under Triton's interpreter and compiled for compute capability 9.0
(``tests/unit/test_decode_attention.py``); on the H200 inside the engine's graphs
(``tests/gpu/test_slot_engine_gpu.py``).
"""

from __future__ import annotations

import math

import torch

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

BLOCK_T = 32
"""Cache positions per inner step of a program at batch 1; 64 for more rows (``BLOCK_T_BATCHED``): the best of
``scripts/gpu/decode_attention_probe.py --sweep`` on the H200 at the 1.5B shape (within 0.5 µs per layer where
another size won)."""
BLOCK_T_BATCHED = 64
TARGET_PROGRAMS = 264
"""Programs the first kernel aims for (two per SM of an H200), by slicing the cache."""


if triton is not None:

    @triton.jit
    def attend_block(
        q,
        k_base,
        v_base,
        t,
        tmask,
        allowed,
        d,
        stride_kt,
        stride_vt,
        sm_scale,
        m_i,
        l_i,
        acc,
        PRECISION: tl.constexpr,
    ):
        """One step of the online softmax (inlined into its caller): query rows ``q`` [rows, D] against cache
        positions ``t`` [BLOCK] of one KV head (``tmask``: the positions to load; ``allowed``: which scores count,
        [rows, BLOCK] or broadcast to it), carrying each row's max score ``m_i``, exp-sum ``l_i`` and exp-weighted
        values ``acc``; returns them updated. The decode and the prefix-hit kernels' shared inner loop."""
        k = tl.load(k_base + t[:, None] * stride_kt + d[None, :], mask=tmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # [rows, BLOCK]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp(-inf - 0) = 0, not NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        v = tl.load(v_base + t[:, None] * stride_vt + d[None, :], mask=tmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        return m_new, l_i, acc

    @triton.jit
    def _partial_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        pos_ptr,
        rows_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        sm_scale,
        KVH: tl.constexpr,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        CHUNK: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
        INDIRECT: tl.constexpr,
    ) -> None:
        """Program (row · KVH + kv head, slice): the GROUP query heads of that KV head against cache positions
        [slice · CHUNK, min((slice + 1) · CHUNK, position + 1)); writes the slice's max score, exp-sum and
        exp-weighted values (an empty slice writes -inf, 0, 0). ``INDIRECT``: the row's cache row is
        ``rows_ptr[row]`` (a mixed step's decode rows: idle ones read the scratch row), else the row itself."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        row = pid // KVH
        head = pid % KVH
        pos = tl.load(pos_ptr + row)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        gmask = g < GROUP
        q = tl.load(
            q_ptr + row * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None],
            other=0.0,
        )
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, pos + 1)
        if INDIRECT:  # noqa: SIM108 — a compile-time branch: only the taken one is generated
            crow = tl.load(rows_ptr + row)
        else:
            crow = row
        k_base = k_ptr + crow * stride_kb + head * stride_kh
        v_base = v_ptr + crow * stride_vb + head * stride_vh
        for it in range(CHUNK // BLOCK):  # a compile-time trip count; blocks past `end` load nothing (masked)
            t0 = start + it * BLOCK
            t = t0 + tl.arange(0, BLOCK)
            tmask = t < end
            m_i, l_i, acc = attend_block(
                q, k_base, v_base, t, tmask, tmask[None, :], d, stride_kt, stride_vt, sm_scale, m_i, l_i, acc, PRECISION
            )
        part = pid * SPLITS + split
        tl.store(m_ptr + part * G_PAD + g, m_i, mask=gmask)
        tl.store(l_ptr + part * G_PAD + g, l_i, mask=gmask)
        tl.store(acc_ptr + (part * G_PAD + g)[:, None] * D + d[None, :], acc, mask=gmask[:, None])

    @triton.jit
    def _merge_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        out_ptr,
        stride_ob,
        stride_oh,
        KVH: tl.constexpr,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
        S_PAD: tl.constexpr,
    ) -> None:
        """Program (row · H + query head): merges that head's slices (one [S_PAD, D] load of their weighted values)
        into its output."""
        pid = tl.program_id(0)
        row = pid // (KVH * GROUP)
        qh = pid % (KVH * GROUP)
        parts = (row * KVH + qh // GROUP) * SPLITS + tl.arange(0, S_PAD)
        smask = tl.arange(0, S_PAD) < SPLITS
        at = parts * G_PAD + qh % GROUP
        m = tl.load(m_ptr + at, mask=smask, other=float("-inf"))
        w = tl.exp(m - tl.max(m, axis=0))  # the max is finite: the first slice always holds position 0
        total = tl.sum(w * tl.load(l_ptr + at, mask=smask, other=0.0), axis=0)
        d = tl.arange(0, D)
        live = smask & (m > float("-inf"))  # an empty slice's weighted values are not read (a writer may skip them)
        acc = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, axis=0) / total
        tl.store(out_ptr + row * stride_ob + qh * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def plan(rows: int, kv_heads: int, length: int, block: int = BLOCK_T, target: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(CHUNK, SPLITS): cache positions per slice (a multiple of ``block``) and slices per (row, KV head), enough
    slices for about ``target`` programs but none shorter than one block."""
    blocks = max(1, math.ceil(length / block))
    want = max(1, min(blocks, math.ceil(target / (rows * kv_heads))))
    chunk = math.ceil(blocks / want) * block
    return chunk, math.ceil(length / chunk)


def supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the Triton kernels take these shapes (a power-of-two head size of 16+, as ``tl.arange`` needs)."""
    d = q.shape[-1]
    return triton is not None and d >= 16 and d & (d - 1) == 0 and keys.stride(-1) == 1


def triton_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    block: int | None = None,
    target: int = TARGET_PROGRAMS,
    warps: int = 4,
) -> torch.Tensor:
    """``q`` [b, H, D] (one token per row) over ``keys``/``values`` [b, KVH, T, D] (cache views; row r attends to
    positions 0..positions[r]) → [b, H, D] in q's dtype. With ``cache_rows`` [b] (int64), row r attends in cache row
    ``cache_rows[r]`` of ``keys``/``values`` [S, KVH, T, D] instead (mixed steps). Written into ``out`` when given.
    ``block`` (default :data:`BLOCK_T` at one row, :data:`BLOCK_T_BATCHED` above), ``target`` (see :func:`plan`) and
    ``warps`` (of the first kernel) are what ``scripts/gpu/decode_attention_probe.py --sweep`` varies."""
    if triton is None:
        raise RuntimeError("triton_decode_attention needs Triton (it comes with CUDA builds of torch)")
    b, heads, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    rows_ok = keys.shape[0] == b if cache_rows is None else tuple(cache_rows.shape) == (b,)
    if keys.shape != values.shape or not rows_ok or keys.shape[3] != d or heads % kv_heads:
        raise ValueError(
            f"decode attention: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}: need "
            "q [b, H, D] and keys = values [b, KVH, T, D] (or [S, KVH, T, D] with cache_rows [b]) with H a multiple "
            "of KVH"
        )
    if not supported(q, keys) or values.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"decode attention: head size {d} must be a power of two ≥ 16, with contiguous last dims")
    group = heads // kv_heads
    block = block or (BLOCK_T if b == 1 else BLOCK_T_BATCHED)
    g_pad = max(16, triton.next_power_of_2(group))
    chunk, splits = plan(b, kv_heads, length, block, target)
    parts = b * kv_heads * splits
    m = torch.empty((parts, g_pad), dtype=torch.float32, device=q.device)
    s = torch.empty((parts, g_pad), dtype=torch.float32, device=q.device)
    acc = torch.empty((parts, g_pad, d), dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 engines stay exact; 16-bit inputs ignore it
    _partial_kernel[(b * kv_heads, splits)](
        q, keys, values, positions, positions if cache_rows is None else cache_rows, m, s, acc, q.stride(0),
        q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
        values.stride(2), d**-0.5,
        KVH=kv_heads, GROUP=group, G_PAD=g_pad, D=d, CHUNK=chunk, SPLITS=splits, BLOCK=block, PRECISION=precision,
        INDIRECT=cache_rows is not None, num_warps=warps,
    )  # fmt: skip
    _merge_kernel[(b * heads,)](
        m, s, acc, out, out.stride(0), out.stride(1),
        KVH=kv_heads, GROUP=group, G_PAD=g_pad, D=d, SPLITS=splits, S_PAD=triton.next_power_of_2(splits),
    )  # fmt: skip
    return out


def matmul_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention with matmuls and a softmax (the ``matmul`` decode path's arithmetic): the op's fallback and
    the tests' reference."""
    if cache_rows is not None:
        keys, values = keys.index_select(0, cache_rows), values.index_select(0, cache_rows)
    b, heads, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    allowed = torch.arange(length, device=q.device)[None, :] <= positions[:, None]
    bias = torch.where(allowed, 0.0, float("-inf"))[:, None, None, :]
    q4 = q.reshape(b, kv_heads, heads // kv_heads, d)
    scores = torch.matmul(q4, keys.transpose(-1, -2)).float() * (d**-0.5) + bias
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values).reshape(b, heads, d)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernels on CUDA where they take the shapes, the matmul form elsewhere (into ``out`` when given)."""
    if q.is_cuda and supported(q, keys):
        return triton_decode_attention(q, keys, values, positions, cache_rows, out)
    got = matmul_decode_attention(q, keys, values, positions, cache_rows)
    return got if out is None else out.copy_(got)


@torch.library.custom_op("miaohui::decode_attention", mutates_args=())
def decode_attention_op(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The engine's entry (:func:`decode_attention`), opaque to ``torch.compile``."""
    return decode_attention(q, keys, values, positions)


@decode_attention_op.register_fake
def _decode_attention_fake(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(q)
