"""Attention of a prefix-cache hit's rest on the GPU: the new tokens of a prompt whose first positions its slot already
holds, each over its slot's cache up to its own position, as split-KV flash decoding over *blocks of tokens*.

:mod:`~miaohui.generation.kernels.decode_attention` runs one program per (token, KV head, slice of the cache): run
there, every rest token re-reads the whole history (64 tokens after a 2,000-token conversation: 40 µs per layer of
the 1.5B shape on an H100, half the hit's extra time). Here one program takes ``TOK`` consecutive tokens of one
prompt (one cache row) and the query heads sharing one KV head, ``TOK × GROUP`` query rows against one slice of
the cache, each row masked to its own position: the history is read once per ``TOK`` tokens. The partial results
are laid out as the decode kernels' (per token, KV head and slice), so its merge kernel finishes them.

Checked on the CPU under Triton's interpreter against SDPA and compiled for compute capability 9.0
(``tests/unit/test_decode_attention.py``); on a GPU inside the engine's prefix-hit graphs
(``tests/gpu/test_slot_engine_gpu.py``).
"""

from __future__ import annotations

import torch

from miaohui.generation.kernels.decode_attention import supported

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl

    from miaohui.generation.kernels.decode_attention import _merge_kernel, attend_block
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

ROWS = 64
"""Query rows per program at most (tokens × query heads per KV head, padded to a power of two)."""
BLOCK = 64
"""Cache positions per inner step."""
CHUNK = 256
"""Cache positions per slice (one program's share of a row's cache; a multiple of :data:`BLOCK`). The slices are
laid over the whole slot (a prefix-hit graph serves every cached length), and a slice past its tokens' positions
stops at once, so the programs that work are those over the history: with 256-position slices a 50-token turn after
a 2,000-token history keeps 8 token blocks × 2 KV heads × 8 slices = 128 programs busy on 4 steps each, about one
per SM of an H100. ``lab/probes/prefix_attention_sweep.py`` times other slice lengths."""


