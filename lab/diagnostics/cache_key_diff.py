"""Which parts of Inductor's FX-graph / AOTAutograd cache keys differ between two processes' logs.

    TORCH_LOGS="+torch._inductor.codecache,+torch._functorch._aot_autograd.autograd_cache" <build> > build.log
    ... <serve> > serve.log
    python -m lab.diagnostics.cache_key_diff build.log serve.log

Collects the lines of every "hash details" block (torch logs them at debug level, one block per compiled graph)
and prints the lines found in one log's blocks and in none of the other's.
"""

from __future__ import annotations

import re
import sys

HEAD = re.compile(r"^([VIWE]\d{4} |\d{4}-\d\d-\d\d )")


def detail_lines(path: str) -> tuple[int, set[str]]:
    blocks, lines, inside = 0, set(), False
    with open(path, errors="replace") as f:
        text = f.read()
    for line in text.splitlines():
        if HEAD.match(line):
            inside = "hash details" in line or "cache key" in line.lower()
            blocks += inside
            continue
        if inside:
            lines.add(line[:400])
    return blocks, lines


def main() -> None:
    (nb, b), (ns, s) = detail_lines(sys.argv[1]), detail_lines(sys.argv[2])
    print(f"{sys.argv[1]}: {nb} blocks; {sys.argv[2]}: {ns} blocks")
    for tag, mine, other in (("only in " + sys.argv[2], s, b), ("only in " + sys.argv[1], b, s)):
        diff = sorted(mine - other)
        print(f"{tag}: {len(diff)} lines")
        for line in diff[:60]:
            print("  ", line[:300])


if __name__ == "__main__":
    main()
