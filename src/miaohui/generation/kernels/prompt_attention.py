"""Causal attention of packed prompts (a mixed step's prompt rows, :mod:`~miaohui.generation.models.mixed_step`), as one
flash-attention Triton kernel over the rows' own keys and values.

A mixed step packs its prompts' tokens one after another: prompt i's tokens are contiguous rows at positions 0, 1,
..., so row r's prompt starts at row ``r - positions[r]`` and the row attends to rows ``r - positions[r] .. r``
(padding rows sit at position 0 and attend to themselves). Each row's key and value were just written at
``(cache_rows[r], positions[r])`` of the cache, where the kernel reads them (reading the layer's own k/v tensors
instead makes Inductor copy them out in two more kernels per layer). Running the prompt rows through the decode kernel
instead, each row reading its slot's cache up to its position, re-reads every prompt once per token: two to four
times the decode rows' own attention time at 128–256 prompt tokens on the H200.

One program takes ``BLOCK_M`` rows and one query head and runs an online softmax over the key blocks from the first
row's prompt start to its last row. Behind the custom op ``torch.ops.miaohui.prompt_attention``; elsewhere (the CPU,
no Triton, a head size that is not a power of two) the op computes the same attention with matmuls. Checked under
Triton's interpreter and compiled for compute capability 9.0 on the CPU (``tests/unit/test_prompt_attention.py``).
"""

from __future__ import annotations

import torch

from miaohui.generation.kernels.decode_attention import supported

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

BLOCK_M = 16
"""Query rows per program."""
BLOCK_N = 64
"""Key rows per inner step."""


if triton is not None:

    @triton.jit
    def _prompt_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        pos_ptr,
        crow_ptr,
        out_ptr,
        rows,
        stride_qr,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_or,
        stride_oh,
        sm_scale,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ) -> None:
        """Program (block of rows, query head): rows ``first .. first + BLOCK_M`` each attend to the key rows
        ``max(r - positions[r], 0) .. r`` of KV head ``head // GROUP``; key row j sits at position ``positions[j]``
        of cache row ``cache_rows[j]``."""
        first = tl.program_id(0) * BLOCK_M
        head = tl.program_id(1)
        kv = head // GROUP
        r = first + tl.arange(0, BLOCK_M)
        rmask = r < rows
        start = tl.maximum(r - tl.load(pos_ptr + r, mask=rmask, other=0), 0)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + r[:, None] * stride_qr + head * stride_qh + d[None, :], mask=rmask[:, None], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        lo = tl.min(tl.where(rmask, start, first), axis=0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(first + BLOCK_M, rows)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < rows
            at = (
                tl.load(crow_ptr + n, mask=nmask, other=0) * stride_kb
                + tl.load(pos_ptr + n, mask=nmask, other=0) * stride_kt
            )
            k = tl.load(k_ptr + at[:, None] + kv * stride_kh + d[None, :], mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # [BLOCK_M, BLOCK_N]
            ok = (n[None, :] >= start[:, None]) & (n[None, :] <= r[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp(-inf - 0) = 0, not NaN
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            at = (
                tl.load(crow_ptr + n, mask=nmask, other=0) * stride_vb
                + tl.load(pos_ptr + n, mask=nmask, other=0) * stride_vt
            )
            v = tl.load(v_ptr + at[:, None] + kv * stride_vh + d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows past `rows` saw nothing; they are not stored
        tl.store(
            out_ptr + r[:, None] * stride_or + head * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=rmask[:, None],
        )


def _check(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
) -> None:
    n, heads, d = q.shape
    if (
        keys.shape != values.shape
        or keys.dim() != 4
        or keys.shape[3] != d
        or heads % keys.shape[1]
        or positions.shape != (n,)
        or rows.shape != (n,)
    ):
        raise ValueError(
            f"prompt attention: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}, "
            f"positions {tuple(positions.shape)}, cache_rows {tuple(rows.shape)}: need q [R, H, D], keys = values "
            "[S, KVH, T, D] with H a multiple of KVH, positions and cache_rows [R]"
        )


def triton_prompt_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    warps: int = 4,
) -> torch.Tensor:
    """``q`` [R, H, D] of packed prompts (row r at ``positions[r]`` of a prompt that starts at row
    ``r - positions[r]``; its key and value at ``(cache_rows[r], positions[r])`` of ``keys``/``values``
    [S, KVH, T, D]) → [R, H, D] in q's dtype, written into ``out`` when given."""
    if triton is None:
        raise RuntimeError("triton_prompt_attention needs Triton (it comes with CUDA builds of torch)")
    _check(q, keys, values, positions, cache_rows)
    rows, heads, d = q.shape
    if not supported(q, keys) or values.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"prompt attention: head size {d} must be a power of two ≥ 16, with contiguous last dims")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 engines stay exact; 16-bit inputs ignore it
    _prompt_kernel[(triton.cdiv(rows, block_m), heads)](
        q, keys, values, positions, cache_rows, out, rows, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        keys.stride(2), values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), d**-0.5,
        GROUP=heads // keys.shape[1], D=d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, num_warps=warps,
    )  # fmt: skip
    return out


def matmul_prompt_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, cache_rows: torch.Tensor
) -> torch.Tensor:
    """The same attention with matmuls and a softmax over a [R, R] mask: the op's fallback and the tests' reference."""
    _check(q, keys, values, positions, cache_rows)
    rows, heads, d = q.shape
    kv_heads = keys.shape[1]
    k, v = keys[cache_rows, :, positions], values[cache_rows, :, positions]  # [R, KVH, D]: each row's own
    r = torch.arange(rows, device=q.device)
    start = (r - positions).clamp(min=0)
    allowed = (r[None, :] >= start[:, None]) & (r[None, :] <= r[:, None])
    bias = torch.where(allowed, 0.0, float("-inf"))
    q4 = q.reshape(rows, kv_heads, heads // kv_heads, d).permute(1, 2, 0, 3)  # [KVH, G, R, D]
    k4, v4 = k.permute(1, 0, 2)[:, None], v.permute(1, 0, 2)[:, None]  # [KVH, 1, R, D]
    scores = torch.matmul(q4, k4.transpose(-1, -2)).float() * (d**-0.5) + bias
    out = torch.matmul(torch.softmax(scores, dim=-1).to(v4.dtype), v4)  # [KVH, G, R, D]
    return out.permute(2, 0, 1, 3).reshape(rows, heads, d)


def prompt_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel on CUDA where it takes the shapes, the matmul form elsewhere (into ``out`` when given)."""
    if q.is_cuda and supported(q, keys):
        return triton_prompt_attention(q, keys, values, positions, cache_rows, out)
    got = matmul_prompt_attention(q, keys, values, positions, cache_rows)
    return got if out is None else out.copy_(got)
