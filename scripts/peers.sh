#!/usr/bin/env bash
# Installs the servers benchmarks/bench_peers_cpu.py compares miaohui with, each into a venv of its own under
# var/peers/<peer>/ (never into the project's .venv, never a project dependency). Idempotent: a venv whose
# requirements are unchanged is kept. Writes var/peers/install.json: per peer what it needed, seconds taken,
# the versions installed, and whether it was reused.
#
#   scripts/peers.sh                 # all peers
#   scripts/peers.sh llamacpp litserve
#   PEERS_DIR=/tmp/peers PYTHON=python3.11 scripts/peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
PEERS_DIR=${PEERS_DIR:-var/peers}
mkdir -p "$PEERS_DIR"

# peer -> pip requirements (space-separated). torch is pinned to the CPU wheel on disk: unpinned, it pulls CUDA.
declare -A REQS=(
  [llamacpp]="xllamacpp==2026.10.11549"
  [transformers]="torch==2.13.0 transformers[serving]==5.24.0"
  [mlserver]="mlserver==1.7.1 opentelemetry-sdk==1.45.2 onnxruntime==1.32.0 tokenizers==0.23.3"
  [pytriton]="nvidia-pytriton==0.7.0 onnxruntime==1.32.0 tokenizers==0.23.3"
  [litserve]="litserve==0.2.19 onnxruntime==1.32.0 tokenizers==0.23.3"
)
# the distributions whose versions are recorded
declare -A SHOW=(
  [llamacpp]="xllamacpp"
  [transformers]="transformers torch"
  [mlserver]="mlserver onnxruntime tokenizers numpy"
  [pytriton]="nvidia-pytriton onnxruntime tokenizers numpy"
  [litserve]="litserve onnxruntime tokenizers numpy"
)
PEERS=("$@")
[ ${#PEERS[@]} -gt 0 ] || PEERS=(llamacpp transformers mlserver pytriton litserve)

for peer in "${PEERS[@]}"; do
  [ -n "${REQS[$peer]+x}" ] || { echo "unknown peer '$peer': use one of ${!REQS[*]}" >&2; exit 2; }
  venv="$PEERS_DIR/$peer"
  stamp="$venv/.requirements"
  record="$PEERS_DIR/$peer.install.json"
  reqs="${REQS[$peer]}"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$reqs" ] && [ -f "$record" ]; then
    echo "$peer: unchanged, kept $venv"
    "$venv/bin/python" - "$record" <<'EOF'
import json, sys
p = sys.argv[1]; d = json.load(open(p)); d["reused"] = True; json.dump(d, open(p, "w"), indent=2)
EOF
    continue
  fi
  echo "$peer: installing $reqs into $venv"
  start=$(date +%s.%N)
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086  # the requirements are words on purpose
  "$venv/bin/python" -m pip install -q $reqs
  end=$(date +%s.%N)
  echo "$reqs" >"$stamp"
  "$venv/bin/python" - "$record" "$peer" "$reqs" "$start" "$end" ${SHOW[$peer]} <<'EOF'
import json, sys, pathlib
from importlib import metadata
record, peer, reqs, start, end, *dists = sys.argv[1:]
versions = {}
for d in dists:
    try:
        versions[d] = metadata.version(d)
    except metadata.PackageNotFoundError:
        versions[d] = "not installed"
site = next(pathlib.Path(sys.prefix).glob("lib/python*/site-packages"))
size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
doc = {"peer": peer, "pip": reqs.split(), "seconds": round(float(end) - float(start), 1), "versions": versions,
       "python": sys.version.split()[0], "venv_mb": round(size / 2**20), "reused": False}
json.dump(doc, open(record, "w"), indent=2)
EOF
  echo "$peer: $(printf '%.0f' "$(echo "$end - $start" | bc)") s"
done

# merge the per-peer records into one file the benchmark copies into its result
python3 - "$PEERS_DIR" <<'EOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
doc = {p.name.split(".")[0]: json.loads(p.read_text()) for p in sorted(root.glob("*.install.json"))}
(root / "install.json").write_text(json.dumps(doc, indent=2))
print(f"wrote {root / 'install.json'}: " + ", ".join(f"{k} {v['seconds']} s" for k, v in doc.items()))
EOF
