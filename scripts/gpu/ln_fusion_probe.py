"""On the GPU: what ``miaohui::proj_ln_proj`` (:mod:`miaohui.models.skinny_ln`) costs against the unfused form it
replaces, at BERT-base's or e5-small's widths and the skinny table's rows (16, 128), fp16, random weights. Each piece
is timed alone as a CUDA graph of 20 calls (median of 30 replays, µs a call), with and without PDL:

* ``unfused``: first GEMM (``skinny_linear``), ``add_layer_norm``, second GEMM — what the engine runs with
  ``--ln-fusion off`` (there Inductor's add + LayerNorm kernel); and each of the three alone;
* ``fused``: ``proj_ln_proj`` (the LayerNorm in the first GEMM's split-K reduce where the table splits it);
  ``first_gemm_ln``: that GEMM with its reduce alone;
* ``fused_split2`` / ``fused_split4``: the first GEMM forced to split K in 2 / 4 so that its reduce can do the
  LayerNorm, for products whose table entry does not split (does the split cost less than the kernel it removes?).

Session 27's ``s30e`` ran the previous form (the LayerNorm in the second GEMM's prologue): that GEMM took 40 µs
against 4.8 at 128 rows (``ln_fusion_probe_h200_s30e.json``).

    python3 scripts/gpu/ln_fusion_probe.py --out /tmp/lnprobe
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from decode_kernel_probe import _time_graph

from miaohui.models import kernel_tables, skinny_gemm
from miaohui.models.skinny_gemm import SkinnyConfig, skinny_linear
from miaohui.models.skinny_ln import add_layer_norm, proj_ln_proj


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

    def forced(split: int) -> Callable[[], Any]:
        cfg = (*o.cfg1[:3], split, o.cfg1[4])
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
        out |= {"fused_split2": forced(2), "fused_split4": forced(4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--rows", default="16,128")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.float16 if cuda else torch.float32
    table = kernel_tables.skinny_table(args.hidden, args.inter)
    skinny_gemm.SKINNY_BEST.update(table)
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
            default = kernel_tables.SKINNY_ROWS[m]  # widths without a table (the CPU smoke test): BERT-base's
            cfg1 = table.get((m, hid, k1), default[names[pair][0]])
            cfg2 = table.get((m, n2, hid), default[names[pair][1]])
            skinny_gemm.SKINNY_BEST.update({(m, hid, k1): cfg1, (m, n2, hid): cfg2})
            ops = Operands(x, w1, b1, r, g, beta, w2, b2, cfg1, cfg2, gelu)
            for pdl in (False, True) if cuda else (False,):  # the interpreter has no PDL
                skinny_gemm.SKINNY_PDL = pdl
                for name, fn in pieces(ops, pdl).items():
                    us = _time_graph(fn, 20, cuda)
                    rows_out.append({"rows": m, "pair": pair, "pdl": pdl, "piece": name, "us": us})
                    print(f"{m:4d} {pair:17s} pdl={pdl!s:5s} {name:15s} {us:7.2f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python3 scripts/gpu/ln_fusion_probe.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "gpu": torch.cuda.get_device_name() if cuda else platform.processor(),
        "torch": torch.__version__,
        "hidden": args.hidden,
        "intermediate": args.inter,
        "rows": rows_out,
    }
    (args.out / "ln_fusion_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
