"""On the GPU: what ``miaohui::proj_ln_proj`` (:mod:`miaohui.models.skinny_ln`) costs against the unfused form it
replaces, at BERT-base's or e5-small's widths and the skinny table's rows (16, 128), fp16, random weights. Each piece
is timed alone as a CUDA graph of 20 calls (median of 30 replays, µs a call), with and without PDL:

* ``unfused``: first GEMM (``skinny_linear``), ``add_layer_norm``, second GEMM — what the engine runs with
  ``--ln-fusion off`` (there Inductor's add + LayerNorm kernel); and each of the three alone;
* ``fused``: ``proj_ln_proj`` (the LayerNorm in the first GEMM's split-K reduce where the table splits it);
  ``first_gemm_ln``: that GEMM with its reduce alone;
* ``fused_split{S}_bk{B}``: the first GEMM forced to split K in S slices of BLOCK_K B (:func:`forced_splits`) so
  that its reduce can do the LayerNorm, for products whose table entry does not split (does the split cost less than
  the kernel it removes?); the winners become ``kernel_tables.LN_SPLIT_H200`` (``kernel_tables.ln_split_entries``);
* ``--add-ln-rows``: ``add_layer_norm`` alone at each launch (rows a program × warps) against Inductor's kernel for
  the same add + LayerNorm, at rows outside the skinny table (where the op runs it).

Session 27's ``s30e`` ran the previous form (the LayerNorm in the second GEMM's prologue): that GEMM took 40 µs
against 4.8 at 128 rows (``ln_fusion_probe_h200_s30e.json``).

    python3 scripts/gpu/ln_fusion_probe.py --out /tmp/lnprobe
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
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


def add_ln_pieces(m: int, n: int, dev: str, dtype: torch.dtype, gen: torch.Generator) -> dict[str, Callable[[], Any]]:
    """``add_layer_norm`` at ``m`` × ``n`` at each launch (rows a program × warps, at most 8,192 elements a program),
    and Inductor's kernel for the same add + LayerNorm (``torch.compile``; CPU: torch's)."""
    a, r = (torch.randn(m, n, generator=gen).to(dev, dtype) for _ in range(2))
    g, beta = torch.ones(n, device=dev, dtype=dtype), torch.zeros(n, device=dev, dtype=dtype)

    def ref() -> torch.Tensor:
        return torch.nn.functional.layer_norm(a + r, (n,), g, beta, 1e-12)

    out: dict[str, Callable[[], Any]] = {"inductor": torch.compile(ref, dynamic=False) if dev == "cuda" else ref}
    for per in (p for p in (1, 2, 4, 8, 16) if p * triton.next_power_of_2(n) <= 8192):
        for warps in (1, 2, 4, 8):
            out[f"rows{per}_w{warps}"] = partial(add_layer_norm, a, r, g, beta, 1e-12, launch=(per, warps))
    return out


def add_ln_sweep(rows: list[int], widths: list[int], dev: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    """:func:`add_ln_pieces` timed at rows the skinny table does not have (there the op runs ``add_layer_norm``)."""
    out: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(1)
    for n in widths:
        for m in rows:
            for name, fn in add_ln_pieces(m, n, dev, dtype, gen).items():
                us = _time_graph(fn, 20, dev == "cuda")
                out.append({"rows": m, "width": n, "launch": name, "us": us})
                print(f"add_ln {m:5d}x{n:<4d} {name:12s} {us:7.2f} us", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--rows", default="16,128")
    ap.add_argument("--add-ln-rows", default="", help="also sweep add_layer_norm's launch at these rows, e.g. 512,4096")
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
                forced = {f"fused_split{c[3]}_bk{c[2]}": c for c in forced_splits(cfg1, k1)}
                for name, fn in pieces(ops, pdl).items():
                    us = _time_graph(fn, 20, cuda)
                    row = {"rows": m, "pair": pair, "pdl": pdl, "piece": name, "us": us}
                    rows_out.append(row | ({"config": list(forced[name])} if name in forced else {}))
                    print(f"{m:4d} {pair:17s} pdl={pdl!s:5s} {name:15s} {us:7.2f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python3 scripts/gpu/ln_fusion_probe.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "gpu": torch.cuda.get_device_name() if cuda else platform.processor(),
        "torch": torch.__version__,
        "hidden": args.hidden,
        "intermediate": args.inter,
        "rows": rows_out,
        "add_ln": add_ln_sweep([int(v) for v in args.add_ln_rows.split(",") if v], [h], dev, dtype),
    }
    (args.out / "ln_fusion_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
