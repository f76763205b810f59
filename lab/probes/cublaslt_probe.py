"""On the GPU: does timing cuBLASLt's candidate algorithms (TensorRT's tactic selection) beat the one torch runs?

For an encoder layer's four GEMMs (BERT-base by default) at the given row counts, fp16, random weights:
- ``torch``: what the engine runs today at these rows — ``F.linear`` with its bias (cuBLASLt's bias epilogue,
  heuristic's first algorithm), ``torch._addmm_activation(..., use_gelu=True)`` for the FFN's first GEMM;
- ``lt``: the same product through :class:`miaohui.models.cublaslt.LtLinear` with each of the heuristic's first
  ``--candidates`` algorithms (the first should time as ``torch``) and, with ``--pool`` (the default), those it
  offers for the same product at other row counts (an algorithm is not tied to a shape), each checked against fp32;
  torch's call is timed again after them (``torch_again_us``: how much its own figure moves).

Each time is a CUDA graph of 20 calls over weights rotated past L2 (:mod:`lab.harness`). ``scripts/gpu/tune.py`` runs
it for the tuning file's cuBLASLt entries (``miaohui.models.tuning.rules.lt_entries``).

    python -m lab.probes.cublaslt_probe --rows 512,4096,16384 --out /tmp/ltprobe
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from lab.harness import rotating, time_graph, write_report
from miaohui.models import cublaslt
from miaohui.models.tuning import products

REPS = 20


def probe(rows: tuple[int, ...], hidden: int, inter: int, candidates: int, pool: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"best": [], "candidates": []}
    for m in rows:
        for name, (n, k) in products(hidden, inter).items():
            entry = _product(m, name, n, k, candidates, pool, report["candidates"])
            if entry is not None:
                report["best"].append(entry)
                print(json.dumps({k: v for k, v in entry.items() if not isinstance(v, dict)}), flush=True)
    for m in rows:
        at = [e for e in report["best"] if e["m"] == m]
        report[f"layer_us_m{m}"] = {"torch": sum(e["torch_us"] for e in at), "lt_best": sum(e["best_us"] for e in at)}
    return report


def _product(
    m: int, name: str, n: int, k: int, candidates: int, pool: bool, log: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """One product at ``m`` rows: torch's call and each candidate algorithm; None if none ran."""
    dtype, gelu = torch.float16, name == "ffn_in"
    copies = max(1, min(40, (400 << 20) // (n * k * 2)))
    wbs = [(torch.randn(n, k, device="cuda", dtype=dtype) * 0.03, torch.randn(n, device="cuda", dtype=dtype))
           for _ in range(copies)]  # fmt: skip
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    want = F.linear(x.float(), wbs[0][0].float(), wbs[0][1].float())
    want = F.gelu(want, approximate="tanh") if gelu else want

    def ref(wb: Any) -> torch.Tensor:
        if gelu:
            return torch._addmm_activation(wb[1], x, wb[0].t(), use_gelu=True)
        return F.linear(x, wb[0], wb[1])

    torch_us = time_graph(rotating(ref, items=wbs), REPS, True)
    plan = cublaslt.LtLinear(m, n, k, dtype, "gelu_bias" if gelu else "bias")
    timed = []
    for i, algo in enumerate(plan.candidates(candidates) if pool else plan.algos(candidates)):
        try:
            us = time_graph(rotating(lambda wb, a=algo: plan(x, wb[0], wb[1], a), items=wbs), REPS, True)
            got = plan(x, wbs[0][0], wbs[0][1], algo).float()
            err = float((got - want).abs().max() / want.abs().max())
        except Exception as exc:  # an algorithm that fails at this shape is a finding, not a stop
            log.append({"gemm": name, "m": m, "rank": i, "error": repr(exc)[:200]})
            continue
        rec = {"gemm": name, "m": m, "rank": i, "us": us, "rel_err": err, **cublaslt.summary(algo)}
        log.append(rec)
        if err < 5e-3:
            timed.append(rec)
    torch_again_us = time_graph(rotating(ref, items=wbs), REPS, True)  # how much torch's own figure moves
    if not timed:
        print(json.dumps({"gemm": name, "m": m, "error": "no candidate ran within 5e-3 of fp32"}))
        return None
    best = min(timed, key=lambda r: r["us"])
    entry = {"gemm": name, "m": m, "n": n, "k": k, "torch_us": torch_us, "torch_again_us": torch_again_us,
             "lt_first_us": timed[0]["us"] if timed[0]["rank"] == 0 else None, "best_us": best["us"],
             "best_rank": best["rank"], "candidates": len(timed), "gain": 1 - best["us"] / torch_us,
             "best": best}  # fmt: skip
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--rows", default="512,4096,16384")
    ap.add_argument("--candidates", type=int, default=24)
    ap.add_argument(
        "--pool",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the algorithms the heuristic offers for the same product at other row counts",
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/ltprobe"))
    args = ap.parse_args()
    with torch.inference_mode():
        report = probe(tuple(int(r) for r in args.rows.split(",")), args.hidden, args.inter, args.candidates, args.pool)
    report |= {"model": f"encoder GEMMs (hidden {args.hidden}, FFN {args.inter}), fp16, random weights",
               "hidden": args.hidden, "intermediate": args.inter, "pool": args.pool,
               "cublaslt": cublaslt.version()}  # fmt: skip
    for key, v in report.items():
        if key.startswith("layer_us_m"):
            print(f"{key}: torch {v['torch']:.1f} µs, cuBLASLt best {v['lt_best']:.1f}")
    write_report(args.out, "cublaslt_probe", report)


if __name__ == "__main__":
    main()
