"""The host's part of a multi-turn prefix hit, per request, on this machine's CPU (no model, no device): the prompt's
lookup (a new tuple: the walk is not remembered), a conversation's next turn looked up from its first block or, as
the slot runner does, after the chain its slot holds (its tokens compared), and the finished sequence's store of its
prompt and answer at the start of the next request's step, hashing the prompt's blocks again or going on from the
prompt's chain end (``PrefixCache.insert(after=...)``).

    python -m lab.probes.prefix_cache_host --history 2000 --turn 50 [--out DIR]

Prints min-of-repeats microseconds per call and writes DIR/prefix_cache_host_TAG.json when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time
import timeit
from pathlib import Path
from typing import Any

from miaohui.generation.cache.prefix_cache import PrefixCache


def _head() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--turn", type=int, default=50)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tag", default="cpu", help="the result file's suffix: the machine it ran on")
    args = ap.parse_args()
    rng = random.Random(0)
    cache: PrefixCache[object] = PrefixCache(args.block, 1 << 40)
    prompt = tuple(rng.randrange(50_000) for _ in range(args.history + args.turn))
    cache.insert(prompt, lambda i: (object(), 1))
    end = cache.chain_end
    done = [*prompt, *(rng.randrange(50_000) for _ in range(args.answer))]
    blocks = len(prompt) // args.block
    cache.insert(tuple(done), lambda i: (object(), 1), end)
    held, stored, b = cache.last_chain, tuple(done), args.block
    n = len(held) * b
    next_turn = [*done, *(rng.randrange(50_000) for _ in range(args.turn))]

    def next_turn_lookup() -> None:  # the slot runner's: compare the held slot's tokens, walk on after its chain
        t = tuple(next_turn)
        assert t[n - b : n] == held[-1].tokens and t[:n] == stored[:n]
        cache.match(t, held)

    def us(fn: Any) -> float:
        return min(timeit.repeat(fn, number=500, repeat=7)) / 500 * 1e6

    result = {
        "tokens": len(prompt),
        "blocks": blocks,
        "lookup_us": us(lambda: cache.match(tuple(list(prompt)))),
        # the answer's blocks are added once; later calls find them cached: the walk is what is timed
        "next_turn_lookup_full_walk_us": us(lambda: cache.match(tuple(next_turn))),
        "next_turn_lookup_from_held_chain_us": us(next_turn_lookup),
        "release_store_rehash_us": us(lambda: cache.insert(list(done), lambda i: (object(), 1))),
        "release_store_from_chain_end_us": us(lambda: cache.insert(list(done), lambda i: (object(), 1), end)),
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("MIAOHUI_COMMIT") or _head(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "command": "python -m lab.probes.prefix_cache_host "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k not in ("out", "tag")),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"prefix_cache_host_{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
