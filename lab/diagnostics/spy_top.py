"""Summarise a py-spy ``--format raw`` file: samples per thread, then the functions with the most inclusive and
self samples (per thread). ``python lab/diagnostics/spy_top.py FILE [N]``."""

from __future__ import annotations

import collections
import sys


def main(path: str, n: int = 25) -> None:
    threads: collections.Counter[str] = collections.Counter()
    incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    self_: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        c = int(count)
        threads[thread] += c
        for f in set(frames):
            incl[thread][f] += c
        if frames:
            self_[thread][frames[-1]] += c
    total = sum(threads.values())
    print(f"{path}: {total} samples")
    for thread, c in threads.most_common():
        print(f"\n== {thread}: {c} samples ({100 * c / max(total, 1):.0f}%)")
        print("  inclusive:")
        for f, k in incl[thread].most_common(n):
            print(f"  {100 * k / c:5.1f}%  {f}")
        print("  self:")
        for f, k in self_[thread].most_common(n // 2):
            print(f"  {100 * k / c:5.1f}%  {f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
