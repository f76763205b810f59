"""LitServe serving the intent model: ``POST /predict {"text": ...}`` → ``{"intent", "confidence"}``, dynamic
batching (``max_batch_size``, ``batch_timeout``). Runs in var/peers/litserve (``scripts/peers.sh``).

    var/peers/litserve/bin/python benchmarks/peers/serve_litserve.py ARTIFACT --port 8100
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import litserve as ls

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intent_model import IntentModel


class IntentAPI(ls.LitAPI):
    def __init__(self, artifact: str, threads: int, max_batch_size: int, batch_timeout: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout)
        self.artifact, self.threads = artifact, threads

    def setup(self, device: str) -> None:
        self.model = IntentModel(self.artifact, self.threads)

    def decode_request(self, request: dict[str, Any]) -> str:
        return str(request["text"])

    def batch(self, inputs: list[str]) -> list[str]:
        return list(inputs)

    def predict(self, x: Any) -> list[tuple[str, float]]:
        return self.model.predict(x if isinstance(x, list) else [x])

    def unbatch(self, output: list[tuple[str, float]]) -> list[tuple[str, float]]:
        return output

    def encode_response(self, output: Any) -> dict[str, Any]:
        if isinstance(output, list):  # unbatched serving hands predict()'s whole list
            output = output[0]
        return {"intent": output[0], "confidence": output[1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--batch-timeout-ms", type=float, default=2.0)
    args = ap.parse_args()
    api = IntentAPI(args.artifact, args.threads, args.max_batch_size, args.batch_timeout_ms / 1e3)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, fast_queue=True)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
