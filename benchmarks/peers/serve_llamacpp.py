"""llama.cpp's server (the ``xllamacpp`` wheel) on a GGUF: OpenAI API with streaming and continuous batching.
Runs in var/peers/llamacpp (``scripts/peers.sh``).

    var/peers/llamacpp/bin/python benchmarks/peers/serve_llamacpp.py MODEL.gguf --port 8100 --parallel 32
"""

from __future__ import annotations

import argparse
import signal
import threading

import xllamacpp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=32, help="slots (streams decoded together)")
    ap.add_argument("--ctx", type=int, default=8192, help="context tokens, shared by all slots")
    args = ap.parse_args()
    params = xllamacpp.CommonParams()
    params.model.path = args.gguf
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx
    params.cont_batching = True
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    server = xllamacpp.Server(params)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(f"llama.cpp server on 127.0.0.1:{args.port}", flush=True)
    done.wait()
    del server


if __name__ == "__main__":
    main()
