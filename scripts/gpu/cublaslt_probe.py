"""On the GPU: does timing cuBLASLt's candidate algorithms (TensorRT's tactic selection) beat the one torch runs?

For an encoder layer's four GEMMs (BERT-base by default) at the given row counts, fp16, random weights:
- ``torch``: what the engine runs today at these rows — ``F.linear`` with its bias (cuBLASLt's bias epilogue,
  heuristic's first algorithm), ``torch._addmm_activation(..., use_gelu=True)`` for the FFN's first GEMM;
- ``lt``: the same product through :class:`miaohui.models.cublaslt.LtLinear` with each of the heuristic's first
  ``--candidates`` algorithms (the first should time as ``torch``) and, with ``--pool`` (the default), those it
  offers for the same product at other row counts (an algorithm is not tied to a shape), each checked against fp32;
  torch's call is timed again after them (``torch_again_us``: how much its own figure moves);
- ``lt_residual``: for the two products a LayerNorm follows (attention output, FFN output), the residual added as
  cuBLASLt's C (beta 1), best algorithm — and the add + LayerNorm after it with two inputs (today) against the
  LayerNorm of one input (what the residual in the GEMM would leave), both as Inductor compiles them.

Each time is a CUDA graph of 20 calls over weights rotated past L2 (``decode_kernel_probe._time_graph``).

    python3 scripts/gpu/cublaslt_probe.py --rows 512,4096,16384 --out /tmp/ltprobe
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from decode_kernel_probe import _time_graph
from torch.nn import functional as F

from miaohui.models import cublaslt
from miaohui.models.kernel_tables import bert_products

REPS = 20


def _rotating(fn: Any, copies: list[Any]) -> Any:
    turn = [0]

    def call() -> Any:
        turn[0] = (turn[0] + 1) % len(copies)
        return fn(copies[turn[0]])

    return call


def probe(rows: tuple[int, ...], hidden: int, inter: int, candidates: int, pool: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"best": [], "candidates": [], "layernorm": []}
    for m in rows:
        for name, (n, k) in bert_products(hidden, inter).items():
            entry = _product(m, name, n, k, candidates, pool, report["candidates"])
            if entry is not None:
                report["best"].append(entry)
                print(json.dumps({k: v for k, v in entry.items() if not isinstance(v, dict)}), flush=True)
        report["layernorm"].append(_layernorm(m, hidden))
        print(json.dumps(report["layernorm"][-1]), flush=True)
    for m in rows:
        at = [e for e in report["best"] if e["m"] == m]
        report[f"layer_us_m{m}"] = {"torch": sum(e["torch_us"] for e in at), "lt_best": sum(e["best_us"] for e in at)}
    return report


def _product(
    m: int, name: str, n: int, k: int, candidates: int, pool: bool, log: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """One product at ``m`` rows: torch's call, each candidate algorithm, the residual form; None if none ran."""
    dtype, gelu = torch.float16, name == "ffn_in"
    copies = max(1, min(40, (400 << 20) // (n * k * 2)))
    wbs = [(torch.randn(n, k, device="cuda", dtype=dtype) * 0.03, torch.randn(n, device="cuda", dtype=dtype))
           for _ in range(copies)]  # fmt: skip
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    res = torch.randn(m, n, device="cuda", dtype=dtype)
    want = F.linear(x.float(), wbs[0][0].float(), wbs[0][1].float())
    want = F.gelu(want, approximate="tanh") if gelu else want

    def ref(wb: Any) -> torch.Tensor:
        if gelu:
            return torch._addmm_activation(wb[1], x, wb[0].t(), use_gelu=True)
        return F.linear(x, wb[0], wb[1])

    torch_us = _time_graph(_rotating(ref, wbs), REPS, True)
    plan = cublaslt.LtLinear(m, n, k, dtype, "gelu_bias" if gelu else "bias")
    timed = []
    for i, algo in enumerate(plan.candidates(candidates) if pool else plan.algos(candidates)):
        try:
            us = _time_graph(_rotating(lambda wb, a=algo: plan(x, wb[0], wb[1], a), wbs), REPS, True)
            got = plan(x, wbs[0][0], wbs[0][1], algo).float()
            err = float((got - want).abs().max() / want.abs().max())
        except Exception as exc:  # an algorithm that fails at this shape is a finding, not a stop
            log.append({"gemm": name, "m": m, "rank": i, "error": repr(exc)[:200]})
            continue
        rec = {"gemm": name, "m": m, "rank": i, "us": us, "rel_err": err, **cublaslt.summary(algo)}
        log.append(rec)
        if err < 5e-3:
            timed.append(rec)
    torch_again_us = _time_graph(_rotating(ref, wbs), REPS, True)  # how much torch's own figure moves
    if not timed:
        print(json.dumps({"gemm": name, "m": m, "error": "no candidate ran within 5e-3 of fp32"}))
        return None
    best = min(timed, key=lambda r: r["us"])
    entry = {"gemm": name, "m": m, "n": n, "k": k, "torch_us": torch_us, "torch_again_us": torch_again_us,
             "lt_first_us": timed[0]["us"] if timed[0]["rank"] == 0 else None, "best_us": best["us"],
             "best_rank": best["rank"], "candidates": len(timed), "gain": 1 - best["us"] / torch_us,
             "best": best}  # fmt: skip
    if not gelu:  # the residual as C: the add + LayerNorm after it loses an input
        rplan = cublaslt.LtLinear(m, n, k, dtype, "bias", residual=True)
        rtimed = []
        for algo in rplan.algos(candidates):
            try:
                run = _rotating(lambda wb, a=algo: rplan(x, wb[0], wb[1], a, residual=res), wbs)
                rtimed.append((_time_graph(run, REPS, True), algo))
            except Exception:
                continue
        if rtimed:
            us, algo = min(rtimed, key=lambda t: t[0])
            got = rplan(x, wbs[0][0], wbs[0][1], algo, residual=res).float()
            full = want + res.float()
            err = float((got - full).abs().max() / full.abs().max())
            entry |= {"residual_best_us": us, "residual_rel_err": err, "residual_best": cublaslt.summary(algo)}
    return entry


def _layernorm(m: int, n: int) -> dict[str, Any]:
    """Inductor's add + LayerNorm (two inputs) against its LayerNorm of one input, at ``m`` rows of ``n``."""
    a, r = (torch.randn(m, n, device="cuda", dtype=torch.float16) for _ in range(2))
    g, b = torch.randn(n, device="cuda", dtype=torch.float16), torch.randn(n, device="cuda", dtype=torch.float16)
    two = torch.compile(lambda a, r: F.layer_norm(a + r, (n,), g, b, 1e-12), dynamic=False)
    one = torch.compile(lambda a: F.layer_norm(a, (n,), g, b, 1e-12), dynamic=False)
    return {"m": m, "n": n, "add_ln_us": _time_graph(lambda: two(a, r), REPS, True),
            "ln_us": _time_graph(lambda: one(a), REPS, True)}  # fmt: skip


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
    args.out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        report = probe(tuple(int(r) for r in args.rows.split(",")), args.hidden, args.inter, args.candidates, args.pool)
    report |= {"model": f"encoder GEMMs (hidden {args.hidden}, FFN {args.inter}), fp16, random weights",
               "hidden": args.hidden, "intermediate": args.inter, "pool": args.pool,
               "torch": torch.__version__, "cuda": torch.version.cuda, "cublaslt": cublaslt.version(),
               "gpu": torch.cuda.get_device_name()}  # fmt: skip
    for key, v in report.items():
        if key.startswith("layer_us_m"):
            print(f"{key}: torch {v['torch']:.1f} µs, cuBLASLt best {v['lt_best']:.1f}")
    (args.out / "cublaslt_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
