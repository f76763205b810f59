#!/usr/bin/env bash
# py-spy the running `miaohui serve` process(es) while they are under load: waits for one, then records
# $2 s of stacks per thread (collapsed "raw" format, readable with `python lab/diagnostics/spy_top.py`), all
# threads and then only the GIL holder. Usage: spy_server.sh OUT_PREFIX SECONDS DELAY_S
set -uo pipefail
prefix=$1; secs=${2:-6}; delay=${3:-0}
PYSPY=${PYSPY:-/tmp/site/bin/py-spy}
# a `--workers N` server's workers are multiprocessing spawn children: PATTERN picks one of them
pattern=${PATTERN:-miaohui.cli serve}
for i in $(seq 1 400); do pid=$(pgrep -f "$pattern" | tail -1); [ -n "$pid" ] && break; sleep 0.5; done
[ -z "${pid:-}" ] && { echo "spy: no server process"; exit 0; }
sleep "$delay"
echo "spy: pid $pid at $(date +%T)"
$PYSPY record --pid "$pid" --duration "$secs" --rate 200 --threads --format raw -o "$prefix.all.txt" >/dev/null 2>&1
$PYSPY record --pid "$pid" --duration "$secs" --rate 200 --threads --gil --format raw -o "$prefix.gil.txt" >/dev/null 2>&1
$PYSPY dump --pid "$pid" > "$prefix.dump.txt" 2>&1
echo "spy: done at $(date +%T)"; ls -la "$prefix".* 2>&1
