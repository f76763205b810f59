"""PyTriton (Triton Inference Server's own binary and dynamic batcher, driven from Python) serving the intent model
on the CPU: KServe v2 at 127.0.0.1:PORT, TEXT (BYTES [n, 1]) → INTENT (BYTES), CONFIDENCE (FP32). Runs in
var/peers/pytriton (``scripts/peers.sh``).

    var/peers/pytriton/bin/python benchmarks/peers/serve_pytriton.py ARTIFACT --port 8100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intent_model import IntentModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-queue-delay-ms", type=float, default=2.0)
    args = ap.parse_args()
    model = IntentModel(args.artifact, args.threads)

    @batch
    def infer(TEXT: np.ndarray) -> dict[str, np.ndarray]:
        texts = [t.decode() if isinstance(t, bytes) else str(t) for t in TEXT.reshape(-1)]
        results = model.predict(texts)
        return {
            "INTENT": np.array([[r[0].encode()] for r in results], dtype=np.object_),
            "CONFIDENCE": np.array([[r[1]] for r in results], dtype=np.float32),
        }

    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.port,
        grpc_address="127.0.0.1",
        grpc_port=args.port + 1,
        metrics_port=args.port + 2,
        allow_metrics=False,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name="intent",
            infer_func=infer,
            inputs=[Tensor(name="TEXT", dtype=bytes, shape=(1,))],
            outputs=[
                Tensor(name="INTENT", dtype=bytes, shape=(1,)),
                Tensor(name="CONFIDENCE", dtype=np.float32, shape=(1,)),
            ],
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=int(args.max_queue_delay_ms * 1e3)),
            ),
        )
        print(f"PyTriton serving on 127.0.0.1:{args.port}", flush=True)
        triton.serve()


if __name__ == "__main__":
    main()
