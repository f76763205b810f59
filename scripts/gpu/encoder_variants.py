"""On the GPU: which change to the encoder engine would bring BERT-base (12×768, random weights) fp16 at 1×128 to
≤ 0.35 ms (engine: 0.485) and 32×128 to ≥ 60 % of the 790 TFLOP/s peak (engine: 48 %)? Tried before building any:

* ``dynamic``: ``torch.compile(dynamic=True)`` of :class:`FastBert`'s classifier (what the engine compiles: one graph
  for every bucket);
* ``static``: compiled for each (batch, seq) alone (``dynamic=False``): static sizes in every kernel;
* ``static_cudnn``: ``static`` with SDPA's cuDNN attention backend (Hopper's fused attention with a bias);
* ``static_gelu_epi``: ``static`` with the FFN's first GEMM, bias and GELU (tanh form) as one cuBLASLt call
  (``torch._addmm_activation``; :func:`miaohui.models.fast_bert.use_fused_gelu`, which session 11 built into the
  engine after this probe);
* ``static_autotune``: ``static`` with Inductor's max-autotune (Triton GEMM templates with fused epilogues against
  cuBLAS, for these exact sizes; the dynamic-shape autotune lost to cuBLAS in session 6);
* ``static_skinny``: ``static_gelu_epi`` with the four GEMMs through ``miaohui::skinny_linear``
  (:mod:`miaohui.models.skinny_gemm`, session 17): the small-tile split-K Triton GEMM for the products
  ``--skinny-table`` (``encoder_gemm_sweep.py``'s JSON) found faster than cuBLAS, cuBLAS for the rest; without the
  table, every product at 16 and 128 rows with ``pdl_probe.py``'s configurations (session 18's best);
* ``static_skinny_pdl``: ``static_skinny`` with Hopper's programmatic dependent launch for the skinny GEMMs
  (``skinny_gemm.SKINNY_PDL``) and for Inductor's own Triton kernels (``triton.enable_pdl``; not its GEMM
  templates, nor SDPA's attention): with the table of every product, all but the attention are PDL launches;
* ``static_triton_attn``: ``static_gelu_epi`` with the attention as miaohui's Triton kernel reading q, k, v from the
  QKV output (:mod:`miaohui.models.encoder_attention`) instead of the permutes, cuDNN's kernel and its memsets;
* ``static_skinny_pdl_attn``: both of the last two (what the prepared pieces give together at 1×16 / 1×128);
  ``dynamic_skinny_pdl_attn``: the same compiled with dynamic shapes (as the engine compiles its program);
* ``static_skinny_ln``: ``static_skinny`` with each inner LayerNorm as ``miaohui::proj_ln_proj``
  (:mod:`miaohui.models.skinny_ln`: done by the split-K reduce of the product before it where the skinny table splits
  that product); ``static_skinny_ln_pdl_attn``: with PDL and the Triton attention too (the engine's kernels with
  ``ln_fusion``).

Each variant: a CUDA graph of one call, CUDA events, median/p99 of ``--iters`` replays; relative error against fp32
eager; the graph's kernel table (kernels per call, top kernels). Then a "floor": each of a layer's four GEMMs and
its attention timed alone at the same rows, × 12 layers — **not usable as measured**: each is a one-kernel CUDA graph
timed with events, ~25 µs whatever the size, i.e. launch overhead (session 11); the kernel tables are the real figures.

    python3 scripts/gpu/encoder_variants.py --out /tmp/encvar
    python3 scripts/gpu/encoder_variants.py --device cpu --tiny --out /tmp/encvar   # smoke test, no timing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
import torch.nn.functional as F

from miaohui.models import encoder_attention, fast_bert, skinny_gemm
from miaohui.models.intent import IntentClassifier, random_bert

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_gpu_encoder import kernel_table

PEAK_TFLOPS = 790.0
PARTS: dict[str, set[str]] = {
    "dynamic": set(),
    "static": set(),
    "static_cudnn": set(),
    "static_autotune": set(),
    "static_gelu_epi": {"fused_gelu"},
    "static_skinny": {"fused_gelu", "skinny"},
    "static_skinny_pdl": {"fused_gelu", "skinny", "pdl"},
    "static_triton_attn": {"fused_gelu", "triton_attention"},
    "static_skinny_pdl_attn": {"fused_gelu", "skinny", "pdl", "triton_attention"},
    "dynamic_skinny_pdl_attn": {"fused_gelu", "skinny", "pdl", "triton_attention"},
    "static_skinny_ln": {"fused_gelu", "skinny", "ln_fusion"},
    "static_skinny_ln_pdl_attn": {"fused_gelu", "skinny", "ln_fusion", "pdl", "triton_attention"},
}
"""Variant → the model's switches (``fast_bert.use_*``) and PDL for the skinny kernels and Inductor's."""


def flops(h: int, inter: int, layers: int, b: int, s: int) -> float:
    return layers * (b * s * 2 * (4 * h * h + 2 * h * inter) + b * 4 * s * s * h)


def graph_fn(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], cuda: bool) -> Callable[[], Any]:
    """A zero-argument replay of ``fn(*args)`` captured as a CUDA graph (CPU: the call itself)."""
    if not cuda:
        return lambda: fn(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_fn.out = fn(*args)  # type: ignore[attr-defined]
    return graph.replay


def time_replay(replay: Callable[[], Any], iters: int, cuda: bool) -> dict[str, float]:
    if not cuda:
        replay()
        return {"median_ms": float("nan"), "p99_ms": float("nan")}
    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in pairs:
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in pairs)
    return {"median_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))]}


def floor(
    h: int, inter: int, heads: int, layers: int, b: int, s: int, dtype: torch.dtype, cuda: bool
) -> dict[str, Any]:
    """Each GEMM of a layer (cuBLAS, bias in the epilogue) and the attention alone, µs, × layers."""
    dev = "cuda" if cuda else "cpu"
    x = torch.randn(b * s, h, device=dev, dtype=dtype)
    out: dict[str, Any] = {}
    for name, (k, n) in {"qkv": (h, 3 * h), "o": (h, h), "ffn_in": (h, inter), "ffn_out": (inter, h)}.items():
        w, bias = torch.randn(n, k, device=dev, dtype=dtype) * 0.02, torch.zeros(n, device=dev, dtype=dtype)
        a = torch.randn(b * s, k, device=dev, dtype=dtype) if k != h else x
        out[name] = time_replay(graph_fn(F.linear, (a, w, bias), cuda), 200, cuda)["median_ms"] * 1000
    q = torch.randn(b, heads, s, h // heads, device=dev, dtype=dtype)
    mask = torch.zeros(b, 1, 1, s, device=dev, dtype=dtype)
    out["sdpa_mask"] = (
        time_replay(graph_fn(F.scaled_dot_product_attention, (q, q, q, mask), cuda), 200, cuda)["median_ms"] * 1000
    )
    out["sdpa_nomask"] = (
        time_replay(graph_fn(F.scaled_dot_product_attention, (q, q, q), cuda), 200, cuda)["median_ms"] * 1000
    )
    out["per_layer_us"] = sum(out[n] for n in ("qkv", "o", "ffn_in", "ffn_out", "sdpa_mask"))
    out["model_floor_ms"] = out["per_layer_us"] * layers / 1000
    return out


def probe_table() -> dict[tuple[int, int, int], tuple[int, int, int, int, int]]:
    """(M, N, K) → skinny configuration for each of BERT-base's four products at 16 and 128 rows, from
    ``pdl_probe.py`` (the configurations its PDL chain is timed with)."""
    from pdl_probe import CONFIGS, SHAPES

    return {(rows, n, k): configs[name] for rows, configs in CONFIGS.items() for name, (n, k) in SHAPES.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shapes", default="1x16,1x128,32x128")
    ap.add_argument("--variants", default="dynamic,static,static_cudnn,static_gelu_epi,static_autotune")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("/tmp/encvar"))
    ap.add_argument("--skinny-table", type=Path, help="encoder_gemm_sweep.py's JSON (static_skinny)")
    ap.add_argument("--attn-table", type=Path, help="attn_probe.py's JSON (the *_attn variants' configurations)")
    args = ap.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(PARTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {sorted(PARTS)}")
    if "skinny" in args.variants:
        table = skinny_gemm.table_from_sweep(json.loads(args.skinny_table.read_text())) if args.skinny_table else None
        skinny_gemm.SKINNY_BEST.update(table or probe_table())
        print("skinny products:", skinny_gemm.SKINNY_BEST, flush=True)
    if args.attn_table:
        encoder_attention.ATTN_BEST.update(encoder_attention.table_from_probe(json.loads(args.attn_table.read_text())))
        print("attention configurations:", encoder_attention.ATTN_BEST, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    h, layers, heads, inter = (64, 2, 4, 256) if args.tiny else (768, 12, 12, 3072)
    dtype = torch.float16 if cuda else torch.float32
    enc = random_bert(hidden=h, layers=layers, heads=heads, vocab=21128, intermediate=inter, seed=0)
    classifier = IntentClassifier(enc, 24).eval()
    ref32 = fast_bert.from_module(classifier).to(args.device)
    model = fast_bert.from_module(classifier).to(args.device, dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    report: dict[str, Any] = {"model": f"BERT {layers}x{h} (random weights) fp16", "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if cuda else "cpu", "results": []}  # fmt: skip
    inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for b, s in shapes:  # inputs and the fp32 reference (erf GELU)
        ids = torch.randint(5, 21128, (b, s), device=args.device)
        mask = torch.ones(b, s, dtype=torch.int64, device=args.device)
        mask[0, s // 2 :] = 0  # one padded row: the mask is exercised
        with torch.inference_mode():
            inputs[(b, s)] = (ids, mask, ref32(ids, mask))
    for variant in args.variants.split(","):
        for b, s in shapes:
            torch._dynamo.reset()
            parts = PARTS[variant]
            fast_bert.use_fused_gelu(model, "fused_gelu" in parts)
            fast_bert.use_skinny(model, "skinny" in parts)
            fast_bert.use_ln_fusion(model, "ln_fusion" in parts)
            fast_bert.use_triton_attention(model, "triton_attention" in parts)
            pdl = "pdl" in parts
            skinny_gemm.SKINNY_PDL = pdl
            mode = "max-autotune-no-cudagraphs" if variant == "static_autotune" else None
            compiled = torch.compile(model, dynamic=variant.startswith("dynamic"), fullgraph=True, mode=mode)
            fn: Callable[..., torch.Tensor] = compiled
            if variant == "static_cudnn":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                def fn(ids: torch.Tensor, mask: torch.Tensor, compiled: Any = compiled) -> torch.Tensor:
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return compiled(ids, mask)

            ids, mask, ref = inputs[(b, s)]
            row: dict[str, Any] = {"variant": variant, "batch": b, "seq": s}
            try:
                t0 = time.perf_counter()
                inductor_pdl = torch._inductor.config.patch({"triton.enable_pdl": True}) if pdl else nullcontext()
                with torch.inference_mode(), inductor_pdl:
                    out = fn(ids, mask)
                    row["compile_s"] = round(time.perf_counter() - t0, 1)
                    row["rel_err"] = float((out.float() - ref).norm() / ref.norm())
                    replay = graph_fn(fn, (ids, mask), cuda)
                    row |= time_replay(replay, args.iters, cuda)
                    row["tflops"] = flops(h, inter, layers, b, s) / (row["median_ms"] * 1e-3) / 1e12
                    row["pct_peak"] = 100 * row["tflops"] / PEAK_TFLOPS
                    if cuda and s == 128:
                        row["kernels"] = kernel_table(replay, (), top=12)  # bench_gpu_encoder's table
            except Exception as exc:  # a variant that fails is a finding, not the end of the probe
                row["error"] = repr(exc)[:400]
            report["results"].append(row)
            brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "kernels"}
            print(json.dumps(brief), flush=True)
            if "kernels" in row:
                kt = row["kernels"]
                print(
                    f"  kernels/call {kt['kernels_per_call']:.0f}, device {kt['device_us_per_call']:.0f} us", flush=True
                )
                for k in kt["top"]:
                    print(f"    {k['per_call']:5.1f}x {k['us_per_call']:8.2f} us  {k['kernel']}", flush=True)
    fast_bert.use_fused_gelu(model, False)
    fast_bert.use_skinny(model, False)
    fast_bert.use_ln_fusion(model, False)
    fast_bert.use_triton_attention(model, False)
    skinny_gemm.SKINNY_PDL = False
    with torch.inference_mode():
        report["floor"] = {f"{b}x{s}": floor(h, inter, heads, layers, b, s, dtype, cuda) for b, s in shapes}
    print("floor:", json.dumps(report["floor"]), flush=True)
    (args.out / "encoder_variants.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
