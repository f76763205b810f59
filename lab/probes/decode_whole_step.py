"""On the GPU: where the decode step of the 1.5B shape can get faster, batch 1 (the TPOT goal, ≤ 1.1 ms; HBM floor
0.72 ms) and batch 64 (the 64-stream server, whose async loop is now GPU-bound):

* the engine's per-layer compiled pieces with each decode attention of ``SlotEngineOptions.decode_attention``:
  ``matmul`` (two batched matmuls + softmax, the default), ``sdpa``, ``flex`` (FlexAttention's decoding kernel);
* ``SlotEngineOptions.decode_layer = "fused"``: each layer one compiled graph, the cache write inside it;
* the *whole* step compiled (all layers unrolled, static shapes): cross-layer fusion and, with
  ``--coordinate-descent``, Inductor's own tuning of the reductions, as gpt-fast does (session 9: slower, 3.8 vs
  2.0 ms at batch 1; ``--profile`` prints the kernel tables that should say why).

Each variant is a CUDA graph timed with CUDA events (median of ``--iters`` replays) on the same random weights; the
max |logit difference| against the matmul pieces says they compute the same thing.

    python -m lab.probes.decode_whole_step [--batches 1,64] [--profile] [--no-whole] [--coordinate-descent]
    python -m lab.probes.decode_whole_step --tiny --device cpu     # smoke test on a CPU (no graphs, no timing)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lab.harness import capture, replay_us, summary
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.constants import with_constants
from miaohui.generation.models.dims import DecoderDims
from miaohui.generation.models.static_kv import DECODE_ATTENTION, StaticKVDecoder, make_decode_layer

QWEN_15B = DecoderDims(
    num_layers=28, hidden=1536, num_heads=12, num_kv_heads=2, head_dim=128, intermediate=8960, vocab=151936,
    rope_theta=1e6, rms_eps=1e-6, max_positions=32768,
)  # fmt: skip
TINY = DecoderDims(
    num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128, vocab=512,
    rope_theta=1e4, rms_eps=1e-6, max_positions=1024,
)  # fmt: skip
SLOTS, MAX_LEN, KV_LEN, PROMPT = 64, 1024, 256, 100


def _decoder(dims: DecoderDims, device: str) -> StaticKVDecoder:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dec = StaticKVDecoder(dims, num_slots=SLOTS, max_len=MAX_LEN, qkv_bias=True, dtype=dtype, device=device)
    dec.init_random(seed=0)
    return dec


def _prompt(dec: StaticKVDecoder, device: str) -> None:
    """The same 100-token prompt into slot 0 (after any warm-up, which writes into slots 0 and 1)."""
    with torch.inference_mode():
        dec.prefill(torch.arange(5, 5 + PROMPT, device=device)[None, :], torch.tensor([PROMPT], device=device),
                    torch.tensor([0], device=device))  # fmt: skip


def _graph_ms(step: Callable[[], torch.Tensor], iters: int) -> tuple[float, torch.Tensor]:
    """``step`` captured as a graph (:mod:`lab.harness`): median ms of ``iters`` replays, and its output."""
    graph, out = capture(step)
    return summary(replay_us(graph.replay, iters))["median"] / 1000, out


def _kernel_table(step: Callable[[], torch.Tensor], top: int = 14) -> list[dict[str, object]]:
    """The CUDA kernels of 5 eager-launched steps (same kernels as the graph), by total time; per step."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    table = [
        {"kernel": e.key[:90], "per_step": e.count / 5, "us_per_step": e.device_time_total / 5} for e in rows[:top]
    ]
    total = sum(e.device_time_total for e in rows) / 5 / 1000
    table.append({"kernel": "ALL", "per_step": sum(e.count for e in rows) / 5, "us_per_step": total * 1000})
    return table


