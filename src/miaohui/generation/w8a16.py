"""A weight-only int8 GEMM for decode batches (a few to 64 rows): ``out = x @ (q * scale).T (+ bias)``, one Triton
kernel that reads the int8 weight bytes, widens them in registers and multiplies on tensor cores (``tl.dot``).

Why: at 8 and 64 rows Inductor's rewrite of ``F.linear(x, q.to(bf16)) * scale`` ran 2× slower than cuBLAS on bf16
weights (H200, ``decode_quant_probe_h200_s11d.json``), and the batch-64 decode step spends ~1.3 of its ~2.15 ms of
device time in GEMMs reading bf16 weights, so halving those bytes is where throughput would come from. This kernel is
written for that case: a tile of up to 64 rows × ``BLOCK_N`` output columns per program, the whole reduction in one
program (no split-K, so no extra reduction kernel or zeroed buffer inside a CUDA graph), configurations autotuned per
(rows bucket, N, K).

It is registered as the custom op ``torch.ops.miaohui.w8a16_linear`` (opaque to ``torch.compile``, so the engine's
compiled decode pieces call it and CUDA graphs capture it; on the CPU, or without Triton, the op computes
``F.linear(x, q.to(x.dtype)) * scale``). The engine routes decode steps of 2+ rows to it with
``SlotEngineOptions.int8_batched``.

Status (session 11): its arithmetic is checked on the CPU with Triton's interpreter
(``tests/unit/test_w8a16.py``) and the op inside the compiled engine on the CPU (its fallback,
``tests/integration/test_compiled_decode.py``); its speed has not been measured (``scripts/gpu/decode_quant_probe.py``
has it as the ``int8_triton`` variant, ``run_h200.sh s12b``).
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


def _configs() -> list[Any]:
    out = []
    for block_n in (16, 32, 64, 128):
        for block_k in (128, 256):
            for warps in (4, 8):
                out.append(triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=4))
    return out


if triton is not None:

    @triton.jit
    def _w8a16_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        K_TILES: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ) -> None:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(K_TILES):  # a compile-time trip count (K is one of a model's few widths)
            rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
            )
            w = tl.load(
                w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0
            )
            acc += tl.dot(x, w.to(x.dtype))
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rm[:, None] * stride_om + rn[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )

    _w8a16_heur = triton.heuristics({"K_TILES": lambda a: triton.cdiv(a["K"], a["BLOCK_K"])})(_w8a16_kernel)
    _w8a16_tuned = triton.autotune(configs=_configs(), key=["BLOCK_M", "N", "K"])(_w8a16_heur)


def w8a16_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``F.linear(x, q.to(x.dtype) * scale[:, None], bias)`` for ``x`` [..., K] (bf16/fp16/fp32), ``q`` int8 [N, K]
    and ``scale`` [N]; rows = the product of x's leading dims (meant for ≤ 64). Runs the Triton kernel, autotuned, or
    with ``config`` (``BLOCK_N``, ``BLOCK_K``, optional ``num_warps``) as given: what the CPU tests do, since Triton's
    interpreter cannot time configurations."""
    if triton is None:
        raise RuntimeError("w8a16_linear needs Triton (it comes with CUDA builds of torch)")
    if q.dtype != torch.int8 or q.dim() != 2 or x.shape[-1] != q.shape[1] or scale.shape != (q.shape[0],):
        raise ValueError(
            f"w8a16_linear: x {tuple(x.shape)} {x.dtype}, q {tuple(q.shape)} {q.dtype}, scale {tuple(scale.shape)}: "
            "need q int8 [N, K], x [..., K], scale [N]"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    m, k = x2.shape
    n = q.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64  # also the autotune key: once per rows bucket

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, block_m))

    extra: dict[str, Any] = {}
    kernel: Any = _w8a16_tuned
    if config is not None:
        kernel, extra = _w8a16_heur, {"num_warps": 4, **config}
    kernel[grid](
        x2,
        q,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x2.stride(0),
        q.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        **extra,
    )
    return out.reshape(*lead, n)


@torch.library.custom_op("miaohui::w8a16_linear", mutates_args=())
def w8a16_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The engine's entry: the Triton kernel on CUDA, the dequantizing ``F.linear`` elsewhere."""
    if x.is_cuda and triton is not None:
        return w8a16_linear(x, q, scale, bias)
    out = F.linear(x, q.to(x.dtype)) * scale
    return out if bias is None else out + bias


@w8a16_op.register_fake
def _w8a16_fake(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], q.shape[0]))
