"""On the GPU: does compiling the *whole* batch-1 decode step (all layers unrolled, static shapes, one CUDA graph)
beat the engine's per-layer compiled pieces (2.00 ms per step for the 1.5B shape, README)? The question behind the
batch-1 TPOT goal (≤ 1.1 ms; HBM floor 0.72 ms): cross-layer fusion (residual + RMSNorm + RoPE into neighbours) and,
with ``--coordinate-descent``, Inductor's own tuning of the reductions, as gpt-fast does.

Both steps are CUDA graphs timed with CUDA events (median of ``--iters`` replays) on the same random weights (two
decoder instances built from one seed); the max |logit difference| of one step says they compute the same thing.

    python3 scripts/gpu/decode_whole_step.py [--mode max-autotune-no-cudagraphs] [--coordinate-descent]
    python3 scripts/gpu/decode_whole_step.py --tiny --device cpu     # smoke test on a CPU (no graphs, no timing)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from miaohui.generation.dims import DecoderDims
from miaohui.generation.slot_engine import TorchSlotEngine
from miaohui.generation.slot_options import SlotEngineOptions
from miaohui.generation.static_kv import StaticKVDecoder, mlp_block

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


def attn_out_mlp_sdpa(
    x: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    o: torch.Tensor,
    post_norm: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``attn_out_mlp`` with the attention as one SDPA call (a fused kernel) instead of two bmm's and a softmax."""
    b, heads, d = q.shape
    attn = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=bias.to(q.dtype), enable_gqa=True
    ).reshape(b, heads * d)
    return mlp_block(x + F.linear(attn, o), post_norm, gate_up, down, eps)


def _graph_ms(step: Callable[[], torch.Tensor], iters: int) -> tuple[float, torch.Tensor]:
    """Warm ``step`` on a side stream, capture it, and time ``iters`` replays with CUDA events (median ms)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


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
    b: int, pieces: StaticKVDecoder, whole: StaticKVDecoder, sdpa_attn: Callable[..., torch.Tensor], mode: str | None,
    args: argparse.Namespace,
) -> tuple[dict[str, float], dict[str, list[dict[str, object]]]]:  # fmt: skip
    """Time (and optionally profile) batch ``b``: pieces, whole step (compiled now, static shapes), pieces + SDPA."""
    tokens = torch.full((b,), 7, device=args.device)
    positions = torch.full((b,), PROMPT, device=args.device)
    row: dict[str, float] = {}
    tables: dict[str, list[dict[str, object]]] = {}
    torch._dynamo.reset()
    compiled = torch.compile(whole.decode, fullgraph=True, dynamic=False, mode=mode)
    default_attn = pieces._attn_out_mlp

    def run_pieces() -> torch.Tensor:
        return pieces.decode(tokens, positions, KV_LEN)

    def run_whole() -> torch.Tensor:
        return compiled(tokens, positions, KV_LEN)

    t = time.perf_counter()
    with torch.inference_mode():
        want = run_whole()
        got = run_pieces()  # the pieces eagerly-launched (same kernels as the graph)
        row["whole_compile_s"] = time.perf_counter() - t
        row["max_abs_logit_diff_row0"] = float((want[0].float() - got[0].float()).abs().max())
        pieces._attn_out_mlp = sdpa_attn
        row["sdpa_max_abs_logit_diff_row0"] = float((run_pieces()[0].float() - got[0].float()).abs().max())
        pieces._attn_out_mlp = default_attn
        if args.device != "cuda":
            return row, tables
        row["pieces_graph_ms"], _ = _graph_ms(run_pieces, args.iters)
        row["whole_graph_ms"], _ = _graph_ms(run_whole, args.iters)
        pieces._attn_out_mlp = sdpa_attn
        row["pieces_sdpa_graph_ms"], _ = _graph_ms(run_pieces, args.iters)
        pieces._attn_out_mlp = default_attn
        if args.profile:
            tables = {"whole": _kernel_table(run_whole), "pieces": _kernel_table(run_pieces)}
    return row, tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="default", help="torch.compile mode of the whole step")
    ap.add_argument("--coordinate-descent", action="store_true", help="inductor coordinate_descent_tuning")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes to time (comma-separated)")
    ap.add_argument("--profile", action="store_true", help="also print the kernel tables of both steps")
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
    whole = _decoder(dims, args.device)
    _prompt(whole, args.device)
    mode = None if args.mode == "default" else args.mode
    sdpa_attn = torch.compile(attn_out_mlp_sdpa, dynamic=True, fullgraph=True)
    for b in batches:
        row, tables = _one_batch(b, pieces, whole, sdpa_attn, mode, args)
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
