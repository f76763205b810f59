#!/usr/bin/env bash
# On the GPU host: the e5 intent engine (inductor fp16, same build and serving config as serve_and_load.sh) served
# by `miaohui serve --workers N` for each N in $WORKERS (default "1 4 8"), each loaded with `miaohui bench`
# (HTTP /v1/intent, closed loop, 6 client processes). Needs the intent model (run_h200.sh stage2's setup).
set -uo pipefail
OUT=$1
R=/tmp/gpurepo
if [ ! -f $R/intent/config.yaml ]; then
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
fi
for N in ${WORKERS:-1 4 8}; do
  started=$(date +%s)
  python3 -m miaohui.cli serve -r $R --port 8000 --grpc-port 8001 --workers $N > /tmp/serve_w$N.log 2>&1 &
  SP=$!
  for i in $(seq 1 240); do
    if [ "$N" = 1 ]; then curl -sf localhost:8000/v2/health/ready >/dev/null && break
    else grep -q "all $N workers are ready" /tmp/serve_w$N.log && break; fi
    kill -0 $SP 2>/dev/null || break
    sleep 1
  done
  echo "workers=$N ready after $(( $(date +%s) - started ))s"; tail -2 /tmp/serve_w$N.log
  python3 -c "import typer; from miaohui.bench.cli import bench_command; app = typer.Typer(); app.command()(bench_command); app()" \
    --target http --concurrency ${LEVELS:-32,128,256} --duration 4s --warmup 1s --processes ${CLIENTS:-6} --tokens 8-64 \
    --engine $R/intent/1 --out "$OUT/gpu_server_w$N.json" --plot "$OUT/gpu_server_w$N.png" 2>&1 | tail -12
  curl -s localhost:8000/metrics | grep -E "^miaohui_(worker_requests_total|process_cpu_seconds_total|batch_size_(sum|count))" | head -20
  kill -TERM $SP; wait $SP; echo "workers=$N exit $?"; tail -2 /tmp/serve_w$N.log
  cp /tmp/serve_w$N.log "$OUT/"
done
