#!/usr/bin/env bash
# The GPU runs that wait for a device machine, in priority order, in ONE call: a machine's start often fails and a
# session's device time may allow only one call, so nothing here needs a second. Each step gets at most its own limit
# and no more than what is left of BUDGET seconds (default 570: a call's 600 less the transfers); a step whose
# minimum no longer fits is skipped and says so. Results come back as at most 8 files (the device tool's limit):
# the result JSON/PNG under $OUT and every log in $OUT/logs.tgz.
#
#   device call: carry .whl .whlg var/gpu-tok.txz (scripts/gpu/fetch_wheels.sh; var/gpu-tok.txz is SmolLM2's
#   tokenizer, see run_h200.sh own-decoder), command `MIAOHUI_COMMIT=<this checkout's HEAD> bash lab/pending_gpu.sh`
#   (the device copy's .git may be older than its files; the results name the commit MIAOHUI_COMMIT gives)
#
# Steps (STEPS picks some, in this order; default all):
#   setup            wheels, byte-compiled packages (so ready times do not include compiling Python source)
#   prefix_test      prefix-hit graphs against the engine without a cache (tests/gpu/test_slot_engine_gpu.py)
#   slot_tests       every slot-engine GPU test (decode steps and their attention merge included)
#   prefix_copy      a prefix hit's block copy: per layer, all layers at once, one Triton kernel per K/V
#                    (lab/probes/slot_prefix_copy.py)
#   prefix_sweep     the prefix-hit attention kernel per slice length (lab/probes/prefix_attention_sweep.py)
#   prefix_bench     TTFT of a 50-token turn after a cached 500/1,000/2,000-token history against a 50-token prompt
#                    (the history still in its slot, and copied from the pool after another request took the slot)
#   prefix_bench_again  prefix_bench once more on the same machine, into $OUT/again (a ratio within 1-2 % of the
#                    goal needs a second run to say which side it is on)
#   prefix_profile   where a prefix hit's TTFT goes: cProfile and torch.profiler (lab/probes/prefix_turn_profile.py)
#   prefix_host      the prefix cache's host walks on this host's CPU (lab/probes/prefix_cache_host.py)
#   own_model        a team's BERT classifier: build, serve ready on empty caches, speed against torch.compile
#   own_decoder      a team's 1.5B-shaped decoder: build-llm, serve ready on empty caches (no chat bench)
#   start_steps      the decoder's start steps per ready set (READY_SETS, default "1 256;2 256;4 512": rows tokens)
set -uo pipefail
BUDGET=${BUDGET:-570}
R=${OUT:-/tmp/out}
L=/tmp/pending-logs
mkdir -p "$R" "$L"
T0=$(date +%s)

ALL="setup prefix_test slot_tests prefix_copy prefix_sweep prefix_bench prefix_bench_again prefix_profile prefix_host own_model own_decoder start_steps"
STEPS=${STEPS:-$ALL}
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

step() {  # step NAME MIN_SECONDS MAX_SECONDS COMMAND...: run COMMAND under the smaller of MAX and what is left
  local name=$1 min=$2 max=$3 left t started
  shift 3
  left=$((BUDGET - ($(date +%s) - T0)))
  if [ "$left" -lt "$min" ]; then
    echo "skipped $name: ${left} s left, it needs ${min}"
    return
  fi
  t=$((left < max ? left : max))
  started=$(date +%s)
  timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name: rc $? in $(($(date +%s) - started)) s (limit $t)"
  grep -vE "Warning|warn\(" "$L/$name.log" | tail -8
}

wanted setup && step setup 30 120 env OUT="$L" bash scripts/gpu/run_h200.sh setup
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONPYCACHEPREFIX=/tmp/pycache MIAOHUI_HOME=/tmp/mh PYTHONUNBUFFERED=1
wanted prefix_test && step prefix_test 60 120 python3 -m pytest -q -p no:cacheprovider -rA \
  tests/gpu/test_slot_engine_gpu.py -k "prefix_hit or static_prefill_graphs"
wanted slot_tests && step slot_tests 90 240 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_slot_engine_gpu.py
wanted prefix_copy && step prefix_copy 20 40 python3 -m lab.probes.slot_prefix_copy --history 2000 --out "$R"
wanted prefix_sweep && step prefix_sweep 20 120 python3 -m lab.probes.prefix_attention_sweep --out "$R" \
  --chunks 128,256,512 --blocks 64 --warps 4,8 --rows 64,128 --stages 0,2
wanted prefix_bench && step prefix_bench 90 170 python3 benchmarks/bench_prefix_cache_gpu.py --model qwen1.5b \
  --history 500,1000,2000 --iters 15 --out "$R"
wanted prefix_bench_again && step prefix_bench_again 90 170 python3 benchmarks/bench_prefix_cache_gpu.py \
  --model qwen1.5b --history 500,1000,2000 --iters 15 --out "$R/again"
wanted prefix_profile && step prefix_profile 90 150 python3 -m lab.probes.prefix_turn_profile --out "$R"
wanted prefix_host && step prefix_host 5 30 python3 -m lab.probes.prefix_cache_host --out "$R" --tag gpu_host
wanted own_model && step own_model 120 220 env OUT="$R" bash scripts/gpu/run_h200.sh own-model
if wanted own_decoder; then
  step own_decoder 150 240 env OUT="$L/dec" bash scripts/gpu/run_h200.sh own-decoder --variants default --no-bench \
    --ready-timeout 120
  cp "$L"/dec/gpu_own_decoder.json "$R"/ 2>/dev/null
fi
if wanted start_steps; then
  IFS=';' read -ra sets <<< "${READY_SETS:-1 256;2 256;4 512}"
  for rows_tokens in "${sets[@]}"; do
    set -- $rows_tokens
    step "start_steps_r$1_t$2" 40 60 python3 -m lab.probes.decoder_start_steps /tmp/own-decoder/repo/own/1 \
      --out "$L/steps" --tag "_r$1_t$2" --ready-rows "$1" --ready-tokens "$2"
  done
  tar -czf "$R/steps.tgz" -C "$L/steps" . 2>/dev/null
fi
tar -czf "$R/logs.tgz" -C "$L" . 2>/dev/null
ls -l "$R"
