"""On the GPU: what ``miaohui::proj_ln_proj`` (:mod:`miaohui.models.skinny_ln`) costs against the unfused form it
replaces, at an encoder's widths (BERT-base's by default) and the skinny configurations' rows (16, 128), fp16, random
weights. Each piece is timed alone as a CUDA graph of 20 calls (median of 30 replays, µs a call, :mod:`lab.harness`),
with and without PDL:

* ``unfused``: first GEMM (``skinny_linear``), ``add_layer_norm``, second GEMM; and each of the three alone;
* ``fused``: ``proj_ln_proj`` (the LayerNorm in the first GEMM's split-K reduce where its configuration splits K);
  ``first_gemm_ln``: that GEMM with its reduce alone;
* ``fused_split{S}_bk{B}``: the first GEMM forced to split K in S slices of BLOCK_K B (:func:`forced_splits`) so
  that its reduce can do the LayerNorm, for products whose configuration does not split (does the split cost less
  than the kernel it removes?); ``scripts/gpu/tune.py`` keeps the winners
  (``miaohui.models.tuning.rules.ln_split_entries``).

The skinny configurations: ``--skinny FILE`` (rows → GEMM → configuration, as ``tune.py`` writes them), else the
committed H200 tuning file's.

    python -m lab.probes.ln_fusion_probe --out /tmp/lnprobe
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lab.harness import time_graph, write_report
from lab.probes.pdl_probe import configs_from_tuning
from miaohui.models import skinny_gemm, tuning
from miaohui.models.skinny_gemm import skinny_linear
from miaohui.models.skinny_ln import add_layer_norm, proj_ln_proj
from miaohui.models.tuning import SkinnyConfig


class Operands(NamedTuple):
    x: torch.Tensor
    w1: torch.Tensor
    b1: torch.Tensor
    r: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    cfg1: SkinnyConfig
    cfg2: SkinnyConfig
    gelu: bool


def pieces(o: Operands, pdl: bool) -> dict[str, Callable[[], Any]]:
    """Each timed piece as a call (its inputs made once, before the graph)."""
    s = skinny_linear(o.x, o.w1, o.b1, o.cfg1)
    hn = add_layer_norm(s, o.r, o.g, o.beta, 1e-12)
    ln = (o.r, o.g, o.beta, 1e-12)

    def unfused() -> Any:
        a = add_layer_norm(skinny_linear(o.x, o.w1, o.b1, o.cfg1, pdl=pdl), o.r, o.g, o.beta, 1e-12, pdl=pdl)
        return skinny_linear(a, o.w2, o.b2, o.cfg2, gelu=o.gelu, pdl=pdl)

    def forced(cfg: SkinnyConfig) -> Callable[[], Any]:
        return lambda: skinny_linear(
            skinny_linear(o.x, o.w1, o.b1, cfg, pdl=pdl, residual_ln=ln), o.w2, o.b2, o.cfg2, gelu=o.gelu, pdl=pdl
        )

    out: dict[str, Callable[[], Any]] = {
        "unfused": unfused,
        "first_gemm": lambda: skinny_linear(o.x, o.w1, o.b1, o.cfg1, pdl=pdl),
        "add_layer_norm": lambda: add_layer_norm(s, o.r, o.g, o.beta, 1e-12, pdl=pdl),
        "second_gemm": lambda: skinny_linear(hn, o.w2, o.b2, o.cfg2, gelu=o.gelu, pdl=pdl),
        "fused": lambda: proj_ln_proj(o.x, o.w1, o.b1, o.r, o.g, o.beta, 1e-12, o.w2, o.b2, o.gelu),
    }
    if o.cfg1[3] > 1:
        out["first_gemm_ln"] = lambda: skinny_linear(o.x, o.w1, o.b1, o.cfg1, pdl=pdl, residual_ln=ln)
    else:
        out |= {f"fused_split{c[3]}_bk{c[2]}": forced(c) for c in forced_splits(o.cfg1, o.x.shape[-1])}
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def forced_splits(cfg: SkinnyConfig, k: int) -> list[SkinnyConfig]:
    """``cfg``'s tile with K split in 2, 3, 4 or 6 and slices of BLOCK_K 64 or 128, where every slice has work (the
    kernel gives each of SPLIT programs ``cdiv(cdiv(K, SPLIT), BLOCK_K)`` steps: K 768 in 4 of 128 leaves one idle)."""
    out = []
    for split in (2, 3, 4, 6):
        for bk in (64, 128):
            steps = _cdiv(_cdiv(k, split), bk)
            if (split - 1) * steps * bk < k:
                out.append((cfg[0], cfg[1], bk, split, cfg[4]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--rows", default="16,128")
    ap.add_argument("--skinny", type=Path, help="JSON rows → GEMM → configuration (default: the tuning file's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.float16 if cuda else torch.float32
    if args.skinny:
        by_rows = {int(m): {g: tuple(c) for g, c in v.items()} for m, v in json.loads(args.skinny.read_text()).items()}
    else:
        by_rows = configs_from_tuning(args.hidden, args.inter)
    gemms = tuning.products(args.hidden, args.inter)
    table = {(m, *gemms[g]): cfg for m, row in by_rows.items() for g, cfg in row.items()}
    skinny_gemm.SKINNY_BEST.update(table)  # type: ignore[arg-type]
    h = args.hidden
    pairs = {"attn_out->ffn_in": (h, h, args.inter, True), "ffn_out->qkv": (args.inter, h, 3 * h, False)}
    names = {"attn_out->ffn_in": ("attn_out", "ffn_in"), "ffn_out->qkv": ("ffn_out", "qkv")}
    rows_out: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    for m in (int(v) for v in args.rows.split(",")):
        for pair, (k1, hid, n2, gelu) in pairs.items():
            x, w1, b1, r = rnd(m, k1), rnd(hid, k1, scale=k1**-0.5), rnd(hid, scale=0.1), rnd(m, hid)
            g, beta = (1 + 0.1 * torch.randn(hid, generator=gen)).to(dev, dtype), rnd(hid, scale=0.1)
            w2, b2 = rnd(n2, hid, scale=hid**-0.5), rnd(n2, scale=0.1)
            cfg1 = by_rows[m][names[pair][0]]
            cfg2 = by_rows[m][names[pair][1]]
            skinny_gemm.SKINNY_BEST.update({(m, hid, k1): cfg1, (m, n2, hid): cfg2})
            ops = Operands(x, w1, b1, r, g, beta, w2, b2, cfg1, cfg2, gelu)
            for pdl in (False, True) if cuda else (False,):  # the interpreter has no PDL
                skinny_gemm.SKINNY_PDL = pdl
                forced = {f"fused_split{c[3]}_bk{c[2]}": c for c in forced_splits(cfg1, k1)}
                for name, fn in pieces(ops, pdl).items():
                    us = time_graph(fn, 20, cuda)
                    row = {"rows": m, "pair": pair, "pdl": pdl, "piece": name, "us": us}
                    rows_out.append(row | ({"config": list(forced[name])} if name in forced else {}))
                    print(f"{m:4d} {pair:17s} pdl={pdl!s:5s} {name:15s} {us:7.2f} us", flush=True)
    report = {"hidden": args.hidden, "intermediate": args.inter, "rows": rows_out}
    write_report(args.out, "ln_fusion_probe", report)


if __name__ == "__main__":
    main()
