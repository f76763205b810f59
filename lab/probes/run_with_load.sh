#!/usr/bin/env bash
# Runs a benchmark command on the shared CPU machine and records the load around it.
#
#   lab/probes/run_with_load.sh NAME command args...
#
# Writes $LOGDIR/NAME.load (`uptime` and the busiest processes with their nice values, before and after; default
# LOGDIR=/tmp/run-with-load), NAME.out and NAME.err. The command, and every process it starts, runs in a scheduler
# autogroup of nice -19: with sched_autogroup_enabled=1 (this VM) the kernel shares the CPU between sessions first,
# so other sessions' `nice -n 19` does not make them yield to a benchmark at nice 0. Servers the benchmarks start
# open sessions of their own (start_new_session), so their autogroups are set too, every 0.5 s.
set -u
name=$1
shift
logdir=${LOGDIR:-/tmp/run-with-load}
mkdir -p "$logdir"
log=$logdir/$name.load
busiest() { ps -eo ni,pcpu,etime,args --sort=-pcpu | head -6 | cut -c1-150; }
{
  echo "BEFORE $(date -u +%FT%TZ) $(uptime)"
  busiest
} >"$log"
start=$(date +%s)
# shellcheck disable=SC2016  # $@ is the inner shell's
setsid --wait bash -c 'echo -19 > /proc/self/autogroup; exec "$@"' _ "$@" >"$logdir/$name.out" 2>"$logdir/$name.err" &
main=$!
while kill -0 "$main" 2>/dev/null; do
  for p in $(pstree -p "$main" 2>/dev/null | grep -o '([0-9]*)' | tr -d '()'); do
    grep -q 'nice -19' "/proc/$p/autogroup" 2>/dev/null || echo -19 >"/proc/$p/autogroup" 2>/dev/null
  done
  sleep 0.5
done
wait "$main"
rc=$?
{
  echo "AFTER $(date -u +%FT%TZ) $(uptime) rc=$rc wall=$(($(date +%s) - start))s"
  busiest
} >>"$log"
exit "$rc"
