"""On the GPU: the decode step's kernels one at a time, for the 1.5B Qwen2.5 shape (random weights), to say which
change would pay before building it into the engine (session 10's kernel tables: the GEMMs run at 0.8–3.2 TB/s of
the H200's ~4.8, the RoPE kernel of ``attn_in`` takes 5.8 µs per layer at batch 64 for 98 K elements, and every layer
launches two ``index_copy`` kernels and two device-to-device copies).

1. **GEMMs** of one layer and the LM head at M = 1 and 64 rows: ``F.linear`` (cuBLAS), compiled by Inductor, and
   compiled with ``coordinate_descent_tuning`` (at M = 1 Inductor then rewrites the matmul into a Triton reduction:
   gpt-fast's batch-1 recipe). Weights rotate over enough copies (> 400 MB) that L2 cannot hold them; each variant is
   a CUDA graph of 40 calls timed with CUDA events; µs per call and the weight bytes' TB/s.
2. **attn_in** (RMSNorm → QKV → RoPE) at batch 1 and 64: the engine's compiled piece, with its kernel table and
   Inductor's generated code written to ``--out`` (why is the RoPE kernel slow?).
3. **One eager decode layer's ops** (CPU-side op table): which aten op launches the device-to-device copies.

    python -m lab.probes.decode_kernel_probe --out /tmp/probe
    python -m lab.probes.decode_kernel_probe --device cpu --tiny --out /tmp/probe   # smoke test, no timing
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from lab.harness import rotating, time_graph
from miaohui.generation.models.static_kv import StaticKVDecoder, attn_in

HIDDEN, HEADS, KV_HEADS, D, INTER, VOCAB = 1536, 12, 2, 128, 8960, 151936


def probe_gemms(device: str, dtype: torch.dtype, scale: int) -> list[dict[str, Any]]:
    cuda = device == "cuda"
    shapes = {"qkv": (HIDDEN + 2 * KV_HEADS * D, HIDDEN), "o": (HIDDEN, HEADS * D), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}  # fmt: skip
    rows = []
    for name, (n, k) in shapes.items():
        n, k = max(8, n // scale), max(8, k // scale)
        nbytes = n * k * 2
        copies = max(1, min(40, (400 << 20) // nbytes)) if cuda else 1
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in (1, 64):
            x = torch.randn(m, k, device=device, dtype=dtype)
            row: dict[str, Any] = {"gemm": name, "m": m, "n": n, "k": k, "weight_mb": nbytes / 2**20}
            for variant in ("cublas", "compiled", "compiled_cd"):
                torch._dynamo.reset()
                torch._inductor.config.coordinate_descent_tuning = variant == "compiled_cd"
                lin = F.linear if variant == "cublas" else torch.compile(F.linear, dynamic=False)
                outs = [lin(x, w) for w in weights[:1]]  # compile once
                ref = x.float() @ weights[0].float().T
                row[f"{variant}_max_abs_err"] = float((outs[0].float() - ref).abs().max())
                us = time_graph(rotating(lin, x, items=weights), 40 if cuda else 1, cuda)
                row[f"{variant}_us"] = us
                row[f"{variant}_tb_s"] = nbytes / (us * 1e-6) / 1e12 if cuda else float("nan")
            torch._inductor.config.coordinate_descent_tuning = False
            rows.append(row)
            print(f"gemm {json.dumps(row)}", flush=True)
        del weights
    return rows


def probe_attn_in(device: str, dtype: torch.dtype, out: Path, tiny: bool) -> dict[str, Any]:
    from torch._inductor.utils import run_and_get_code

    cuda = device == "cuda"
    hidden, heads, kv_heads, d = (64, 4, 2, 16) if tiny else (HIDDEN, HEADS, KV_HEADS, D)
    norm = torch.ones(hidden, device=device, dtype=dtype)
    qkv = torch.randn((heads + 2 * kv_heads) * d, hidden, device=device, dtype=dtype) * 0.02
    bias = torch.randn((heads + 2 * kv_heads) * d, device=device, dtype=dtype) * 0.02
    table = torch.randn(1024, d, device=device)
    report: dict[str, Any] = {}
    torch._dynamo.reset()
    compiled = torch.compile(attn_in, dynamic=True, fullgraph=True)
    for b in (64, 1):
        x = torch.randn(b, hidden, device=device, dtype=dtype)
        pos = torch.randint(0, 1000, (b,), device=device)
        cos, sin = table[pos][:, None, :], table[pos][:, None, :]
        args = (x, norm, qkv, bias, cos, sin, 1e-6, heads, kv_heads)
        _, codes = run_and_get_code(compiled, *args)
        (out / f"attn_in_b{b}_code.txt").write_text("\n\n# ----\n\n".join(codes))
        report[f"b{b}_us"] = time_graph(lambda args=args: compiled(*args), 40 if cuda else 1, cuda)
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    compiled(*args)
                torch.cuda.synchronize()
            report[f"b{b}_kernels"] = [
                {"kernel": e.key[:100], "us": e.device_time_total / 10}
                for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]
            ]
        print(f"attn_in b={b}: {report[f'b{b}_us']:.1f} us; {report.get(f'b{b}_kernels')}", flush=True)
    return report


def probe_layer_ops(device: str, dtype: torch.dtype, tiny: bool) -> list[dict[str, Any]]:
    """CPU-side ops of 3 decode steps (the engine's compiled pieces, launched without a graph) of a 2-layer model at
    batch 64: which op launches the device-to-device copies."""
    from torch.profiler import ProfilerActivity, profile

    from miaohui.generation.models.dims import DecoderDims

    dims = DecoderDims(num_layers=2, hidden=64 if tiny else HIDDEN, num_heads=4 if tiny else HEADS,
                       num_kv_heads=KV_HEADS, head_dim=16 if tiny else D, intermediate=128 if tiny else INTER,
                       vocab=512 if tiny else 32000, rope_theta=1e6, rms_eps=1e-6, max_positions=2048)  # fmt: skip
    dec = StaticKVDecoder(dims, num_slots=64, max_len=1024, qkv_bias=True, dtype=dtype, device=device)
    dec.init_random(0)
    dec.use_compiled(functools.partial(torch.compile, dynamic=True, fullgraph=True))  # as the engine does
    tokens = torch.full((64,), 7, device=device)
    positions = torch.full((64,), 100, device=device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.inference_mode():
        dec.decode(tokens, positions, 256)
        with profile(activities=acts) as prof:
            for _ in range(3):
                dec.decode(tokens, positions, 256)
    rows = [{"op": e.key, "calls_per_step": e.count / 3, "device_us_per_step": e.device_time_total / 3}
            for e in sorted(prof.key_averages(), key=lambda e: (-e.device_time_total, -e.count))[:30]]  # fmt: skip
    for r in rows:
        print(f"op {r['calls_per_step']:6.1f}x {r['device_us_per_step']:8.1f} us  {r['op']}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    report: dict[str, Any] = {"model": "qwen1.5b shape (random weights)", "torch": torch.__version__}
    with torch.inference_mode():
        report["gemms"] = probe_gemms(args.device, dtype, 64 if args.tiny else 1)
        report["attn_in"] = probe_attn_in(args.device, dtype, args.out, args.tiny)
    report["layer_ops"] = probe_layer_ops(args.device, dtype, args.tiny)
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    (args.out / "decode_kernel_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
