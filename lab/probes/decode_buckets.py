"""On the GPU: every captured decode graph of the 1.5B-shaped engine (random weights), as the server builds it
(64 slots, 1024 positions, the default batch and length buckets), timed per (batch, length) bucket for each
``--layers`` value: ``SlotEngineOptions.decode_layer`` (``split`` / ``fused``), ``+int8`` for ``int8_batch1``,
``+int8b`` for ``int8_batched``, ``+int8all`` for both (session 11). Session 10: the fused layer was 5 % faster than
the split one at (64, 256) (``decode_whole_step.py``) yet the
server with it was 25 % slower; is some bucket slow?

    TORCH_LOGS=recompiles python -m lab.probes.decode_buckets --out /tmp/buckets
    python -m lab.probes.decode_buckets --layers split,split+int8,fused+int8 --batches 1,64 --out /tmp/buckets
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from lab.harness import replay_us, summary
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.dims import DecoderDims
from miaohui.generation.models.static_kv import StaticKVDecoder

QWEN_15B = DecoderDims(
    num_layers=28, hidden=1536, num_heads=12, num_kv_heads=2, head_dim=128, intermediate=8960, vocab=151936,
    rope_theta=1e6, rms_eps=1e-6, max_positions=32768,
)  # fmt: skip


def _replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Median ms of a replay of ``graph`` (:mod:`lab.harness`)."""
    return summary(replay_us(graph.replay, iters))["median"] / 1000


def one_engine(variant: str, iters: int, batches: tuple[int, ...]) -> dict[str, Any]:
    dec = StaticKVDecoder(QWEN_15B, num_slots=64, max_len=1024, qkv_bias=True, dtype=torch.bfloat16, device="cuda")
    dec.init_random(seed=0)
    layer, _, int8 = variant.partition("+")  # +int8: int8_batch1; +int8b: int8_batched; +int8all: both
    opts = SlotEngineOptions(
        num_slots=64,
        max_len=1024,
        dtype="bf16",
        decode_layer=layer,
        int8_batch1=int8 in ("int8", "int8all"),
        int8_batched=int8 in ("int8b", "int8all"),
        batch_buckets=batches,
    )  # type: ignore[arg-type]
    engine = TorchSlotEngine(dec, [0], 0, opts)
    t = time.perf_counter()
    engine.warmup(log=lambda m: None)
    out: dict[str, Any] = {"warmup_s": time.perf_counter() - t, "graphs": len(engine._graphs)}
    for (b, length), (graph, _) in sorted(engine._graphs.items()):
        out[f"b{b}_t{length}_ms"] = _replay_ms(graph, iters)
    print(f"{variant}: {json.dumps(out)}", flush=True)
    del engine, dec
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="split,fused")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batches", default="", help="decode batch buckets, e.g. 1,64 (default: the engine's)")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    report: dict[str, Any] = {"model": "qwen1.5b shape (random weights)", "torch": torch.__version__}
    with torch.inference_mode():
        for layer in args.layers.split(","):
            report[layer] = one_engine(layer, args.iters, tuple(int(b) for b in args.batches.split(",") if b))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_buckets.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
