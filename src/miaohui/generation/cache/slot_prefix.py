"""The prefix cache of the GPU slot engine: cached token blocks in a device block pool ↔ the static KV cache's slots.

The slot engine's KV cache (:class:`~miaohui.generation.models.static_kv.StaticKVDecoder`) is one
``[slots, kv_heads, max_len, head_dim]`` tensor per layer for keys and one for values; a sequence owns a slot and its
tokens sit at positions ``0 .. length-1``. The cached blocks live apart from the slots, in a pool allocated once on the
same device: one ``[layers, pool_blocks, kv_heads, block_size, head_dim]`` tensor for keys and one for values, as
many blocks as ``prefix_cache_mb`` holds (every layer in one tensor, so that a load or a store moves all layers' blocks
in a few operations: with a tensor per layer, a 28-layer model's load was 168 small operations, whose host time
exceeded the device's copy; ``lab/probes/slot_prefix_copy.py`` times both forms). Which token blocks the pool holds,
and which pool block each one is, is the hash chain of :class:`~miaohui.generation.cache.prefix_cache.PrefixCache`
(the same LRU as the CPU runner's); a block's payload is its pool index, handed back to the free list when the block
is evicted.

* :meth:`SlotPrefixKV.cached` — how many leading tokens of a prompt the pool holds (all but its last at most);
* :meth:`SlotPrefixKV.load` — copies those blocks into a slot's positions ``0 ..`` (on a GPU one Triton kernel for
  keys and values, :mod:`~miaohui.generation.kernels.block_copy`; elsewhere one gather for all layers, then one
  multi-tensor copy into the layers' slots); the engine then prefills only the rest, from that
  position, attending over the loaded part (:meth:`~miaohui.generation.models.static_kv.StaticKVDecoder.prefill_from`);
* :meth:`SlotPrefixKV.store` — copies the full blocks of a slot's tokens that are not cached yet into free pool blocks
  (on a GPU one kernel for keys and values, else a stack and an index copy; evicting the least recently used):
  a prompt right after its prefill (requests that follow share a system prompt), its prompt and answer when the
  sequence leaves (a conversation's next turn repeats both).

Why a pool and copies rather than only matching new prompts against the slots that finished sequences left behind
(keeping their KV resident): a slot is reused by the next prompt whatever it held, decode steps pad their batch with
free slots (which write a padding token at position 0), and one cached system prompt is needed by many running
sequences at once, each in its own slot. A copy is a gather and a write on the device, in the engine's stream; its
bytes (the prefix's KV) are read once, where recomputing the prefix reads every weight. The slot a conversation's last
turn left is still used where nothing wrote it since (the runner gives the next turn that slot and :meth:`load` copies
only the blocks it lacks): on a quiet server that is a conversation's every turn, and it saves the copy's launch and
bytes (``held``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miaohui.generation.cache.prefix_cache import Block, PrefixCache
from miaohui.generation.cache.prefix_kv import PrefixStats
from miaohui.generation.kernels import block_copy


@dataclass(eq=False)
class PoolBlock:
    """A cached block's place in the pool (``-1`` until :meth:`SlotPrefixKV.store` gives it one)."""

    index: int = -1