def _one_batch(
    b: int, pieces: StaticKVDecoder, whole: StaticKVDecoder | None, attentions: dict[str, Any],
    fused: dict[str, Any], mode: str | None, args: argparse.Namespace,
) -> tuple[dict[str, float], dict[str, list[dict[str, object]]]]:  # fmt: skip
    """Time (and optionally profile) batch ``b``: the pieces with each decode attention, and the whole step
    (compiled now, static shapes) when ``whole`` is given. Logit differences are against the matmul pieces."""
    tokens = torch.full((b,), 7, device=args.device)
    positions = torch.full((b,), PROMPT, device=args.device)
    row: dict[str, float] = {}
    tables: dict[str, list[dict[str, object]]] = {}
    cuda = args.device == "cuda"

    def run_pieces() -> torch.Tensor:
        return pieces.decode(tokens, positions, KV_LEN)

    with torch.inference_mode():
        for name, fn in attentions.items():
            pieces.decode_attention, pieces._attn_out_mlp = name, fn
            t = time.perf_counter()
            got = run_pieces()
            row[f"{name}_first_call_s"] = time.perf_counter() - t
            if name == "matmul":
                ref = got[0].float()
            else:
                row[f"{name}_max_abs_logit_diff_row0"] = float((got[0].float() - ref).abs().max())
            if cuda:
                row[f"pieces_{name}_graph_ms"], _ = _graph_ms(run_pieces, args.iters)
                if args.profile:
                    tables[f"pieces_{name}"] = _kernel_table(run_pieces)
        pieces.decode_attention, pieces._attn_out_mlp = "matmul", attentions["matmul"]
        for name, fn in fused.items():  # decode_layer "fused": the whole layer, cache write included, one graph
            pieces.decode_layer, pieces.decode_attention, pieces._decode_layer = "fused", name, fn
            t = time.perf_counter()
            got = run_pieces()
            row[f"fused_{name}_first_call_s"] = time.perf_counter() - t
            row[f"fused_{name}_max_abs_logit_diff_row0"] = float((got[0].float() - ref).abs().max())
            if cuda:
                row[f"fused_{name}_graph_ms"], _ = _graph_ms(run_pieces, args.iters)
                if args.profile:
                    tables[f"fused_{name}"] = _kernel_table(run_pieces)
        pieces.decode_layer, pieces.decode_attention = "split", "matmul"
        if whole is None:
            return row, tables
        torch._dynamo.reset()
        compiled = torch.compile(whole.decode, fullgraph=True, dynamic=False, mode=mode)

        def run_whole() -> torch.Tensor:
            return compiled(tokens, positions, KV_LEN)

        t = time.perf_counter()
        want = run_whole()
        row["whole_compile_s"] = time.perf_counter() - t
        row["whole_max_abs_logit_diff_row0"] = float((want[0].float() - ref).abs().max())
        if cuda:
            row["whole_graph_ms"], _ = _graph_ms(run_whole, args.iters)
            if args.profile:
                tables["whole"] = _kernel_table(run_whole)
    return row, tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="default", help="torch.compile mode of the whole step")
    ap.add_argument("--coordinate-descent", action="store_true", help="inductor coordinate_descent_tuning")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes to time (comma-separated)")
    ap.add_argument("--profile", action="store_true", help="also print the kernel table of every variant")
    ap.add_argument("--attention", default="matmul,sdpa,flex", help="decode attentions of the pieces (matmul first)")
    ap.add_argument("--no-whole", action="store_true", help="skip the whole-step compile")
    ap.add_argument("--fused", default="matmul", help="decode attentions of the fused layer ('' for none)")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    dims = TINY if args.tiny else QWEN_15B
    cuda = args.device == "cuda"
    if args.coordinate_descent:
        torch._inductor.config.coordinate_descent_tuning = True
    report: dict[str, object] = {"model": "tiny" if args.tiny else "qwen1.5b (random)", "kv_len": KV_LEN}
    batches = [int(b) for b in args.batches.split(",")]

    # the engine's way: per-layer pieces compiled (weights as arguments), one CUDA graph per bucket
    pieces = _decoder(dims, args.device)
    buckets = tuple(sorted({*batches, SLOTS}))
    opts = SlotEngineOptions(num_slots=SLOTS, max_len=MAX_LEN, dtype="bf16" if cuda else "fp32",
                             batch_buckets=buckets, length_buckets=(KV_LEN, MAX_LEN))  # fmt: skip
    engine = TorchSlotEngine(pieces, [0], 0, opts)
    t = time.perf_counter()
    engine.warmup(log=lambda m: None)
    report["pieces_warmup_s"] = time.perf_counter() - t
    _prompt(pieces, args.device)
    whole = None if args.no_whole else _decoder(dims, args.device)
    if whole is not None:
        _prompt(whole, args.device)
    mode = None if args.mode == "default" else args.mode
    names = args.attention.split(",")
    assert names[0] == "matmul", "matmul first: the reference of the logit differences"
    # the engine's compiled pieces use matmul; the others compiled the way the engine compiles them
    attentions = {n: torch.compile(DECODE_ATTENTION[n], dynamic=True, fullgraph=True) if cuda else DECODE_ATTENTION[n]
                  for n in names[1:]}  # fmt: skip
    attentions = {"matmul": pieces._attn_out_mlp, **attentions}
    heads = pieces.dims.num_heads
    fused = {
        n: (torch.compile(with_constants(make_decode_layer(DECODE_ATTENTION[n]), heads=heads), dynamic=True,
                          fullgraph=True) if cuda
            else with_constants(make_decode_layer(DECODE_ATTENTION[n]), heads=heads))
        for n in filter(None, args.fused.split(","))
    }  # fmt: skip
    for b in batches:
        row, tables = _one_batch(b, pieces, whole, attentions, fused, mode, args)
        report[f"batch{b}"] = row
        for name, table in tables.items():
            report[f"batch{b}_{name}_kernels"] = table
            for k in table:
                print(f"kernels b={b} {name}: {k['us_per_step']:8.1f} us {k['per_step']:6.1f}x {k['kernel']}")
        print(f"batch {b}: {json.dumps(row)}", flush=True)
    report.update(mode=args.mode, coordinate_descent=args.coordinate_descent, torch=torch.__version__)
    print(json.dumps(report, indent=1))
    name = f"decode_whole_step_{args.mode}{'_cd' if args.coordinate_descent else ''}.json"
    (args.out / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
