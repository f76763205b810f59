"""Prefix cache: hash-chained blocks of prompt tokens → their KV, shared by every request, LRU under a byte budget.

Pure Python (no numpy, no torch): a block's KV is an opaque payload whose size the caller states. The design is
vLLM's ``KVCacheManager`` / nano-vllm's ``BlockManager`` without the paged memory: a sequence's tokens are cut into
blocks of ``block_size``; a full block is keyed by ``(parent block id, its tokens)`` — a chain, so a block stands for
its whole prefix and two sequences share a block exactly when they share every token up to its end. The key holds
the tokens themselves, not a digest of them: a lookup can never return another prefix's KV.

* :meth:`PrefixCache.match` walks a sequence's full blocks from the first and returns the longest cached chain.
* :meth:`PrefixCache.insert` adds the blocks of a sequence that are not cached yet (the caller makes their payloads
  only for those: :meth:`PrefixCache.missing` says from which block).
* Eviction is least-recently-used, by block. A use touches a chain from its last block back to its first, so a
  parent is always more recent than its children and the least recent block is a leaf: eviction trims chains
  from their ends and never strands a child whose parent is gone.

The engines keep their own copy of a reused prefix (the ONNX Runtime runner copies the blocks into the sequence's
cache row, :mod:`miaohui.generation.cache.prefix_kv`; the GPU slot engine copies them from a device block pool into
the sequence's slot, :mod:`miaohui.generation.cache.slot_prefix`), so no block is ever pinned by a running sequence.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from miaohui.errors import ConfigError

P = TypeVar("P")

ROOT = -1
"""The parent id of a sequence's first block."""


@dataclass(eq=False)
class Block(Generic[P]):
    """One cached block: ``block_size`` tokens whose KV is ``payload`` (``nbytes`` of memory)."""

    block_id: int
    parent: int
    tokens: tuple[int, ...]
    payload: P
    nbytes: int
    children: set[int] = field(default_factory=set)