if triton is not None:

    @triton.jit
    def _prefix_partial_kernel(
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
        TOK: tl.constexpr,
        R_PAD: tl.constexpr,
        D: tl.constexpr,
        CHUNK: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
    ) -> None:
        """Program (token block · KVH + kv head, slice): query rows (t, g) — token ``block · TOK + t``, query head
        ``head · GROUP + g`` — against cache positions [slice · CHUNK, …) of the block's cache row, each up to its
        token's position; writes each row's max score, exp-sum and exp-weighted values where the decode kernels'
        merge reads them (an empty slice writes -inf, 0, 0)."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        tb = pid // KVH
        head = pid % KVH
        r = tl.arange(0, R_PAD)
        rmask = r < TOK * GROUP
        tok = tb * TOK + r // GROUP
        g = r % GROUP
        pos = tl.load(pos_ptr + tok, mask=rmask, other=-1)
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :],
            mask=rmask[:, None],
            other=0.0,
        )
        m_i = tl.full((R_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((R_PAD,), tl.float32)
        acc = tl.zeros((R_PAD, D), tl.float32)
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, tl.max(pos, axis=0) + 1)
        crow = tl.load(rows_ptr + tb * TOK)  # a block's tokens are one prompt's: one cache row
        k_base = k_ptr + crow * stride_kb + head * stride_kh
        v_base = v_ptr + crow * stride_vb + head * stride_vh
        for t0 in range(start, end, BLOCK):  # none where the slice starts past every row's position
            t = t0 + tl.arange(0, BLOCK)
            tmask = t < end
            allowed = tmask[None, :] & (t[None, :] <= pos[:, None])  # each row up to its own position
            m_i, l_i, acc = attend_block(
                q, k_base, v_base, t, tmask, allowed, d, stride_kt, stride_vt, sm_scale, m_i, l_i, acc, PRECISION
            )
        part = (tok * KVH + head) * SPLITS + split
        tl.store(m_ptr + part * G_PAD + g, m_i, mask=rmask)
        tl.store(l_ptr + part * G_PAD + g, l_i, mask=rmask)
        # a row whose position is before the slice (every row, in most of a long slot's slices) saw nothing here: its
        # weighted values are left unwritten, and the merge reads none where the max is -inf
        live = rmask & (pos >= start)
        tl.store(acc_ptr + (part * G_PAD + g)[:, None] * D + d[None, :], acc, mask=live[:, None])


def tokens_per_program(group: int, tokens: int, rows: int = ROWS) -> int:
    """Tokens one program takes: the largest power of two whose query rows (× ``group``) fit ``rows`` and that
    divides ``tokens`` (a prompt's padded rest: a block never spans two prompts)."""
    tok = 1
    while tok * 2 * group <= rows and tokens % (tok * 2) == 0:
        tok *= 2
    return tok


def triton_prefix_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    *,
    chunk: int = CHUNK,
    block: int = BLOCK,
    warps: int = 4,
    rows_per_program: int = ROWS,
    stages: int | None = None,
) -> torch.Tensor:
    """``q`` [n, S, H, D] (n prompts' rests of S tokens, right-padded), token (i, s) at ``positions[i, s]`` of cache
    row ``rows[i, s]`` (the same for a prompt's tokens) of ``keys``/``values`` [rows, KVH, T, D], attending there to
    positions 0..its own → [n * S, H, D] in q's dtype. ``chunk`` (:data:`CHUNK`), ``block`` (:data:`BLOCK`),
    ``rows_per_program`` (:data:`ROWS`), ``warps`` and ``stages`` (Triton's default where None) of the first kernel are
    what ``lab/probes/prefix_attention_sweep.py`` varies."""
    if triton is None:
        raise RuntimeError("triton_prefix_attention needs Triton (it comes with CUDA builds of torch)")
    n, s, heads, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    shapes_ok = tuple(positions.shape) == tuple(rows.shape) == (n, s)
    if keys.shape != values.shape or keys.shape[3] != d or heads % kv_heads or not shapes_ok:
        raise ValueError(
            f"prefix attention: q {tuple(q.shape)}, keys {tuple(keys.shape)}, positions {tuple(positions.shape)}: "
            "need q [n, S, H, D], keys = values [rows, KVH, T, D] with H a multiple of KVH, positions = rows [n, S]"
        )
    if not supported(q, keys) or values.stride(-1) != 1:
        raise ValueError(f"prefix attention: head size {d} must be a power of two ≥ 16, with contiguous last dims")
    group = heads // kv_heads
    flat = q.reshape(n * s, heads, d).contiguous()
    tok = tokens_per_program(group, s, rows_per_program)
    blocks = n * s // tok
    g_pad = max(16, triton.next_power_of_2(group))
    if chunk % block or chunk <= 0:
        raise ValueError(f"prefix attention: chunk={chunk} must be a positive multiple of block={block}")
    splits = -(-length // chunk)
    parts = n * s * kv_heads * splits
    m = torch.empty((parts, g_pad), dtype=torch.float32, device=q.device)
    total = torch.empty((parts, g_pad), dtype=torch.float32, device=q.device)
    acc = torch.empty((parts, g_pad, d), dtype=torch.float32, device=q.device)
    out = torch.empty(flat.shape, dtype=q.dtype, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    token_positions, token_rows = positions.reshape(-1).contiguous(), rows.reshape(-1).contiguous()
    _prefix_partial_kernel[(blocks * kv_heads, splits)](
        flat, keys, values, token_positions, token_rows, m, total, acc, flat.stride(0), flat.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2), d**-0.5,
        KVH=kv_heads, GROUP=group, G_PAD=g_pad, TOK=tok, R_PAD=max(16, triton.next_power_of_2(tok * group)), D=d,
        CHUNK=chunk, SPLITS=splits, BLOCK=block, PRECISION=precision, num_warps=warps,
        **({} if stages is None else {"num_stages": stages}),
    )  # fmt: skip
    _merge_kernel[(n * s * heads,)](
        m, total, acc, out, out.stride(0), out.stride(1),
        KVH=kv_heads, GROUP=group, G_PAD=g_pad, D=d, SPLITS=splits, S_PAD=triton.next_power_of_2(splits),
    )  # fmt: skip
    return out
