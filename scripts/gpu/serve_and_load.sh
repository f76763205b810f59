#!/usr/bin/env bash
# On the GPU: build the e5 intent engine (inductor fp16), serve it, and load it with `miaohui bench`.
set -uo pipefail
OUT=$1
R=/tmp/gpurepo
python3 - <<'PY'
from pathlib import Path
from miaohui.config import BuildConfig, parse_shapes
from miaohui.engines.store import build_artifact
from miaohui.serving.model_config import ModelConfig, WarmupShape, write_model_config
from miaohui.serving.batcher import BatcherConfig
cfg = BuildConfig(backend="inductor", precision="fp16", autotune=False, shapes=parse_shapes("input_ids:1x1,32x32,256x64"))
out = build_artifact(Path("var/models/intent-e5-small"), "intent", cfg, Path("/tmp/gpurepo"), log=print)
write_model_config(Path("/tmp/gpurepo/intent/config.yaml"), ModelConfig(
    backend="inductor", batching=BatcherConfig(max_batch_size=256, max_queue_delay_ms=1.0, max_queue_size=8192,
                                               length_buckets=[16, 32, 64]),
    warmup=[WarmupShape(batch=b, sequence=s) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for s in (16, 32, 64)]))
PY
python3 -m miaohui.cli serve -r $R --port 8000 --grpc-port 0 > /tmp/serve.log 2>&1 &
for i in $(seq 1 100); do curl -sf localhost:8000/v2/health/ready >/dev/null && break; sleep 1; done
echo "ready after ${i}s"; tail -3 /tmp/serve.log
python3 -c "import typer; from miaohui.bench.cli import bench_command; app = typer.Typer(); app.command()(bench_command); app()" \
  --target http --concurrency 1,32,128,256 --duration 4s --warmup 1s --processes 6 --tokens 8-64 \
  --engine $R/intent/1 --out "$OUT/gpu_server.json" --plot "$OUT/gpu_server.png" 2>&1 | tail -30
curl -s localhost:8000/metrics | grep -E "^miaohui_(batch_size|queue_duration_seconds|compute_duration_seconds)_(sum|count)" | head