def shared_blocks(a: Sequence[Block[P]], b: Sequence[Block[P]]) -> int:
    """How many leading blocks two chains share (each from :meth:`PrefixCache.match` or :attr:`PrefixCache.last_chain`,
    possibly of different times). A block stands for its whole prefix (its key names its parent, and ids are never
    reused), so two chains hold the same blocks up to some point and none after it: a binary search finds it. A block
    evicted since the older chain was taken is not in the newer one (one made again for the same tokens is another
    block), so the shared part ends there."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] is b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache(Generic[P]):
    """Token blocks → payloads (see the module docstring). Not thread-safe: one runner owns it."""

    def __init__(self, block_size: int, budget_bytes: int, on_evict: Callable[[P], None] | None = None) -> None:
        if block_size < 1:
            raise ConfigError(f"prefix cache block_size={block_size}", "use a block size of at least 1 token")
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._by_key: dict[tuple[int, tuple[int, ...]], Block[P]] = {}
        self._lru: OrderedDict[int, Block[P]] = OrderedDict()
        """Every block, least recently used first."""
        self._ids = itertools.count()
        self.evicted_blocks = 0
        self._on_evict = on_evict
        """Called with the payload of every block that leaves the cache (evicted or cleared): a pool hands its
        storage back."""
        self._last: tuple[tuple[int, ...], list[tuple[int, ...]]] = ((), [])
        """The last tuple whose blocks were cut, and its blocks: one request's prompt is looked up, loaded and
        stored (three walks), and cutting a long history into blocks costs more than the walk itself."""
        self._state = 0
        """Counts every change to the blocks or to their order (a touch): a remembered walk is valid while it holds."""
        self._walked: tuple[Sequence[int] | None, int, list[Block[P]]] = (None, -1, [])
        """The last :meth:`match`: its tokens, the state after it, its chain. A prompt's load repeats its lookup and
        its store starts where the lookup ended; with a 2,000-token history each walk hashes 125 blocks."""
        self.chain_end = ROOT
        """The id of the last block of the chain the last :meth:`insert` left (ROOT: none): the caller may pass it
        back as ``after`` when it stores the same tokens extended (a finished sequence after its prompt)."""
        self.last_chain: list[Block[P]] = []
        """The chain the last :meth:`insert` left, first block first (what :func:`shared_blocks` compares)."""

    def __len__(self) -> int:
        return len(self._lru)

    def _keys(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        if tokens is self._last[0]:  # the same (immutable) tuple again
            return self._last[1]
        b = self.block_size
        keys = [tuple(tokens[i : i + b]) for i in range(0, len(tokens) - b + 1, b)]
        if type(tokens) is tuple:
            self._last = (tokens, keys)
        return keys

    def _remembered(self, tokens: Sequence[int]) -> list[Block[P]] | None:
        """:meth:`match`'s chain for ``tokens`` where nothing changed since it ran on this very object."""
        walked, state, chain = self._walked
        return chain if tokens is walked and state == self._state else None

    def match(self, tokens: Sequence[int], start: Sequence[Block[P]] = ()) -> list[Block[P]]:
        """The longest chain of cached blocks that starts ``tokens`` (first block first); touches it.

        ``start``: a chain (:attr:`last_chain` of an earlier insert) whose blocks' tokens the caller compared with the
        first ``len(start)`` blocks of ``tokens``: where its last block is still cached (so is all of it: eviction
        trims chains from their ends) the walk goes on after it, hashing only the blocks past it (a conversation's
        next turn after a 2,000-token history walks its last few blocks, not 125)."""
        chain = self._remembered(tokens)
        if chain is not None:  # walked and touched already, and nothing moved since
            return list(chain)
        b = self.block_size
        if start and self._lru.get(start[-1].block_id) is start[-1] and len(start) * b <= len(tokens):
            chain, keys = list(start), None
        else:
            chain, keys = [], self._keys(tokens)
        parent = chain[-1].block_id if chain else ROOT
        for i in range(len(chain), len(tokens) // b):
            key = keys[i] if keys is not None else tuple(tokens[i * b : i * b + b])
            block = self._by_key.get((parent, key))
            if block is None:
                break
            chain.append(block)
            parent = block.block_id
        self._touch(chain)
        self._walked = (tokens, self._state, chain)
        return list(chain)

    def missing(self, tokens: Sequence[int]) -> int:
        """Index of the first full block of ``tokens`` that is not cached (= the number of full blocks when all are)."""
        chain = self._remembered(tokens)
        if chain is not None:
            return len(chain)
        parent, n = ROOT, 0
        for key in self._keys(tokens):
            block = self._by_key.get((parent, key))
            if block is None:
                break
            parent, n = block.block_id, n + 1
        return n

    def insert(self, tokens: Sequence[int], payload: Callable[[int], tuple[P, int]], after: int | None = None) -> int:
        """Cache the full blocks of ``tokens``; ``payload(i)`` makes block ``i``'s (payload, nbytes), called only for
        blocks not cached yet. Evicts least-recently-used blocks to stay within the budget; stops (caching a shorter
        prefix) where a block does not fit without evicting this chain itself. Returns the blocks added.

        ``after``: a :attr:`chain_end` an earlier insert left for a prefix of these same ``tokens`` (the caller
        vouches for that): the walk goes on from that block without hashing the blocks before it again (a finished
        sequence's store after its prompt's, when the loop goes idle or at the start of the next step). Ignored where
        that block was evicted since, or its tokens are not these tokens' block at its place."""
        chain = self._chain(after, tokens) if after is not None else None
        if chain is None:
            chain = list(self._remembered(tokens) or ())  # blocks a lookup just found: the walk goes on from there
        parent, added = (chain[-1].block_id if chain else ROOT), 0
        b = self.block_size
        keys = self._last[1] if tokens is self._last[0] else None  # else cut only the blocks walked
        for i in range(len(chain), len(tokens) // b):
            key = keys[i] if keys is not None else tuple(tokens[i * b : i * b + b])
            block = self._by_key.get((parent, key))
            if block is None:
                data, nbytes = payload(i)
                if not self._make_room(nbytes, {blk.block_id for blk in chain}):
                    break
                block = Block(next(self._ids), parent, key, data, nbytes)
                self._by_key[(parent, key)] = block
                self._lru[block.block_id] = block
                if parent != ROOT:
                    self._lru[parent].children.add(block.block_id)
                self.used_bytes += nbytes
                self._state += 1
                added += 1
            chain.append(block)
            parent = block.block_id
        self._touch(chain)
        self.chain_end, self.last_chain = parent, chain
        return added

    def _chain(self, last: int, tokens: Sequence[int]) -> list[Block[P]] | None:
        """The cached chain that ends at block ``last`` (first block first), or None where ``last`` is gone (a
        block present means its whole chain is: eviction trims chains from their ends) or is not the block of
        ``tokens`` at its place."""
        block = self._lru.get(last)
        if block is None:
            return None
        chain = [block]
        while block.parent != ROOT:
            block = self._lru[block.parent]
            chain.append(block)
        b, n = self.block_size, len(chain)
        if n * b > len(tokens) or tuple(tokens[(n - 1) * b : n * b]) != chain[0].tokens:
            return None
        chain.reverse()
        return chain

    def clear(self) -> None:
        if self._on_evict is not None:
            for block in self._lru.values():
                self._on_evict(block.payload)
        self._by_key.clear()
        self._lru.clear()
        self.used_bytes = 0
        self._state += 1

    def _touch(self, chain: list[Block[P]]) -> None:
        for block in reversed(chain):  # the first block ends up most recent: parents outlive their children
            self._lru.move_to_end(block.block_id)
        self._state += 1

    def _make_room(self, nbytes: int, keep: set[int]) -> bool:
        if nbytes > self.budget_bytes:
            return False
        while self.used_bytes + nbytes > self.budget_bytes:
            victim = next(iter(self._lru.values()))
            if victim.block_id in keep:
                return False
            self._evict(victim)
        return True

    def _evict(self, block: Block[P]) -> None:
        for child in list(block.children):  # none while parents stay more recent than children; kept safe anyway
            self._evict(self._lru[child])
        del self._lru[block.block_id]
        del self._by_key[(block.parent, block.tokens)]
        if block.parent in self._lru:
            self._lru[block.parent].children.discard(block.block_id)
        self.used_bytes -= block.nbytes
        self.evicted_blocks += 1
        self._state += 1
        if self._on_evict is not None:
            self._on_evict(block.payload)
