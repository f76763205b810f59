"""A persistent Triton GEMM with TMA loads for the encoder's many-row products (``x`` [M, K] @ ``w`` [N, K]ᵀ + bias,
optional tanh GELU), M = batch × sequence in the thousands (32×128 = 4,096 rows).

Why: BERT-base fp16 at 32×128 on the H200 spends ~1,205 of ~1,530 µs in cuBLAS GEMMs (``gpu_encoder_bert_profile_
s28b.json``). The two with K = 768 and a wide output run far below the chip's peak: QKV + attention output at ~63 %,
the FFN's first GEMM with its GELU epilogue at ~68 %, while the FFN's second (K = 3,072, the same FLOPs) reaches
~93 %. With K = 768 a tile's main loop is 12 steps of 64, so the tile's prologue and its epilogue (the 25 MB the FFN's
first GEMM writes) weigh as much as the loop. cuBLAS picked cooperative kernels, one tile per CTA at a time. Here one
program per SM walks its tiles in a loop Triton software-pipelines across tile boundaries (``tl.range(...,
flatten=True)``): the next tile's TMA loads are in flight while this tile's epilogue runs. The (32, 128) goal, 60 %
of peak, needs ~110 µs of those GEMMs' ~890.

Status: arithmetic checked on the CPU under Triton's interpreter (``tests/unit/test_wide_gemm.py``); speed measured
by ``scripts/gpu/wide_gemm_sweep.py`` against cuBLAS. The engine runs it only for the (M, N, K) in :data:`WIDE_BEST`
(filled by ``kernel_tables.apply`` from the measured table).
"""

from __future__ import annotations

from typing import Any

import torch

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

WideConfig = tuple[int, int, int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps, SUBTILE): SUBTILE 1 stores the tile as two halves."""

WIDE_SWEEP: list[WideConfig] = [
    (bm, bn, bk, 8, stages, warps, sub)
    for bm, bn, bk in ((128, 128, 64), (128, 256, 64), (128, 128, 128), (64, 256, 64), (128, 192, 64))
    for stages in (3, 4)
    for warps in (4, 8)
    for sub in (0, 1)
    if not (bm == 128 and bn == 256 and warps == 4)  # a 128×256 fp32 accumulator needs 8 warps' registers
]
"""Every configuration ``scripts/gpu/wide_gemm_sweep.py`` times."""

if triton is not None:
    from miaohui.models.skinny_gemm import _gelu_tanh

    @triton.jit
    def _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):  # no annotations: read as globals
        """Grouped order: GROUP_M row blocks sweep the columns together, so a wave's tiles share x rows in L2."""
        per_group = GROUP_M * num_pid_n
        first_m = (tile_id // per_group) * GROUP_M
        group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (tile_id % group_m), (tile_id % per_group) // group_m

    @triton.jit
    def _wide_kernel(
        x_desc,
        w_desc,
        out_desc,
        b_ptr,
        M,
        N,
        K,
        HAS_BIAS: tl.constexpr,
        GELU: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SUBTILE: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
    ) -> None:
        """Program ``p`` computes tiles p, p + NUM_PROGRAMS, …; each tile's epilogue adds bias (and GELU) in fp32."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        num_tiles = num_pid_m * num_pid_n
        start = tl.program_id(0)
        tile_c = start - NUM_PROGRAMS  # the epilogue's own counter: the pipeliner must not share one across stages
        for tile_id in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                x = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                w = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
                acc = tl.dot(x, w.T, acc)
            tile_c += NUM_PROGRAMS
            pid_m, pid_n = _tile_of(tile_c, num_pid_m, num_pid_n, GROUP_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if GELU:
                acc = _gelu_tanh(acc)
            if SUBTILE:
                halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
                lo, hi = tl.split(halves)
                out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], lo.to(out_desc.dtype))
                out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], hi.to(out_desc.dtype))
            else:
                out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4  # the interpreter: a few programs, so that each walks several tiles


def wide_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, config: WideConfig, gelu: bool = False
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` (then tanh GELU when ``gelu``) for ``x`` [..., K] and ``w`` [N, K] of one dtype, by
    the persistent TMA kernel with ``config`` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps, SUBTILE).

    TMA needs 16-byte aligned rows: K and N multiples of 8 in fp16/bf16 (every encoder width is)."""
    if triton is None:
        raise RuntimeError("wide_linear needs Triton (it comes with CUDA builds of torch)")
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or x.dtype != w.dtype:
        raise ValueError(
            f"wide_linear: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}: need w [N, K] and x [..., K] "
            "of the same dtype"
        )
    k, n = w.shape[1], w.shape[0]
    if (k * x.element_size()) % 16 or (n * x.element_size()) % 16:
        raise ValueError(f"wide_linear: K={k} and N={n} must give rows of a multiple of 16 bytes for TMA")
    block_m, block_n, block_k, group_m, stages, warps, subtile = config
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    w = w.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    programs = min(_programs(x.device), triton.cdiv(m, block_m) * triton.cdiv(n, block_n))
    _wide_kernel[(programs,)](
        TensorDescriptor.from_tensor(x2, [block_m, block_k]),
        TensorDescriptor.from_tensor(w, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n // 2 if subtile else block_n]),
        bias if bias is not None else w, m, n, k,
        HAS_BIAS=bias is not None, GELU=gelu, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        SUBTILE=bool(subtile), NUM_PROGRAMS=programs, num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return out.reshape(*lead, n)


WIDE_BEST: dict[tuple[int, int, int], WideConfig] = {}
"""(M, N, K) → the configuration to run, for the products where the sweep found it faster than cuBLAS; every other
product keeps what ``miaohui::skinny_linear`` runs without it. Filled by ``kernel_tables.apply`` or the benchmarks."""


def table_from_sweep(report: dict[str, Any], min_gain: float = 0.0) -> dict[tuple[int, int, int], WideConfig]:
    """``wide_gemm_sweep.py``'s ``best`` entries at least ``min_gain`` faster than cuBLAS, as :data:`WIDE_BEST`."""
    out: dict[tuple[int, int, int], WideConfig] = {}
    for e in report["best"]:
        if float(e["us"]) <= (1 - min_gain) * float(e["cublas_us"]):
            cfg = tuple(int(v) for v in e["config"])
            out[(int(e["m"]), int(e["n"]), int(e["k"]))] = cfg  # type: ignore[assignment]
    return out
