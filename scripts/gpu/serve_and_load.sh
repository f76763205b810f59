#!/usr/bin/env bash
# On the GPU: build the e5 intent engine (inductor fp16), serve it, and load it with `miaohui bench`.
set -uo pipefail
OUT=$1
R=/tmp/gpurepo
python3 scripts/gpu/build_intent_gpu.py $R
python3 -m miaohui.cli serve -r $R --port 8000 --grpc-port 0 > /tmp/serve.log 2>&1 &
for i in $(seq 1 100); do curl -sf localhost:8000/v2/health/ready >/dev/null && break; sleep 1; done
echo "ready after ${i}s"; tail -3 /tmp/serve.log
python3 -c "import typer; from miaohui.bench.cli import bench_command; app = typer.Typer(); app.command()(bench_command); app()" \
  --target http --concurrency 1,32,128,256 --duration 4s --warmup 1s --processes 6 --tokens 8-64 \
  --engine $R/intent/1 --out "$OUT/gpu_server.json" --plot "$OUT/gpu_server.png" 2>&1 | tail -30
curl -s localhost:8000/metrics | grep -E "^miaohui_(batch_size|queue_duration_seconds|compute_duration_seconds)_(sum|count)" | head
