"""The CPU runner's prefix cache beyond its blocks: rows retained whole when their sequence leaves."""

from __future__ import annotations

import numpy as np

from miaohui.generation.cache.prefix_kv import RETAINED_ROWS, PrefixKV
from miaohui.generation.executors.base import KVCache
from miaohui.generation.models.dims import DecoderDims


def _row(tokens: list[int], dims: DecoderDims) -> KVCache:
    n = len(tokens)
    layer = np.full((1, dims.num_kv_heads, n, dims.head_dim), float(tokens[0]), dtype=np.float32)
    return KVCache((layer,) * dims.num_layers, (layer,) * dims.num_layers, np.ones((1, n), dtype=np.int64))


def test_retained_rows_are_reused_whole_and_the_oldest_go_first() -> None:
    dims = DecoderDims(
        num_layers=2, hidden=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate=8, vocab=50,
        rope_theta=1e4, rms_eps=1e-6, max_positions=64,
    )  # fmt: skip
    kv = PrefixKV(dims, block_size=16, budget_bytes=1 << 20)
    rows = {t: _row([t, 1, 2], dims) for t in range(RETAINED_ROWS + 1)}
    for t, row in rows.items():
        kv.retain([t, 1, 2], row)
    assert kv.cached([0, 1, 2, 9]) == 0  # the oldest left when the last came
    last = RETAINED_ROWS
    assert kv.cached([last, 1, 2, 9]) == 3 and kv.prefix([last, 1, 2, 9], 3) is rows[last]  # no copy
    part = kv.prefix([last, 1, 2, 9], 2)
    assert part.length == 2 and part.keys[0][0, 0, :, 0].tolist() == [last, last]
    assert kv.cached([last, 1, 2]) == 2  # a prompt no longer than the row: its last token is left to compute
    kv.retain([7, 7], _row([7, 7, 7], dims))  # holds three tokens, not two: refused
    assert kv.cached([7, 7, 1]) == 0
    kv.clear()
    assert kv.cached([last, 1, 2, 9]) == 0 and kv.retained_bytes == 0
    small = PrefixKV(dims, block_size=16, budget_bytes=4 * rows[0].nbytes - 1)  # a quarter holds no row
    small.retain([0, 1, 2], rows[0])
    assert small.cached([0, 1, 2, 9]) == 0
