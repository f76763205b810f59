"""On the GPU: a chain of an encoder's GEMMs (four per layer × 12 layers, BERT-base's widths by default) at M = 16
and 128 rows (1×16, 1×128), fp16, random weights, each GEMM reading the one before it (QKV → its first ``hidden``
columns → attention out → FFN in + GELU → FFN out → next layer), captured as one CUDA graph:

* ``cublas``: ``F.linear`` / ``torch._addmm_activation`` with its GELU epilogue (the library kernels);
* ``skinny``: :func:`miaohui.models.skinny_gemm.skinny_linear` with the configurations of ``--sweep``
  (``encoder_gemm_sweep``'s fastest per product) or the GPU's tuning file;
* ``skinny_pdl``: the same kernels launched as programmatic dependents (``pdl=True``): each may be launched while
  the one before it runs and waits on the GPU for its writes.

Per row: µs per chain (median of 30 replays, :mod:`lab.harness`), µs per GEMM, kernels per chain, and the largest
relative error against cuBLAS (PDL must give the ``skinny`` output exactly). ``scripts/gpu/tune.py`` keeps the rows
where ``skinny_pdl`` beats ``cublas`` (``miaohui.models.tuning.rules.skinny_entries``).

    python -m lab.probes.pdl_probe --hidden 384 --inter 1536 --sweep /tmp/e5gemm/encoder_gemm_sweep.json --out /tmp/pdl
    TRITON_INTERPRET=1 python -m lab.probes.pdl_probe --device cpu --out /tmp/pdl   # smoke test: no timing, no PDL
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from lab.harness import time_graph, write_report
from miaohui.models import tuning
from miaohui.models.skinny_gemm import skinny_linear
from miaohui.models.tuning import SkinnyConfig

HIDDEN, INTER, LAYERS = 768, 3072, 12
SHAPES = tuning.products(HIDDEN, INTER)
"""GEMM → (N, K) of its weight (BERT-base; ``--hidden`` / ``--inter`` set others)."""
CONFIGS: dict[int, dict[str, SkinnyConfig]] = {}
"""Rows → GEMM → (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps): with ``--sweep`` the sweep's fastest configuration
per product, whether or not it beat cuBLAS alone (PDL may change that); else the tuning file's."""


def configs_from_tuning(hidden: int, inter: int) -> dict[int, dict[str, SkinnyConfig]]:
    """The committed H200 tuning file's skinny rows for these widths (BERT-base's for widths it has none of)."""
    models = tuning.load(tuning.TUNING_DIR / "nvidia-h200-sm90.json").models
    found = next((m for m in models if (m.hidden, m.intermediate) == (hidden, inter)), None)
    return {rows: dict(cfgs) for rows, cfgs in (found or models[0]).skinny.items()}


def configs_from_sweep(report: dict[str, Any]) -> dict[int, dict[str, SkinnyConfig]]:
    """``encoder_gemm_sweep.py``'s ``best`` entries → rows → GEMM → configuration."""
    out: dict[int, dict[str, SkinnyConfig]] = {}
    for e in report["best"]:
        bm, bn, bk, split, warps = (int(v) for v in e["config"])
        out.setdefault(int(e["m"]), {})[str(e["gemm"])] = (bm, bn, bk, split, warps)
    return out


Weights = list[dict[str, tuple[torch.Tensor, torch.Tensor]]]


def _weights(layers: int, device: str, dtype: torch.dtype) -> Weights:
    gen = torch.Generator(device="cpu").manual_seed(0)
    return [
        {name: (torch.randn(n, k, generator=gen) * k**-0.5, torch.randn(n, generator=gen) * 0.02) for name, (n, k) in
         SHAPES.items()}
        for _ in range(layers)
    ]  # fmt: skip


