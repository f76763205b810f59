"""Copying a cached prefix's KV blocks into a new sequence's row against recomputing it (SmolLM2-135M fp32, ONNX
Runtime, this CPU): the time of ``PrefixKV.prefix`` (joining the blocks) + the prefill of a 20-token rest with that
past, against the prefill of the whole prompt, for prompts of 128–1024 tokens. Median of 5 after one warm-up.

    .venv/bin/python lab/probes/prefix_copy_vs_recompute.py REPOSITORY
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from miaohui.generation.build.artifact import latest_version
from miaohui.generation.cache.prefix_kv import PrefixKV
from miaohui.generation.executors.ort_engine import OrtCausalLMEngine


def timed(fn, n: int = 5) -> float:  # type: ignore[no-untyped-def]
    fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1000


def main() -> None:
    repo = Path(sys.argv[1]) / "smollm2"
    with OrtCausalLMEngine(repo / str(latest_version(repo))) as engine:
        cache = PrefixKV(engine.dims, 16, 1 << 30)
        print(f"{'tokens':>6} {'join ms':>8} {'rest prefill ms':>16} {'full prefill ms':>16}")
        for n in (128, 256, 512, 1024):
            prompt = [(i * 7919) % 40000 + 100 for i in range(n + 20)]
            _, kv = engine.prefill([prompt[:n]])
            cache.store(prompt[:n], kv, 0)
            join = timed(lambda: cache.prefix(prompt, n))  # noqa: B023
            past = cache.prefix(prompt, n)
            rest = timed(lambda: engine.prefill([prompt[n:]], past))  # noqa: B023
            full = timed(lambda: engine.prefill([prompt]), 3)  # noqa: B023
            print(f"{n:>6} {join:>8.1f} {rest:>16.1f} {full:>16.1f}", flush=True)


if __name__ == "__main__":
    main()
