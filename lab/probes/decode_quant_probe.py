"""On the GPU: would weight-only quantization pay in the decode step? The 1.5B Qwen2.5 shape's GEMMs (random weights)
at M = 1, 8 and 64 rows, bf16 cuBLAS against int8 and int4 weight-only kernels, before building one into the engine.

Session 10 found the batch-1 step's GEMMs take 1.26 ms in cuBLAS (0.7–3.2 TB/s of the H200's ~4.8), so a TPOT of
1.1 ms cannot come from bf16 weights. Variants, each a CUDA graph of 40 calls over weights rotated past L2:

* ``cublas``: ``F.linear`` on bf16 weights (what the engine does today);
* ``int8_aten``: ``aten._weight_int8pack_mm`` (int8 [N, K], per-channel scales; PyTorch's own CUDA kernel);
* ``int8_inductor`` / ``int8_inductor_cd``: ``F.linear(x, w.to(bf16)) * s`` compiled by Inductor, without / with
  coordinate-descent tuning (gpt-fast's int8 recipe: at M = 1 the matmul becomes a Triton reduction with the
  dequantization fused in);
* ``int4_tinygemm``: ``aten._weight_int4pack_mm`` (4-bit, groups of 128, bf16 scale and zero; gpt-fast's int4);
* ``int8_triton``: :func:`miaohui.generation.kernels.w8a16.w8a16_linear`, miaohui's own int8 Triton GEMM for 1–64 rows
  (autotuned per rows bucket; added after the session-11 run, so not in ``decode_quant_probe_h200_s11d.json``);
* ``fp8_inductor``: :func:`fp8_linear` compiled (W8A8 float8 e4m3, per-row scales, ``torch._scaled_mm``, vLLM's fp8
  scheme; ``run_h200.sh s18c`` → ``decode_quant_probe_fp8_h200_s18c.json``: slower than cuBLAS bf16 at 1, 8 and 64
  rows on the H200, so the engine option built for it, ``fp8_batched``, was removed).

(Session 19's ``int8_swap`` — a weight-first tensor-core int8 kernel with split K for 2–64 rows, and ``--swap-sweep``
over its configurations — lives at commit ee45b4d: ``run_h200.sh s20e`` → ``decode_quant_probe_swap_h200_s20e.json``,
the 64-row step's GEMMs 1,544 µs at the best configuration per shape vs cuBLAS bf16 1,282; removed.)

Per row: µs per call, the bytes' TB/s, and max |error| against the dequantized weights in fp32.

    python -m lab.probes.decode_quant_probe --out /tmp/quant [--variants cublas,int8_triton]
    python -m lab.probes.decode_quant_probe --device cpu --tiny --out /tmp/quant   # smoke test, no timing
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from lab.harness import rotating, time_graph
from lab.probes.decode_kernel_probe import HEADS, HIDDEN, INTER, KV_HEADS, VOCAB, D
from miaohui.generation.kernels.int8_weights import quantize_int8
from miaohui.generation.kernels.w8a16 import w8a16_linear

GROUP = 128
FP8_MAX = 448.0
"""The largest finite float8 e4m3fn value."""


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row float8 e4m3 of a ``[out, in]`` weight (scale = row amax / 448): (values, fp32 scales)."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def fp8_linear(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x @ dequant(w).T`` with x quantized to e4m3 per row (its amax / 448) and ``torch._scaled_mm``'s row-wise
    scales; bf16 out of the GEMM (the only output row-wise scaling has on CUDA), then x's dtype."""
    q, scale = w
    x2 = x.reshape(-1, x.shape[-1]).float()
    xs = x2.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    x8 = (x2 / xs).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x8, q.t(), scale_a=xs, scale_b=scale[None, :], out_dtype=torch.bfloat16)
    return out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def quant_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tinygemm-packed weight, [K/G, N, 2] scales and zeros, the dequantized weight) for groups of GROUP along K."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo) / scale).clamp(0, 15).to(torch.int32)
    zero = lo + scale * 8  # tinygemm dequantizes (q - 8) * scale + zero
    deq = ((q - 8) * scale + zero).reshape(n, k)
    q = q.reshape(n, k)
    packed_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    sz = torch.cat([scale, zero], dim=-1).reshape(n, k // GROUP, 2).transpose(0, 1).contiguous().to(w.dtype)
    return packed, sz, deq


def variants(cuda: bool) -> dict[str, tuple[Callable[..., Any], Callable[[torch.Tensor], Any]]]:
    """name → (callable(x, packed weight), how to pack a bf16 weight for it)."""

    def int8_linear(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.linear(x, w[0].to(x.dtype)) * w[1]

    out: dict[str, tuple[Callable[..., Any], Callable[[torch.Tensor], Any]]] = {
        "cublas": (F.linear, lambda w: w),
        "int8_aten": (lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1]), quantize_int8),
        "int8_inductor": (int8_linear, quantize_int8),
        "int8_inductor_cd": (int8_linear, quantize_int8),
        "fp8_inductor": (fp8_linear, quantize_fp8),
    }
    if cuda:  # tinygemm's packing is CUDA-only; the Triton kernel needs a GPU (or the interpreter)
        out["int8_triton"] = (lambda x, w: w8a16_linear(x, w[0], w[1]), quantize_int8)
        out["int4_tinygemm"] = (
            lambda x, w: torch.ops.aten._weight_int4pack_mm(x, w[0], GROUP, w[1]),
            lambda w: quant_int4(w)[:2],
        )
    return out


