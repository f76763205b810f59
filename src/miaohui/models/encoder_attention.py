"""The encoder's (:class:`~miaohui.models.fast_bert.FastBert`) bidirectional attention with a padding bias, as one
flash-attention Triton kernel that reads q, k and v straight out of the QKV GEMM's output [B, S, 3·H·D] and writes
[B, S, H·D], the output projection's input.

Why: the library's fused attention at intent-request sizes (≤ 128 tokens) costs several times its arithmetic, plus
memsets and the permute copies around it. At ≤ 128 tokens one program holds a block of queries and the whole key
range in one or two steps, so the kernel is short.

One program takes ``BLOCK_M`` queries of one (sequence, head) and runs an online softmax over key blocks; a key's
score gets ``bias[b, 0, 0, key]`` added (``FastBert``'s additive padding bias, ``MASK_BIAS`` on padding keys), as
``F.scaled_dot_product_attention(q, k, v, attn_mask=bias)`` does. Behind the custom op
``torch.ops.miaohui.encoder_attention``; elsewhere (the CPU, no Triton, a head size that is not a power of two ≥ 16)
the op runs that SDPA call itself (the reference form). Checked under Triton's interpreter and compiled for compute
capability 9.0 on the CPU (``tests/unit/test_encoder_attention.py``). ``scripts/gpu/tune.py`` sweeps its launch
configurations per shape; the engine runs it at the shapes where that found it faster than the SDPA form by
:data:`miaohui.models.tuning.rules.MIN_ATTN_GAIN` (the GPU's tuning file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miaohui.models.tuning import AttnConfig

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

ATTN_BEST: dict[tuple[int, int, int, int], AttnConfig] = {}
"""(batch, heads, seq, head size) → the configuration to run; other shapes take :func:`default_config`. Filled by
``kernel_tables.apply`` from the tuning file."""

ATTN_SHAPES_ONLY = False
"""True: the op runs the Triton kernel only for :data:`ATTN_BEST`'s shapes and the SDPA form for every other (the
engine: ``kernel_tables.apply``); False: wherever :func:`supported` (``scripts/gpu/tune.py``, the tests)."""

LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _encoder_kernel(
        qkv_ptr,
        bias_ptr,
        out_ptr,
        seq,
        stride_qb,
        stride_qs,
        stride_bb,
        stride_ob,
        stride_os,
        sm_scale,
        HEADS: tl.constexpr,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        LOG2E: tl.constexpr,
    ) -> None:
        """Program (block of queries, sequence × head): queries ``first .. first + BLOCK_M`` of sequence ``b`` attend
        to all ``seq`` keys of head ``h``; q, k, v of token t sit at columns ``h·D``, ``(H + h)·D`` and ``(2H + h)·D``
        of row t of ``qkv``."""
        first = tl.program_id(0) * BLOCK_M
        b = tl.program_id(1) // HEADS
        h = tl.program_id(1) % HEADS
        r = first + tl.arange(0, BLOCK_M)
        rmask = r < seq
        d = tl.arange(0, D)
        row = qkv_ptr + b * stride_qb
        q = tl.load(row + r[:, None] * stride_qs + h * D + d[None, :], mask=rmask[:, None], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for n0 in range(0, seq, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < seq
            k = tl.load(row + n[:, None] * stride_qs + (HEADS + h) * D + d[None, :], mask=nmask[:, None], other=0.0)
            bias = tl.load(bias_ptr + b * stride_bb + n, mask=nmask, other=0.0).to(tl.float32)
            # scores in base 2: exp(x) = exp2(x · log2 e), with log2 e folded into sm_scale and the bias
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale + bias[None, :] * LOG2E
            s = tl.where(nmask[None, :], s, float("-inf"))  # [BLOCK_M, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block holds at least one key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            v = tl.load(row + n[:, None] * stride_qs + (2 * HEADS + h) * D + d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        tl.store(
            out_ptr + b * stride_ob + r[:, None] * stride_os + h * D + d[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=rmask[:, None],
        )


def _check(qkv: torch.Tensor, bias: torch.Tensor, heads: int) -> int:
    """The head size, after checking ``qkv`` [B, S, 3·H·D] and ``bias`` [B, 1, 1, S]."""
    ok = qkv.dim() == 3 and heads > 0 and qkv.shape[2] % (3 * heads) == 0
    if not ok or bias.shape != (qkv.shape[0], 1, 1, qkv.shape[1]):
        raise ValueError(
            f"encoder attention: qkv {tuple(qkv.shape)}, bias {tuple(bias.shape)}, heads {heads}: need qkv"
            " [B, S, 3·H·D] (the QKV projection's output) and bias [B, 1, 1, S]"
        )
    return int(qkv.shape[2]) // (3 * heads)


def _key(qkv: torch.Tensor, heads: int) -> tuple[int, int, int, int]:
    b, s, width = qkv.shape
    return (int(b), heads, int(s), int(width) // (3 * heads))


def supported(qkv: torch.Tensor, heads: int) -> bool:
    """Whether the Triton kernel takes this input: CUDA, Triton, a head size that is a power of two ≥ 16."""
    d = qkv.shape[-1] // (3 * heads)
    return triton is not None and qkv.is_cuda and d >= 16 and d & (d - 1) == 0


def default_config(batch: int, heads: int, seq: int) -> AttnConfig:
    """64 queries per program, or 32 when 64 would leave most of the H200's 132 SMs idle (one sequence of 12 heads:
    24 programs at 128 tokens); 64 keys per step, 4 warps, 1 stage. Shapes without an :data:`ATTN_BEST` entry."""
    bm = 64 if batch * heads * -(-seq // 64) >= 132 else 32
    return (bm, 64, 4, 1)


def triton_encoder_attention(
    qkv: torch.Tensor, bias: torch.Tensor, heads: int, config: AttnConfig | None = None
) -> torch.Tensor:
    """``qkv`` [B, S, 3·H·D] (q | k | v, each heads × head size), ``bias`` [B, 1, 1, S] added to each key's score →
    [B, S, H·D] in qkv's dtype. ``config``: (BLOCK_M, BLOCK_N, num_warps, num_stages); by default the shape's
    :data:`ATTN_BEST` entry, else :func:`default_config`."""
    if triton is None:
        raise RuntimeError("triton_encoder_attention needs Triton (it comes with CUDA builds of torch)")
    d = _check(qkv, bias, heads)
    if d < 16 or d & (d - 1):
        raise ValueError(f"encoder attention: head size {d} must be a power of two ≥ 16")
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    b, s, _ = qkv.shape
    bm, bn, warps, stages = config or ATTN_BEST.get(_key(qkv, heads)) or default_config(b, heads, s)
    out = torch.empty((b, s, heads * d), dtype=qkv.dtype, device=qkv.device)
    precision = "ieee" if qkv.dtype == torch.float32 else "tf32"  # fp32 stays exact; 16-bit inputs ignore it
    _encoder_kernel[(triton.cdiv(s, bm), b * heads)](
        qkv, bias, out, s, qkv.stride(0), qkv.stride(1), bias.stride(0), out.stride(0), out.stride(1),
        d**-0.5 * LOG2E, HEADS=heads, D=d, BLOCK_M=bm, BLOCK_N=bn, PRECISION=precision, LOG2E=LOG2E,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def sdpa_encoder_attention(qkv: torch.Tensor, bias: torch.Tensor, heads: int) -> torch.Tensor:
    """The same attention as :class:`FastBertLayer` computes it without the kernel (the op's fallback and the tests'
    reference): ``F.scaled_dot_product_attention`` with ``bias`` as its mask."""
    d = _check(qkv, bias, heads)
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, 3, heads, d).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, s, heads * d)


@torch.library.custom_op("miaohui::encoder_attention", mutates_args=())
def encoder_attention_op(qkv: torch.Tensor, bias: torch.Tensor, heads: int) -> torch.Tensor:
    """:func:`encoder_attention_call` as an op of its own (opaque to ``torch.export`` and Inductor)."""
    return encoder_attention_call(qkv, bias, heads)


def encoder_attention_call(qkv: torch.Tensor, bias: torch.Tensor, heads: int) -> torch.Tensor:
    """The Triton kernel where it takes the input (:func:`supported`, and with :data:`ATTN_SHAPES_ONLY` the shape is
    in :data:`ATTN_BEST`), the SDPA form elsewhere."""
    if supported(qkv, heads) and (not ATTN_SHAPES_ONLY or _key(qkv, heads) in ATTN_BEST):
        return triton_encoder_attention(qkv, bias, heads)
    return sdpa_encoder_attention(qkv, bias, heads)


@encoder_attention_op.register_fake
def _encoder_attention_fake(qkv: torch.Tensor, bias: torch.Tensor, heads: int) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3))
