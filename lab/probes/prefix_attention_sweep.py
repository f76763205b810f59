"""The prefix-hit attention kernel's slice length on a GPU: a 50-token turn (its rest padded to 64, as the prefix-hit
graphs pad it) after a cached history of H tokens, at the Qwen2.5-1.5B shape (12 query heads, 2 KV heads of 128, bf16)
over a slot of 4,096 positions (a prefix-hit graph attends over the whole slot), for each slice length (``--chunks``),
inner step (``--blocks``), warp count (``--warps``), query rows per program (``--rows``) and pipeline stages
(``--stages``) of the kernel:

    python -m lab.probes.prefix_attention_sweep --history 500,1000,2000 --chunks 128,256,512 --blocks 32,64 \
        --warps 4,8 [--out DIR]

Each form is 28 calls (one per layer) captured in one CUDA graph, replayed ``--iters`` times and timed with CUDA events,
so a launch's host time is not counted (as in the engine's graphs); reported per call (one layer), median and p99 of
the replays. Every form's output is compared with SDPA's over the same rows (``max_abs_error``). CUDA only. Writes
DIR/prefix_attention_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from miaohui.generation.kernels.prefix_attention import BLOCK, CHUNK, ROWS, triton_prefix_attention
from miaohui.generation.models.static_kv_layers import prefix_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM, SLOT_LEN, REST, TURN = 28, 12, 2, 128, 4096, 64, 50


def time_config(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                rows: torch.Tensor, config: dict[str, Any], iters: int) -> list[float]:  # fmt: skip
    """Milliseconds per call of each replay of a graph of :data:`LAYERS` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm outside the capture
            triton_prefix_attention(q, keys, values, positions, rows, **config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            triton_prefix_attention(q, keys, values, positions, rows, **config)
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / LAYERS)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", default="500,1000,2000")
    ap.add_argument("--chunks", default="128,256,512")
    ap.add_argument("--blocks", default="32,64")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--rows", default="64,128", help="query rows per program at most (tokens x query heads)")
    ap.add_argument("--stages", default="0", help="Triton's num_stages (0: Triton's default)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefix_attention_sweep needs a CUDA GPU")
    torch.manual_seed(0)
    keys = torch.randn((4, KV_HEADS, SLOT_LEN, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    values = torch.randn((4, KV_HEADS, SLOT_LEN, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    q = torch.randn((1, REST, HEADS, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    rows = torch.full((1, REST), 1, dtype=torch.int64, device="cuda")
    configs = [
        {"chunk": c, "block": b, "warps": w, "rows_per_program": r, "stages": st or None}
        for c in (int(x) for x in args.chunks.split(","))
        for b in (int(x) for x in args.blocks.split(","))
        for w in (int(x) for x in args.warps.split(","))
        for r in (int(x) for x in args.rows.split(","))
        for st in (int(x) for x in args.stages.split(","))
        if c % b == 0
    ]
    results: dict[str, dict[str, dict[str, float]]] = {}
    for history in (int(h) for h in args.history.split(",")):
        # the turn's 50 tokens at history .. history+49; the padding rows repeat the last position
        positions = (history + torch.arange(REST, device="cuda").clamp(max=TURN - 1))[None, :].contiguous()
        want = prefix_attention(q, keys, values, rows, positions, history + TURN, kernel=False).float()
        results[str(history)] = {}
        for config in configs:
            name = "chunk{chunk}_block{block}_warps{warps}_rows{rows_per_program}_stages{stages}".format(**config)
            got = triton_prefix_attention(q, keys, values, positions, rows, **config)
            error = float((got.view(1, REST, HEADS, HEAD_DIM).transpose(1, 2).float() - want).abs().max())
            times = time_config(q, keys, values, positions, rows, config, args.iters)
            results[str(history)][name] = {
                "median_us": round(1e3 * statistics.median(times), 2),
                "p99_us": round(1e3 * sorted(times)[int(0.99 * (len(times) - 1))], 2),
                "max_abs_error": error,
            }
            print(history, name, results[str(history)][name], flush=True)
    doc = {
        "probe": "prefix_attention_sweep",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "default": f"chunk{CHUNK}_block{BLOCK}_warps4_rows{ROWS}_stagesNone",
        "shape": {
            "layers": LAYERS,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "slot": SLOT_LEN,
            "rest": REST,
            "turn": TURN,
        },
        "per_layer": results,
        "best": {h: min(r, key=lambda c: r[c]["median_us"]) for h, r in results.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_attention_sweep.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(doc["best"]))


if __name__ == "__main__":
    main()
