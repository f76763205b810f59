#!/usr/bin/env bash
# Writes an older commit's src/ to .ab/base/src (git-ignored here) for an A/B on the device: carry ".ab" and run a
# stage that serves from it (serve_workers.sh SRC=.ab/base/src, bench_generation_gpu.py --server-src .ab/base/src).
#   bash scripts/gpu/ab_base.sh REV
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:?usage: ab_base.sh REV}
grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
rm -rf .ab/base && mkdir -p .ab/base
git archive "$rev" src | tar -x -C .ab/base
git rev-parse "$rev" > .ab/base/REV
echo "$(cat .ab/base/REV) → .ab/base/src ($(du -sh .ab/base | cut -f1))"
