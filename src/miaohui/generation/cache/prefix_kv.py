"""The prefix cache of the CPU model runner: a sequence's KV rows ↔ cached token blocks (numpy).

A block's payload is one float32 array ``[layers, 2 (key, value), kv_heads, block_size, head_dim]``: one copy in and
one ``np.concatenate`` out per block, and each layer's past is then a contiguous view of the joined array. A reused
prefix is *copied* into the new sequence's cache row (the batched cache of
:mod:`miaohui.generation.executors.base` is one array per layer, not paged): on SmolLM2-135M a cached token costs
~46 KB to copy against a full forward pass to recompute.

:meth:`PrefixKV.cached` says how much of a prompt is cached and :meth:`PrefixKV.prefix` gives it as a one-row
:class:`KVCache`; at least the prompt's last token is always left to compute (its logits start the answer), so a
prompt that is wholly cached reuses all but that token (a block's KV is valid for any leading part of it: a token's
key and value depend only on the tokens before it). :meth:`PrefixKV.store` caches the full blocks of a row's tokens:
the prompt right after its prefill (so requests that arrive together share a system prompt) and the prompt + answer
when the sequence leaves (so a conversation's next turn, which repeats both, reuses them).

A leaving row is also *retained* whole (:meth:`PrefixKV.retain`, llama.cpp's slot prompt cache): its per-layer arrays
as the engine returned them, and the exact tokens they hold. A prompt that starts with all of a retained row's tokens
(a conversation's next turn) reuses those arrays as they are: no block copy, and no recomputation of the partial last
block. On SmolLM2-135M at 600 tokens the block copy took 6.2 ms of a ~60 ms turn. The last :data:`RETAINED_ROWS` rows
that left are kept, within a quarter of the byte budget; the blocks stay the shared, LRU-evicted cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from miaohui.generation.cache.prefix_cache import PrefixCache
from miaohui.generation.executors.base import KVCache
from miaohui.generation.models.dims import DecoderDims

RETAINED_ROWS = 4
"""Rows of sequences that left kept whole (the most recent): a conversation's next turn usually comes from one of the
last few, and each costs its full KV (27 MB for SmolLM2-135M at 600 tokens)."""


@dataclass
class PrefixStats:
    """Running totals: prompt tokens looked up and prompt tokens whose KV came from the cache."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    kept_tokens: int = 0
    """Of the hit tokens, those whose KV the sequence's slot still held from the turn before, so nothing was copied
    (the GPU slot engine; :mod:`~miaohui.generation.cache.slot_prefix`)."""


class PrefixKV:
    """A :class:`PrefixCache` of numpy KV blocks for one :class:`~miaohui.generation.executors.base.CausalLMEngine`."""

    def __init__(self, dims: DecoderDims, block_size: int, budget_bytes: int) -> None:
        self.dims = dims
        self.cache: PrefixCache[np.ndarray] = PrefixCache(block_size, budget_bytes)
        self.stats = PrefixStats()
        self._retained: OrderedDict[tuple[int, ...], KVCache] = OrderedDict()
        """Tokens → a one-row cache holding exactly them, the most recent last."""
        self._retained_budget = budget_bytes // 4

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def cached(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` the cache holds, short of its last (counts the lookup)."""
        blocks = len(self.cache.match(prompt)) * self.block_size
        n = min(max(blocks, len(self._retained_row(prompt)[0])), len(prompt) - 1)
        self.stats.queried_tokens += len(prompt)
        return max(n, 0)

    def _retained_row(self, prompt: Sequence[int]) -> tuple[tuple[int, ...], KVCache | None]:
        """The longest retained row whose tokens all begin ``prompt`` (its tokens, its cache), or ``((), None)``."""
        best: tuple[tuple[int, ...], KVCache | None] = ((), None)
        for tokens, kv in self._retained.items():
            if len(best[0]) < len(tokens) <= len(prompt) and tuple(prompt[: len(tokens)]) == tokens:
                best = (tokens, kv)
        return best

    def retain(self, tokens: Sequence[int], kv: KVCache) -> None:
        """Keep ``kv`` (one row holding exactly ``tokens``, no padding) for a prompt that starts with ``tokens``."""
        key = tuple(tokens)
        if kv.batch != 1 or kv.length != len(key) or not key or kv.nbytes > self._retained_budget:
            return
        self._retained.pop(key, None)
        self._retained[key] = kv
        while len(self._retained) > RETAINED_ROWS or self.retained_bytes > self._retained_budget:
            self._retained.popitem(last=False)

    @property
    def retained_bytes(self) -> int:
        return sum(kv.nbytes for kv in self._retained.values())

    def prefix(self, prompt: Sequence[int], n: int) -> KVCache:
        """The one-row cache of the first ``n`` tokens of ``prompt`` (at most :meth:`cached`'s count); counts them as
        hits."""
        tokens, row = self._retained_row(prompt)
        if row is not None and len(tokens) >= n > 0:
            self.stats.hit_tokens += n
            self._retained.move_to_end(tokens)
            if n == len(tokens):
                return row  # the engine's own arrays: no copy
            return KVCache(
                tuple(k[:, :, :n] for k in row.keys), tuple(v[:, :, :n] for v in row.values), row.mask[:, :n]
            )
        blocks = self.cache.match(prompt)
        full, rest = divmod(n, self.block_size)
        if full + (1 if rest else 0) > len(blocks) or n <= 0:
            raise ValueError(f"prefix of {n} tokens asked, {len(blocks)} blocks cached")  # a runner bug
        self.stats.hit_tokens += n
        parts = [b.payload for b in blocks[:full]]
        if rest:
            parts.append(blocks[full].payload[:, :, :, :rest])
        joined = np.concatenate(parts, axis=3) if len(parts) > 1 else np.ascontiguousarray(parts[0])
        layers = range(self.dims.num_layers)
        return KVCache(
            tuple(joined[i, 0][None] for i in layers),
            tuple(joined[i, 1][None] for i in layers),
            np.ones((1, n), dtype=np.int64),
        )

    def store(self, tokens: Sequence[int], kv: KVCache, row: int) -> int:
        """Cache the full blocks of ``tokens``, whose KV is row ``row`` of ``kv`` (its real slots, in order: the row
        holds exactly these tokens). Returns the blocks added."""
        b = self.block_size
        first = self.cache.missing(tokens)
        if first * b + b > len(tokens):
            self.cache.match(tokens)  # all cached: a use all the same
            return 0
        cols = np.flatnonzero(kv.mask[row])[first * b : (len(tokens) // b) * b]
        gathered = np.stack(
            [np.stack([k[row][:, cols], v[row][:, cols]]) for k, v in zip(kv.keys, kv.values, strict=True)]
        )  # [layers, 2, kv_heads, blocks * b, head_dim]

        def payload(i: int) -> tuple[np.ndarray, int]:
            j = (i - first) * b
            block = np.ascontiguousarray(gathered[:, :, :, j : j + b])
            return block, block.nbytes

        return self.cache.insert(tokens, payload)

    def clear(self) -> None:
        self.cache.clear()
        self._retained.clear()
