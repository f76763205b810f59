"""MLServer serving the intent model through ``mlserver_runtime.OnnxIntentRuntime`` with adaptive batching.

Writes ``settings.json`` and ``intent/model-settings.json`` into ``--workdir`` and runs ``mlserver start`` there
(HTTP on 127.0.0.1:PORT, gRPC on PORT+1, metrics off). Runs in var/peers/mlserver (``scripts/peers.sh``).

    var/peers/mlserver/bin/python benchmarks/peers/serve_mlserver.py ARTIFACT --port 8100 --workdir /tmp/mls
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-batch-time-ms", type=float, default=2.0)
    ap.add_argument(
        "--parallel-workers",
        type=int,
        default=0,
        help="MLServer's inference worker processes; 0 (inference in the server process): its workers die at start "
        "with uvloop 0.23 ('There is no current event loop in thread MainThread')",
    )
    args = ap.parse_args()
    here = Path(__file__).resolve().parent
    model_dir = args.workdir / "intent"
    model_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "host": "127.0.0.1",
        "http_port": args.port,
        "grpc_port": args.port + 1,
        "metrics_port": args.port + 2,
        "metrics_endpoint": None,
        "parallel_workers": args.parallel_workers,
        "debug": False,
    }
    (args.workdir / "settings.json").write_text(json.dumps(settings))
    model = {
        "name": "intent",
        "implementation": "mlserver_runtime.OnnxIntentRuntime",
        "max_batch_size": args.max_batch_size,
        "max_batch_time": args.max_batch_time_ms / 1e3,
        "parameters": {"uri": str(Path(args.artifact).resolve()), "extra": {"threads": args.threads}},
    }
    (model_dir / "model-settings.json").write_text(json.dumps(model))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")]))
    mlserver = Path(sys.executable).with_name("mlserver")
    os.execv(str(mlserver), [str(mlserver), "start", str(args.workdir)])


if __name__ == "__main__":
    main()
