#!/usr/bin/env bash
# Downloads the wheels the H200 device image lacks (Python 3.12, x86-64) into the ignored folders that
# `run_h200.sh` installs from: .whl/ (pure-python and small binary packages) and .whlg/ (grpcio ≥ 1.85.1, which the
# generated gRPC stubs need; the image's grpcio is older). Run once per checkout, here, before the first device call;
# carry `.whl .whlg`. The image's own packages (torch, numpy, onnxruntime, transformers, typer, rich, …) are used as is.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whlg/' .git/info/exclude 2>/dev/null || echo '/.whlg/' >> .git/info/exclude
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
dl() { python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$1" "${@:2}"; }
rm -rf .whl .whlg && mkdir -p .whl .whlg
dl .whl "pydantic>=2.7,<3" pydantic-core annotated-types typing-inspection \
  "fastapi>=0.115,<1" starlette "uvicorn>=0.30,<1" httptools "orjson>=3.9,<4" "gguf>=0.10,<1" \
  typing-extensions opentelemetry-api "pytest-asyncio>=0.23,<2" \
  "jsonschema>=4.20,<5" jsonschema-specifications referencing rpds-py attrs
dl .whlg "grpcio>=1.85.1,<2" "protobuf>=7.35.1,<8"
# pydantic pins its core exactly: take the version pydantic asks for
core=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
rm -f .whl/pydantic_core-*.whl && dl .whl "pydantic-core==$core"
ls -1 .whl .whlg && du -sh .whl .whlg
