#!/usr/bin/env bash
# On the GPU host: the e5 intent engine (inductor fp16, scripts/gpu/build_intent_gpu.py's build and serving config) served
# by `miaohui serve --workers N` for each N in $WORKERS (default "1 4 8"), each loaded with `miaohui bench`
# (HTTP /v1/intent, closed loop, 6 client processes). Needs the intent model (run_h200.sh setup), or MODEL=var/models/intent-e5-shape.
set -uo pipefail
OUT=$1
R=/tmp/gpurepo
if [ ! -f $R/intent/config.yaml ] || [ -n "${DELAY_MS:-}" ] || [ -n "${INSTANCES:-}" ]; then
python3 scripts/gpu/build_intent_gpu.py $R ${DELAY_MS:-1} ${INSTANCES:-1}
fi
# MPS=1: start the CUDA MPS daemon first, so the workers' kernels share the GPU instead of time-slicing contexts
if [ "${MPS:-0}" = 1 ]; then
  if command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d && echo "MPS daemon started"
  else
    echo "MPS requested but nvidia-cuda-mps-control is not on this image"
  fi
fi
TAG=${TAG:-}
for N in ${WORKERS:-1 4 8}; do
  started=$(date +%s)
  extra=""; [ "${SHARED:-0}" = 1 ] && extra="--shared-engine"  # SHARED=1: one engine process for all workers
  # PIN=1: server on cores 0-9, load clients on 10-15 (they otherwise compete for the same cores, and the server's
  # host time per request moves between calls)
  srv_pin=""; cli_pin=""; [ "${PIN:-0}" = 1 ] && { srv_pin="taskset -c 0-9"; cli_pin="taskset -c 10-15"; }
  $srv_pin python3 -m miaohui.cli serve -r $R --port 8000 --grpc-port 8001 --workers $N $extra > /tmp/serve_w$N.log 2>&1 &
  SP=$!
  for i in $(seq 1 240); do
    if [ "$N" = 1 ]; then curl -sf localhost:8000/v2/health/ready >/dev/null && break
    else grep -q "all $N workers are ready" /tmp/serve_w$N.log && break; fi
    kill -0 $SP 2>/dev/null || break
    sleep 1
  done
  echo "workers=$N ready after $(( $(date +%s) - started ))s"; tail -2 /tmp/serve_w$N.log
  # SPY=1: py-spy the (last) server process during the first load level (lab/diagnostics/spy_server.sh)
  pattern="miaohui.cli serve"; [ "$N" != 1 ] && pattern="multiprocessing.spawn"
  [ "${SPY:-0}" = 1 ] && { PATTERN=$pattern bash lab/diagnostics/spy_server.sh "$OUT/spy_w$N" 3 3 > /tmp/spy_w$N.log 2>&1 & }
  COLUMNS=200 $cli_pin python3 -c "import typer; from miaohui.bench.cli import bench_command; app = typer.Typer(); app.command()(bench_command); app()" \
    --target http --concurrency ${LEVELS:-32,128,256} --duration ${DURATION:-4}s --warmup 1s --processes ${CLIENTS:-6} --tokens 8-64 \
    --engine $R/intent/1 --out "$OUT/gpu_server_w$N$TAG.json" --plot "$OUT/gpu_server_w$N$TAG.png" 2>&1 | tail -12
  curl -s localhost:8000/metrics | grep -E "^miaohui_(worker_requests_total|process_cpu_seconds_total|batch_size_(sum|count)|gc_pause_seconds_(sum|count))" | head -20
  kill -TERM $SP; wait $SP; echo "workers=$N exit $?"; tail -2 /tmp/serve_w$N.log
  [ -f /tmp/spy_w$N.log ] && cat /tmp/spy_w$N.log && python3 lab/diagnostics/spy_top.py "$OUT/spy_w$N.all.txt" 16 | head -70 \
    && python3 lab/diagnostics/spy_top.py "$OUT/spy_w$N.gil.txt" 16 | head -40
  cp /tmp/serve_w$N.log "$OUT/"
done
if [ "${MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then echo quit | nvidia-cuda-mps-control; fi
