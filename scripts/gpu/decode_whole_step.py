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

from miaohui.generation.dims import DecoderDims
from miaohui.generation.slot_engine import TorchSlotEngine
from miaohui.generation.slot_options import SlotEngineOptions
from miaohui.generation.static_kv import StaticKVDecoder

QWEN_15B = DecoderDims(
    num_layers=28, hidden=1536, num_heads=12, num_kv_heads=2, head_dim=128, intermediate=8960, vocab=151936,
    rope_theta=1e6, rms_eps=1e-6, max_positions=32768,
)  # fmt: skip
TINY = DecoderDims(
    num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128, vocab=512,
    rope_theta=1e4, rms_eps=1e-6, max_positions=1024,
)  # fmt: skip
SLOTS, MAX_LEN, KV_LEN, PROMPT = 8, 1024, 256, 100


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="default", help="torch.compile mode of the whole step")
    ap.add_argument("--coordinate-descent", action="store_true", help="inductor coordinate_descent_tuning")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    dims = TINY if args.tiny else QWEN_15B
    cuda = args.device == "cuda"
    if args.coordinate_descent:
        torch._inductor.config.coordinate_descent_tuning = True
    tokens = torch.tensor([7], device=args.device)
    positions = torch.tensor([PROMPT], device=args.device)
    report: dict[str, object] = {"model": "tiny" if args.tiny else "qwen1.5b (random)", "batch": 1, "kv_len": KV_LEN}

    # the engine's way: per-layer pieces compiled (weights as arguments), one CUDA graph per bucket
    pieces = _decoder(dims, args.device)
    opts = SlotEngineOptions(num_slots=SLOTS, max_len=MAX_LEN, dtype="bf16" if cuda else "fp32",
                             batch_buckets=(1, SLOTS), length_buckets=(KV_LEN, MAX_LEN))  # fmt: skip
    engine = TorchSlotEngine(pieces, [0], 0, opts)
    t = time.perf_counter()
    engine.warmup(log=lambda m: None)
    report["pieces_warmup_s"] = time.perf_counter() - t
    _prompt(pieces, args.device)

    # the whole step: every layer unrolled into one compiled graph, static shapes
    whole = _decoder(dims, args.device)
    _prompt(whole, args.device)
    mode = None if args.mode == "default" else args.mode
    compiled = torch.compile(whole.decode, fullgraph=True, dynamic=False, mode=mode)
    t = time.perf_counter()
    with torch.inference_mode():
        want = compiled(tokens, positions, KV_LEN)
        got = pieces.decode(tokens, positions, KV_LEN)  # the pieces eagerly-launched (same kernels as the graph)
    report["whole_compile_s"] = time.perf_counter() - t
    report["max_abs_logit_diff"] = float((want.float() - got.float()).abs().max())
    if cuda:
        with torch.inference_mode():
            report["pieces_graph_ms"], _ = _graph_ms(lambda: pieces.decode(tokens, positions, KV_LEN), args.iters)
            report["whole_graph_ms"], _ = _graph_ms(lambda: compiled(tokens, positions, KV_LEN), args.iters)
    report.update(mode=args.mode, coordinate_descent=args.coordinate_descent, torch=torch.__version__)
    print(json.dumps(report, indent=1))
    name = f"decode_whole_step_{args.mode}{'_cd' if args.coordinate_descent else ''}.json"
    (args.out / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