def _chain(x: torch.Tensor, weights: Weights, gemm: Callable[[str, torch.Tensor, Any], torch.Tensor]) -> torch.Tensor:
    for layer in weights:
        h = gemm("qkv", x, layer["qkv"])[:, : layer["attn_out"][0].shape[1]]
        h = gemm("attn_out", h, layer["attn_out"])
        h = gemm("ffn_in", h, layer["ffn_in"])
        x = gemm("ffn_out", h, layer["ffn_out"])
    return x


def _cublas(name: str, x: torch.Tensor, wb: Any) -> torch.Tensor:
    if name == "ffn_in":
        if x.is_cuda:
            return torch._addmm_activation(wb[1], x, wb[0].t(), use_gelu=True)
        return F.gelu(F.linear(x, wb[0], wb[1]), approximate="tanh")
    return F.linear(x, wb[0], wb[1])


def _skinny(rows: int, pdl: bool) -> Callable[[str, torch.Tensor, Any], torch.Tensor]:
    def run(name: str, x: torch.Tensor, wb: Any) -> torch.Tensor:
        return skinny_linear(x, wb[0], wb[1], CONFIGS[rows][name], gelu=name == "ffn_in", pdl=pdl)

    return run


def _time_chain(fn: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """(median µs of 30 replays of a graph holding one chain, kernels per chain: one call profiled)."""
    us = time_graph(fn, 1, True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return us, float(kernels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="16,128")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--inter", type=int, default=INTER)
    ap.add_argument("--sweep", type=Path, help="encoder_gemm_sweep.py's JSON for these widths: its configurations")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    global SHAPES, CONFIGS
    SHAPES = tuning.products(args.hidden, args.inter)
    if args.sweep:
        CONFIGS = configs_from_sweep(json.loads(args.sweep.read_text()))
    else:
        CONFIGS = configs_from_tuning(args.hidden, args.inter)
    cuda = args.device == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    layers = LAYERS if cuda else 1
    weights = [{k: (w.to(args.device, dtype), b.to(args.device, dtype)) for k, (w, b) in layer.items()}
               for layer in _weights(layers, args.device, dtype)]  # fmt: skip
    report: dict[str, Any] = {"layers": layers, "dtype": str(dtype), "rows": [], "hidden": args.hidden,
                              "intermediate": args.inter, "configs": CONFIGS}  # fmt: skip
    variants = {"cublas": lambda rows: _cublas, "skinny": lambda rows: _skinny(rows, False)}
    if cuda:
        variants["skinny_pdl"] = lambda rows: _skinny(rows, True)
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.hidden, generator=torch.Generator().manual_seed(rows)).to(args.device, dtype)
        outs: dict[str, torch.Tensor] = {}
        for name, make in variants.items():
            gemm = make(rows)
            try:
                outs[name] = _chain(x, weights, gemm).float()
                us, kernels = _time_chain(functools.partial(_chain, x, weights, gemm)) if cuda else (float("nan"), 0.0)
            except Exception as e:  # a variant that cannot run here (PDL on an older Triton) is reported, not fatal
                report["rows"].append({"rows": rows, "variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"{rows} rows {name}: {type(e).__name__}: {e}"[:300])
                continue
            ref = outs["cublas"]
            err = float((outs[name] - ref).abs().max() / ref.abs().max())
            gemms = 4 * layers
            row = {"rows": rows, "variant": name, "us_per_chain": us, "us_per_gemm": us / gemms,
                   "kernels_per_chain": kernels, "max_rel_err_vs_cublas": err}  # fmt: skip
            if name == "skinny_pdl" and "skinny" in outs:
                row["equals_skinny"] = bool(torch.equal(outs[name], outs["skinny"]))
            report["rows"].append(row)
            print(f"{rows:4d} rows {name:11s} {us:8.1f} us/chain {us / gemms:6.2f} us/GEMM {kernels:5.0f} kernels "
                  f"err {err:.1e}")  # fmt: skip
    write_report(args.out, "pdl_probe", report)


if __name__ == "__main__":
    main()