class SlotPrefixKV:
    """A :class:`PrefixCache` whose blocks live in a device pool beside the static caches ``keys`` / ``values`` (one
    ``[slots, kv_heads, max_len, head_dim]`` tensor per layer each). Not thread-safe: the runner's thread owns it."""

    def __init__(
        self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], block_size: int, budget_bytes: int
    ) -> None:
        self.keys, self.values = list(keys), list(values)
        first = self.keys[0]
        _, kv_heads, _, head_dim = first.shape
        self.block_bytes = 2 * len(self.keys) * kv_heads * block_size * head_dim * first.element_size()
        self.capacity = max(0, budget_bytes // self.block_bytes)
        """Pool blocks: as many as the budget holds."""
        self.cache: PrefixCache[PoolBlock] = PrefixCache(block_size, self.capacity * self.block_bytes, self._free)
        self.stats = PrefixStats()
        shape = (2, len(self.keys), self.capacity, kv_heads, block_size, head_dim)
        # torch.empty: on a CPU the pages are only touched when a block is stored
        self.pool = torch.empty(shape, dtype=first.dtype, device=first.device)
        """Keys' blocks then values' blocks: ``pool[0]`` and ``pool[1]`` are laid out as the layers in the address
        table (keys' layers, then values'), so one kernel launch moves both."""
        self.pool_k, self.pool_v = self.pool[0], self.pool[1]
        self._free_blocks = list(range(self.capacity - 1, -1, -1))
        self._table: torch.Tensor | None = None
        """On a GPU, the caches' addresses, keys' layers then values': a load or a store is then one kernel launch
        (:mod:`miaohui.generation.kernels.block_copy`)."""
        if first.is_cuda and block_copy.supported(self.keys + self.values, block_size):
            self._table = block_copy.address_table(self.keys + self.values)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def pool_bytes(self) -> int:
        return self.capacity * self.block_bytes

    def _free(self, block: PoolBlock) -> None:
        if block.index >= 0:
            self._free_blocks.append(block.index)
            block.index = -1

    def cached(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` the pool holds, short of its last (at least the last token is
        computed: its logits start the answer). Counts the prompt as looked up."""
        self.stats.queried_tokens += len(prompt)
        return max(0, min(len(self.cache.match(prompt)) * self.block_size, len(prompt) - 1))

    def load(self, prompt: Sequence[int], n: int, slot: int, held: int = 0) -> int:
        """Copy the cached KV of the first ``n`` tokens of ``prompt`` (at most :meth:`cached`'s count) into ``slot``'s
        positions ``0 .. n-1``, in whole blocks (positions up to the end of the last block are written too; the
        prefill of the rest overwrites them), but for the first ``held`` blocks, which the slot already holds (the
        runner's word: the turn before left them there). Counts the ``n`` tokens as hits; returns those of them the
        slot held (not copied)."""
        if n <= 0:
            return 0
        used = -(-n // self.block_size)
        kept = n if held >= used else held * self.block_size
        self.stats.hit_tokens += n
        self.stats.kept_tokens += kept
        if held >= used:
            return kept
        blocks = self.cache.match(prompt)
        if used > len(blocks):
            raise ValueError(f"prefix of {n} tokens asked, {len(blocks)} blocks cached")  # a runner bug
        idx = self._indices([b.payload.index for b in blocks[held:used]])
        self.copy_in(idx, slot, kernel=self._table is not None, start_block=held)
        return kept

    def copy_in(self, idx: torch.Tensor, slot: int, kernel: bool, start_block: int = 0) -> None:
        """Copy pool blocks ``idx`` (int64, prefix order, on the pool's device) of every layer into ``slot``'s
        positions from block ``start_block`` on: ``kernel``, one Triton launch for keys and values (a GPU,
        :attr:`_table`); else one gather for all layers, then one multi-tensor copy into the layers' slot rows (the
        reference form)."""
        if kernel:
            self._kernel_copy(idx, slot, to_slot=True, start_block=start_block)
            return
        used = idx.shape[0]
        cols = slice(start_block * self.block_size, (start_block + used) * self.block_size)
        for cache, pool in ((self.keys, self.pool_k), (self.values, self.pool_v)):
            _, _, kv_heads, block, head_dim = pool.shape
            # [layers, used, kv_heads, block, head_dim] in one gather; each layer's slot row seen as
            # [kv_heads, used, block, head_dim]
            part = pool.index_select(1, idx).transpose(1, 2).unbind(0)
            rows = [layer[slot, :, cols].view(kv_heads, used, block, head_dim) for layer in cache]
            torch._foreach_copy_(rows, list(part))

    def store(self, tokens: Sequence[int], slot: int, after: int | None = None) -> int:
        """Cache the full blocks of ``tokens``, whose KV ``slot`` holds at positions ``0 .. len(tokens)-1``; returns
        the blocks added (evicting least recently used ones; a chain never evicts itself, so under a tiny budget a
        long sequence caches its first blocks only). ``after``: the :attr:`chain_end` of an earlier store of a prefix
        of ``tokens`` (``PrefixCache.insert``'s)."""
        if self.capacity == 0:
            return 0
        made: list[tuple[int, PoolBlock]] = []

        def payload(i: int) -> tuple[PoolBlock, int]:
            made.append((i, PoolBlock()))
            return made[-1][1], self.block_bytes

        added = self.cache.insert(tokens, payload, after)  # one walk; a use of the cached blocks all the same
        if not added:
            return 0
        new = made[:added]  # a block made but not added (no room) is the last one made
        for _, block in new:
            block.index = self._free_blocks.pop()
        b, first = self.block_size, new[0][0]
        idx = self._indices([block.index for _, block in new])
        if self._table is not None:
            self._kernel_copy(idx, slot, to_slot=False, start_block=first)
            return added
        cols = slice(first * b, (first + added) * b)
        for cache, pool in ((self.keys, self.pool_k), (self.values, self.pool_v)):
            layers, _, kv_heads, _, head_dim = pool.shape
            rows = torch.stack([layer[slot, :, cols] for layer in cache])  # [layers, kv_heads, added * b, head_dim]
            pool.index_copy_(1, idx, rows.view(layers, kv_heads, added, b, head_dim).transpose(1, 2))
        return added

    @property
    def chain(self) -> list[Block[PoolBlock]]:
        """The chain the last :meth:`store` left (``PrefixCache.last_chain``): the blocks whose KV that slot holds."""
        return self.cache.last_chain if self.capacity else []

    @property
    def chain_end(self) -> int:
        """The last block of the chain the last :meth:`store` left (``PrefixCache.chain_end``)."""
        return self.cache.chain_end

    def _kernel_copy(self, idx: torch.Tensor, slot: int, *, to_slot: bool, start_block: int = 0) -> None:
        """:func:`~miaohui.generation.kernels.block_copy.copy_blocks` for keys and values at once (the pool seen as
        ``2 × layers`` layers, as the table lists them)."""
        assert self._table is not None, "the kernel copy needs the caches' address table (a GPU)"
        pool = self.pool.flatten(0, 1)
        block_copy.copy_blocks(self._table, self.keys[0], pool, idx, slot, to_slot=to_slot, start_block=start_block)

    def _indices(self, blocks: list[int]) -> torch.Tensor:
        """Pool block indices on the pool's device; the host-to-device copy does not wait for the device's queue."""
        return torch.tensor(blocks, dtype=torch.int64).to(self.pool_k.device, non_blocking=True)

    def clear(self) -> None:
        self.cache.clear()