def probe(device: str, dtype: torch.dtype, scale: int, only: set[str] | None = None) -> list[dict[str, Any]]:
    cuda = device == "cuda"
    shapes = {"qkv": (HIDDEN + 2 * KV_HEADS * D, HIDDEN), "o": (HIDDEN, HEADS * D), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}  # fmt: skip
    rows = []
    for name, (n, k) in shapes.items():
        n, k = max(GROUP, n // scale), max(GROUP, k // scale)
        copies = max(1, min(40, (400 << 20) // (n * k * 2))) if cuda else 1
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        for vname, (fn, pack) in variants(cuda).items():
            if only and vname not in only:
                continue
            try:
                packed = [pack(w) for w in weights]
            except Exception as exc:  # report and go on: a kernel this torch lacks is a finding
                rows.append({"gemm": name, "variant": vname, "error": repr(exc)[:300]})
                print(f"{name} {vname}: {exc!r}"[:300], flush=True)
                continue
            if vname == "int4_tinygemm":
                deq = quant_int4(weights[0])[2]
            elif vname.startswith("int8"):
                q, s = packed[0]
                deq = q.float() * s.float()[:, None]
            else:
                deq = weights[0].float()
            nbytes = sum(
                t.numel() * t.element_size() for t in (packed[0] if isinstance(packed[0], tuple) else (packed[0],))
            )
            for m in (1, 8, 64):
                torch._dynamo.reset()
                torch._inductor.config.coordinate_descent_tuning = vname.endswith("_cd")
                lin = torch.compile(fn, dynamic=False) if "inductor" in vname else fn
                x = torch.randn(m, k, device=device, dtype=dtype)
                row: dict[str, Any] = {"gemm": name, "variant": vname, "m": m, "n": n, "k": k, "mb": nbytes / 2**20}
                try:
                    y = lin(x, packed[0])
                    row["max_abs_err"] = float((y.float() - x.float() @ deq.T).abs().max())
                    us = time_graph(rotating(lin, x, items=packed), 40 if cuda else 1, cuda)
                    row |= {"us": us, "tb_s": nbytes / (us * 1e-6) / 1e12 if cuda else float("nan")}
                except Exception as exc:
                    row["error"] = repr(exc)[:300]
                torch._inductor.config.coordinate_descent_tuning = False
                rows.append(row)
                print(json.dumps(row), flush=True)
        del weights
    return rows


def per_layer_table(rows: list[dict[str, Any]], layers: int = 28) -> dict[str, dict[int, float]]:
    """µs per decode step spent in GEMMs, by variant and M: 28 layers × (qkv + o + gate_up + down) + LM head."""
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        if "us" not in r:
            continue
        mult = 1 if r["gemm"] == "lm_head" else layers
        out.setdefault(r["variant"], {}).setdefault(r["m"], 0.0)
        out[r["variant"]][r["m"]] += mult * r["us"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/quant"))
    ap.add_argument("--variants", default="", help="comma-separated subset (default: all)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16
    report: dict[str, Any] = {"model": "qwen1.5b shape (random weights)", "torch": torch.__version__}
    with torch.inference_mode():
        only = set(args.variants.split(",")) if args.variants else None
        report["gemms"] = probe(args.device, dtype, 16 if args.tiny else 1, only)
    report["step_gemm_us"] = per_layer_table(report["gemms"])
    print("GEMM µs per decode step (28 layers + LM head):", json.dumps(report["step_gemm_us"]), flush=True)
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    (args.out / "decode_quant_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
