#!/usr/bin/env bash
# A smoke deployment without a cluster: the CPU overlay rendered by kustomize and run by `podman kube play`.
# podman runs the Deployment's pod only (not the Service, HPA, PDB or the probes), turns a ConfigMap subPath mount
# into a folder, and publishes no Service: this script drops the subPath mount (the image's own config.yaml serves),
# runs the pod on the host network, waits for /v2/health/ready, asks /v1/intent once, and tears the pod down.
#
#   IMAGE=miaohui:0.1.0-cpu PORT=18080 bash scripts/image/kube_play.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${IMAGE:-miaohui:0.1.0-cpu}
PORT=${PORT:-18080}
GRPC_PORT=${GRPC_PORT:-18081}
VENV=${VENV:-.venv}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/scripts/image/containers.conf}
OUT=$(mktemp -d)
trap 'podman kube down "$OUT/play.yaml" >/dev/null 2>&1 || true; rm -rf "$OUT"' EXIT
kubectl kustomize deploy/k8s/overlays/cpu >"$OUT/cpu.yaml"
"$VENV/bin/python" - "$OUT/cpu.yaml" "$OUT/play.yaml" "$IMAGE" "$PORT" "$GRPC_PORT" <<'PY'
import sys

import yaml

src, dst, image, port, grpc_port = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(src)) if d]
deploy = next(d for d in docs if d["kind"] == "Deployment")
(box,) = deploy["spec"]["template"]["spec"]["containers"]
box["image"] = image
args = box["args"]
args[args.index("--host") + 1] = "127.0.0.1"  # the host network: only this machine reaches it
args[args.index("--port") + 1] = port
args[args.index("--grpc-port") + 1] = grpc_port
box["volumeMounts"] = [m for m in box["volumeMounts"] if "subPath" not in m]
pod = deploy["spec"]["template"]["spec"]
pod["volumes"] = [v for v in pod["volumes"] if v["name"] in {m["name"] for m in box["volumeMounts"]}]
box["resources"] = {}  # the pod runs with what the machine has
box.pop("ports", None)  # the host network publishes nothing: podman refuses port mappings there
yaml.safe_dump(deploy, open(dst, "w"))
PY
podman kube play --replace --network host "$OUT/play.yaml" >/dev/null
for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$PORT/v2/health/ready" >/dev/null; then
        echo "kube play: ready"
        curl -sf "http://127.0.0.1:$PORT/v1/intent" -H 'content-type: application/json' -d '{"text": "你好"}'
        echo
        exit 0
    fi
    sleep 1
done
echo "kube play: not ready after 300 s" >&2
podman pod ps >&2
exit 1
