#!/usr/bin/env bash
# Regenerates the gRPC stubs of src/miaohui/server/proto/grpc_service.proto (KServe v2 / Triton wire format).
# The generated files are committed; run this after editing the .proto:  bash scripts/gen_proto.sh
#
# Two things differ from plain protoc output, both applied here so a rerun reproduces the committed files:
# * `-I src` makes the stubs import each other as `miaohui.server.proto.…` (no sys.path tricks).
# * The descriptors go into a private descriptor pool, not protobuf's default one. Our messages share their
#   names (`inference.ModelInferRequest`, …) with tritonclient's own stubs, and the default pool refuses a
#   second file defining the same symbols ("duplicate symbol 'inference.ServerLiveRequest'"), so a process
#   that imports both — a test, a benchmark driving the server in-process — would fail at import.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
OUT=src/miaohui/server/proto
PROTO="$OUT/grpc_service.proto"

"$PY" -c "import grpc_tools" 2>/dev/null || { echo "grpcio-tools is missing: $PY -m pip install grpcio-tools" >&2; exit 1; }
"$PY" -m grpc_tools.protoc -I src --python_out=src --pyi_out=src --grpc_python_out=src "$PROTO"

PB2="$OUT/grpc_service_pb2.py"
grep -q "_descriptor_pool.Default().AddSerializedFile(" "$PB2" || { echo "unexpected protoc output in $PB2" >&2; exit 1; }
sed -i \
  -e 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/POOL = _descriptor_pool.DescriptorPool()  # private: see scripts\/gen_proto.sh\nDESCRIPTOR = POOL.AddSerializedFile(/' \
  "$PB2"
# The .pyi is type-checked and linted with the package (only *_pb2*.py are excluded): keep ruff happy.
"$VENV/bin/ruff" check --fix-only --silent "$OUT/grpc_service_pb2.pyi" || true
"$VENV/bin/ruff" format --silent "$OUT/grpc_service_pb2.pyi"
echo "generated $(ls "$OUT"/grpc_service_pb2*)"
