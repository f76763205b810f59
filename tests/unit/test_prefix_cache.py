"""The prefix cache's block manager alone (pure Python payloads): chains, partial blocks, LRU eviction."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tests.counting import CountingGets

from miaohui.errors import ConfigError
from miaohui.generation.cache.prefix_cache import PrefixCache, shared_blocks


def _insert(cache: PrefixCache[str], tokens: Sequence[int]) -> int:
    return cache.insert(tokens, lambda i: (f"kv{tokens[i * 4 : i * 4 + 4]}", 10))


def test_longest_chain_of_full_blocks_is_found_and_shared() -> None:
    cache: PrefixCache[str] = PrefixCache(block_size=4, budget_bytes=1000)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    assert _insert(cache, [*system, 9, 10, 11, 12, 13]) == 3  # the 13th token is a partial block: not cached
    assert [b.payload for b in cache.match([*system, 9, 10, 11, 12, 99])] == [
        "kv[1, 2, 3, 4]",
        "kv[5, 6, 7, 8]",
        "kv[9, 10, 11, 12]",
    ]
    assert len(cache.match([*system, 9, 10, 99, 12])) == 2  # a block matches only in full
    assert len(cache.match([1, 2, 3, 5, 5, 6, 7, 8])) == 0  # same second block, other first: another chain
    assert _insert(cache, [*system, 20, 21, 22, 23]) == 1  # the system prompt's blocks are shared
    assert len(cache) == 4 and cache.used_bytes == 40
    assert cache.missing([*system, 20, 21, 22, 23, 24, 25, 26, 27]) == 3


def test_eviction_is_lru_from_the_ends_of_chains_and_stays_in_budget() -> None:
    cache: PrefixCache[str] = PrefixCache(block_size=4, budget_bytes=30)  # three blocks
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]
    _insert(cache, a)
    _insert(cache, b)  # shares block [1..4]: three blocks, full
    cache.match(a)  # a used last: b's own block is the least recent
    assert _insert(cache, [7, 7, 7, 7]) == 1
    assert cache.used_bytes == 30 and cache.evicted_blocks == 1
    assert len(cache.match(b)) == 1 and len(cache.match(a)) == 2
    # a chain longer than the budget keeps its first blocks and never evicts itself
    assert _insert(cache, list(range(100, 116))) == 3
    assert [len(cache.match(x)) for x in (a, list(range(100, 116)))] == [0, 3]
    assert cache.used_bytes == 30


def test_bad_block_size_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"^prefix cache block_size=0 — use a block size of at least 1 token$"):
        PrefixCache(block_size=0, budget_bytes=10)


def test_a_remembered_walk_gives_what_a_fresh_walk_gives() -> None:
    """The same random mix of lookups, loads and stores (under evictions) on two caches: one sees each prompt as the
    same tuple again (its walks are remembered), the other a fresh list every time (it walks each time). Every
    answer, the blocks held and their LRU order stay equal."""
    import random

    rng = random.Random(0)
    prompts = [tuple(rng.choice((1, 2)) for _ in range(rng.randrange(4, 40))) for _ in range(30)]
    fast: PrefixCache[str] = PrefixCache(block_size=4, budget_bytes=200)  # 20 blocks: evictions happen
    slow: PrefixCache[str] = PrefixCache(block_size=4, budget_bytes=200)
    remembered, p, hinted = 0, prompts[0], 0
    ends: dict[tuple[int, ...], int] = {}  # the fast cache's chain end after each prompt's store, stale or not
    for _ in range(3000):
        p = p if rng.random() < 0.6 else rng.choice(prompts)  # a request's lookup, load and store follow each other
        op = rng.randrange(5)
        answer = [rng.choice((1, 2)) for _ in range(rng.randrange(0, 12))]
        for cache, tokens in ((fast, p), (slow, list(p))):
            if op == 4:  # a finished sequence: its prompt and answer, from its prompt's chain end on the fast cache
                after = ends.get(p) if cache is fast else None
                hinted += cache is fast and after is not None and cache._chain(after, [*p, *answer]) is not None
                got = [cache.insert([*p, *answer], lambda i: ("x", 10), after)]
            elif op == 0:
                remembered += cache._remembered(tokens) is not None
                got = [b.tokens for b in cache.match(tokens)]
            elif op == 1:
                got = [cache.missing(tokens)]
            elif op == 2:
                got = [_insert(cache, tokens)]
            else:
                got = [b.tokens for b in cache.match(tokens)] + [_insert(cache, tokens)]
            if cache is fast:
                want = got
                if op in (2, 3):
                    ends[p] = cache.chain_end
        assert got == want
        assert list(fast._lru) == list(slow._lru) and fast.used_bytes == slow.used_bytes
    assert remembered > 50 and fast.evicted_blocks > 50 and hinted > 50


def test_a_lookup_after_another_prompts_use_touches_again() -> None:
    """A remembered walk is not reused once another chain was touched in between (here by a store that adds
    nothing): the lookup makes its chain the most recent again, as a fresh walk does."""
    cache: PrefixCache[str] = PrefixCache(block_size=4, budget_bytes=1000)
    a, b = (1, 1, 1, 1, 2, 2, 2, 2), (3, 3, 3, 3)
    _insert(cache, a)
    _insert(cache, b)
    cache.match(a)
    assert _insert(cache, b) == 0  # b most recent
    cache.match(a)
    assert [blk.tokens for blk in cache._lru.values()][-1] == a[:4]


def test_shared_blocks_of_a_stored_chain_and_a_later_lookup() -> None:
    """What a slot holds (the chain its sequence's store left) against a later prompt's lookup: the blocks both
    chains hold, up to where they part; a block evicted since (and made again for the same tokens) ends it."""
    cache: PrefixCache[str] = PrefixCache(block_size=4, budget_bytes=50)  # five blocks
    held_tokens = list(range(1, 17))  # four blocks
    _insert(cache, held_tokens)
    held = cache.last_chain
    assert [b.block_id for b in held] == [b.block_id for b in cache.match(held_tokens)]
    assert shared_blocks(held, cache.match([*held_tokens, 17, 18, 19, 20])) == 4  # a continuation: all of it
    assert shared_blocks(held, cache.match([*held_tokens[:10], 0, 0, 0, 0, 0, 0])) == 2  # parts in block 3
    assert shared_blocks(held, cache.match([9, 9, 9, 9, *held_tokens])) == 0
    assert shared_blocks(held, []) == shared_blocks([], held) == 0
    cache.match(held_tokens[:8])  # the first two blocks most recent: the last two go first
    _insert(cache, [50, 51, 52, 53, 54, 55, 56, 57])  # two new blocks: evicts the held chain's last
    assert cache.evicted_blocks == 1
    cache.match(held_tokens[:12])  # the new chain least recent now
    assert _insert(cache, held_tokens) == 1  # its last block made again: another block for the same tokens
    assert len(cache.match(held_tokens)) == 4 and shared_blocks(held, cache.match(held_tokens)) == 3


def test_a_walk_from_a_known_chain_hashes_only_the_blocks_past_it() -> None:
    """``match(tokens, start)`` goes on after ``start`` (a stored chain the caller compared with the tokens) where its
    last block is still cached, and finds the same chain as a walk from the first block; where that block was evicted
    it walks from the first block."""
    cache: PrefixCache[str] = PrefixCache(block_size=4, budget_bytes=60)  # six blocks: full after the turn
    history = list(range(1, 21))  # five blocks
    _insert(cache, history)
    held = cache.last_chain
    turn = (*history, 30, 31, 32, 33, 34)
    _insert(cache, turn)  # the turn's sixth block cached too
    counting = CountingGets(cache._by_key)
    cache._by_key = counting
    chain = cache.match(turn, held)
    assert counting.gets == 1  # the sixth block only
    assert [b.block_id for b in chain] == [
        b.block_id for b in cache.match(tuple(list(turn)))
    ]  # a new tuple: walked again
    assert counting.gets == 1 + 6
    cache.match(history[:4])  # the first block most recent; the turn's sixth, then the fifth are least recent
    _insert(cache, [50, 51, 52, 53, 54, 55, 56, 57])  # two new blocks evict those two
    assert cache.evicted_blocks == 2 and cache._lru.get(held[-1].block_id) is None
    counting.gets = 0
    assert [b.block_id for b in cache.match((*turn,), held)] == [b.block_id for b in held[:4]]
    assert counting.gets == 5  # from the first block: four found, the fifth is gone
