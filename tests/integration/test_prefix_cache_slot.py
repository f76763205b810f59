"""Prefix caching on the GPU slot engine (``inductor``), run eagerly on the CPU: a prompt's cached prefix is copied
from the device block pool into its slot and only the rest is prefilled, from that position. Greedy tokens with the
cache equal those without it on a tiny random decoder (grouped-query attention) and on the real SmolLM2: multi-turn
conversations, a shared system prompt (also across concurrent requests and with async scheduling), eviction under a
tiny budget, prompts shorter than a block; the reused token counts are exact (blocks of 16) and reach the metrics."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch
from tests.counting import CountingGets

from miaohui.generation.cache.slot_prefix import SlotPrefixKV
from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.engine.slot_runner import SlotModelRunner
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.dims import DecoderDims
from miaohui.generation.models.static_kv import StaticKVDecoder

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
DIMS = DecoderDims(
    num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128, vocab=512,
    rope_theta=10000.0, rms_eps=1e-6, max_positions=512,
)  # fmt: skip
MAX_LEN = 256


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """One torch thread: the tiny model's ops are microseconds, and a second thread on a loaded 2-core machine made
    each one wait ~10 ms for it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny(slots: int = 4, mixed: tuple[int, ...] = (128, 256), static_prefill: bool = False) -> TorchSlotEngine:
    """A tiny random decoder (the same weights every call: seed 0) on the slot engine, mixed steps on; decode attention
    in its matmul form (the triton op's CPU fallback costs ~50 ms a call behind its custom-op wrapper)."""
    dec = StaticKVDecoder(DIMS, num_slots=slots, max_len=MAX_LEN)
    dec.init_random(0, std=0.1)
    opts = SlotEngineOptions(
        num_slots=slots,
        max_len=MAX_LEN,
        dtype="fp32",
        mixed_prefill_tokens=mixed,
        decode_attention="matmul",
        static_prefill=static_prefill,
        prefix_graphs=static_prefill,
    )
    return TorchSlotEngine(dec, [1], 0, opts)


def _llm(engine: TorchSlotEngine, mb: float = 16.0, **sched: Any) -> LLMEngine:
    return LLMEngine(engine, None, SchedulerConfig(prefix_cache_mb=mb, max_model_len=MAX_LEN, **sched))


def _cache(llm: LLMEngine) -> SlotPrefixKV:
    runner = llm.runner
    assert isinstance(runner, SlotModelRunner) and runner.prefix_cache is not None
    return runner.prefix_cache


def _stats(llm: LLMEngine) -> tuple[int, int]:
    stats = _cache(llm).stats
    return stats.queried_tokens, stats.hit_tokens


def _words(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 500 + 10 for i in range(n)]


def _conversation(llm: LLMEngine, system: list[int], users: list[list[int]], end: list[int]) -> list[list[int]]:
    """Turn after turn: the prompt is the history (system, then each user turn and its reply, closed by ``end``)."""
    history, replies = list(system), []
    for user in users:
        history += user
        reply = llm.generate([history], GREEDY)[0][0]
        replies.append(reply)
        history += reply + end
    return replies


def test_prefill_from_a_loaded_prefix_equals_a_whole_prefill() -> None:
    engine = _tiny()
    model, prompt = engine.model, torch.tensor([_words(2, 37)])
    whole = model.prefill(prompt, torch.tensor([37]), torch.tensor([0]))
    model.prefill(prompt[:, :20], torch.tensor([20]), torch.tensor([1]))  # slot 1 holds the first 20 tokens
    rest = model.prefill_from(prompt[:, 20:], torch.tensor([17]), torch.tensor([1]), torch.tensor([20]), 37)
    torch.testing.assert_close(rest, whole, rtol=1e-5, atol=1e-5)
    for keys in model.k_cache:
        torch.testing.assert_close(keys[1, :, :37], keys[0, :, :37], rtol=1e-5, atol=1e-5)


def test_multi_turn_conversation_and_a_shared_system_prompt_match_no_cache() -> None:
    system, users, end = _words(1, 21), [_words(10 + k, 5 + k) for k in range(4)], [2, 13]
    cached, plain = _llm(_tiny()), _llm(_tiny(), 0.0)
    assert _conversation(cached, system, users, end) == _conversation(plain, system, users, end)
    # turn 1 (26 tokens) misses; each later turn reuses the full blocks of the previous prompt + the 11 reply tokens
    # fed back (the 12th was sampled, never computed): 37 → 32, 57 → 48, 78 → 64
    assert _stats(cached) == (26 + 46 + 67 + 89, 0 + 32 + 48 + 64)
    # another session with the same system prompt (21 tokens: one full block, then a partial one)
    other = [_words(50, 9)]
    assert _conversation(cached, system, other, end) == _conversation(plain, system, other, end)
    assert _stats(cached)[1] == 144 + 16


def test_static_prefix_hit_step_matches_no_cache() -> None:
    """With ``static_prefill`` a prefix hit's rest runs the step a GPU captures as a graph (the static buffers, padded
    to its (prompts, length) bucket, padding rows repeating the first, the whole slot attended): the greedy tokens of
    an engine without a cache, turn after turn, two conversations at once (a two-prompt bucket)."""
    users = [[_words(10 + k, 5 + k), _words(30 + k, 9)] for k in range(4)]
    engine = _tiny(static_prefill=True)
    cached, plain = _llm(engine), _llm(_tiny(static_prefill=True), 0.0)
    talks: list[list[int]] = [_words(1, 21), _words(2, 27)]
    for turn in users:
        talks = [t + u for t, u in zip(talks, turn, strict=True)]
        got = [g[0] for g in cached.generate(talks, GREEDY)]
        assert got == [w[0] for w in plain.generate(talks, GREEDY)]
        talks = [t + g + [2, 13] for t, g in zip(talks, got, strict=True)]
    assert engine.static_prefix_steps >= 2 and engine.prefix_graph_steps == 0  # no CUDA graphs on a CPU
    assert _stats(cached)[1] > 0


def test_concurrent_requests_share_a_system_prompt() -> None:
    """Four requests with one system prompt arrive together; prefilled one per step (``max_prefill_seqs=1``), each
    later one reuses the system prompt's blocks, cached right after the first one's prefill, while the earlier ones
    decode (those steps decode and prefill separately: a mixed step starts its prompts at position 0)."""
    system = _words(3, 40)
    prompts = [system + _words(20 + k, 6 + k) for k in range(4)]
    cached, plain = _llm(_tiny(), max_prefill_seqs=1), _llm(_tiny(), 0.0, max_prefill_seqs=1)
    assert cached.generate(prompts, GREEDY) == plain.generate(prompts, GREEDY)
    assert _stats(cached) == (46 + 47 + 48 + 49, 3 * 32)


def test_prompts_prefilled_together_with_different_prefixes() -> None:
    base = _words(4, 40)
    cached, plain = _llm(_tiny()), _llm(_tiny(), 0.0)
    cached.generate([base], GREEDY)  # caches 40 + 11 tokens: blocks of 16 → 48
    prompts = [base[:35] + _words(5, 3), base + _words(6, 30), _words(7, 7), base[:20]]
    assert cached.generate(prompts, GREEDY) == plain.generate(prompts, GREEDY)
    # cached: 32 of the 1st, 32 of the 2nd (its 3rd block departs from the cached reply), 16 of the 4th; the widest
    # rest is the 2nd's 38 tokens, and a row that reuses a prefix computes that width (no padding past its prompt's
    # end): only the 2nd could reuse its 32 — under half of the step's 135 prompt tokens, so the step takes the
    # captured paths (mixed steps, static prefill graphs) and reuses nothing
    queried, hit = _stats(cached)
    assert (queried - 40, hit) == (38 + 70 + 7 + 20, 0)


def test_a_step_reusing_most_of_its_tokens_takes_back_the_widest_rest() -> None:
    base = _words(4, 40)
    cached, plain = _llm(_tiny()), _llm(_tiny(), 0.0)
    reply = list(cached.generate([base], GREEDY)[0][0])  # caches the 40 + 11 fed tokens: 3 blocks of 16 → 48
    prompts = [base + reply[:8] + _words(5, 3), base[:20]]
    assert cached.generate(prompts, GREEDY) == plain.generate(prompts, GREEDY)
    # cached: 48 of the 1st (rest 3), 16 of the 2nd (rest 4); the widest rest is 4, so the 1st takes back one token
    # of its prefix: 47 + 16 of the step's 71 prompt tokens reused
    queried, hit = _stats(cached)
    assert (queried - 40, hit) == (51 + 20, 47 + 16)


def test_prompts_shorter_than_a_block_and_a_wholly_cached_prompt() -> None:
    cached, plain = _llm(_tiny()), _llm(_tiny(), 0.0)
    short = _words(8, 9)
    for _ in range(2):  # nothing to cache under one block: both miss
        assert cached.generate([short], GREEDY) == plain.generate([short], GREEDY)
    assert _stats(cached) == (18, 0)
    assert len(_cache(cached).cache) == 1  # the first prompt + its 11 fed reply tokens: 20 → one block
    prompt = _words(9, 32)
    cached.generate([prompt], GREEDY)
    # a prompt the cache holds whole reuses all but its last token (its logits start the answer)
    assert cached.generate([prompt], GREEDY) == plain.generate([prompt], GREEDY)
    assert _stats(cached) == (18 + 64, 31)


def test_eviction_under_a_tiny_budget_keeps_outputs_equal() -> None:
    engine = _tiny()
    block = 2 * DIMS.num_layers * DIMS.num_kv_heads * 16 * DIMS.head_dim * 4
    cached, plain = _llm(engine, 3 * block / 2**20), _llm(_tiny(), 0.0)  # three blocks
    pool = _cache(cached)
    assert (pool.block_bytes, pool.capacity) == (block, 3)
    system, users, end = _words(11, 30), [_words(30 + k, 6) for k in range(3)], [2]
    assert _conversation(cached, system, users, end) == _conversation(plain, system, users, end)
    cache = pool.cache
    # one chain never evicts itself: the conversation's history fills the budget and stops there
    assert (len(cache), cache.evicted_blocks, len(cache.match(system + users[0]))) == (3, 0, 2)
    other = _words(99, 36)  # two blocks, and its answer (11 fed tokens) fills no third
    assert cached.generate([other], GREEDY) == plain.generate([other], GREEDY)
    # another prompt's two blocks evict the two least recent (the conversation's last) and take their pool blocks
    assert (len(cache), cache.used_bytes, cache.evicted_blocks) == (3, 3 * block, 2)
    assert (len(cache.match(system)), len(cache.match(other)), pool._free_blocks) == (1, 2, [])
    assert _conversation(cached, system, users[:1], end) == _conversation(plain, system, users[:1], end)


def test_a_conversations_next_turn_takes_the_slot_its_last_turn_left() -> None:
    """On a quiet engine each turn lands in the slot the turn before left, which still holds the history: the hit copies
    nothing from the pool (every hit token kept). A request in between takes that slot (the lowest free one); the turn
    after it copies the pool's blocks again. Tokens equal an engine without a cache throughout."""
    system, users, end = _words(1, 21), [_words(10 + k, 5 + k) for k in range(4)], [2, 13]
    cached, plain = _llm(_tiny()), _llm(_tiny(), 0.0)
    assert _conversation(cached, system, users[:3], end) == _conversation(plain, system, users[:3], end)
    stats = _cache(cached).stats
    assert (stats.hit_tokens, stats.kept_tokens) == (32 + 48, 32 + 48)
    history = system + users[0]
    for user in users[1:3]:
        history += plain.generate([history], GREEDY)[0][0] + end + user
    history += plain.generate([history], GREEDY)[0][0] + end + users[3]
    other = _words(77, 40)
    assert cached.generate([other], GREEDY) == plain.generate([other], GREEDY)
    assert cached.generate([history], GREEDY) == plain.generate([history], GREEDY)
    assert (stats.hit_tokens - 80, stats.kept_tokens) == (64, 80)  # 67 + 11 fed tokens cached → 64 reused, copied


def test_a_decode_padding_a_held_slot_makes_the_next_turn_copy_again() -> None:
    """A (2 tokens) and B (12) start together in slots 0 and 1. A leaves first; B's decode steps then run rows 0..1,
    padding with slot 0 (a padding token written at its position 0), so slot 0 no longer holds A's history: A's next
    turn copies its blocks from the pool, and its tokens equal an engine without a cache."""
    a, b, end = _words(21, 37), _words(22, 30), [2, 13]
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engines = {"cached": _llm(_tiny()), "plain": _llm(_tiny(), 0.0)}
    got: dict[str, list[list[int]]] = {}
    for name, llm in engines.items():
        ids = [llm.add_request(a, short), llm.add_request(b, GREEDY)]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        while llm.has_work():
            step = llm.step_fn()
            for up in step.updates if step is not None else ():
                if up.token_id is not None:
                    tokens[up.seq_id].append(up.token_id)
        turn = a + tokens[ids[0]] + end + _words(23, 6)
        got[name] = [tokens[ids[0]], tokens[ids[1]], llm.generate([turn], GREEDY)[0][0]]
    assert got["cached"] == got["plain"]
    stats = _cache(engines["cached"]).stats
    assert (stats.hit_tokens, stats.kept_tokens) == (32, 0)  # 37 + 1 fed tokens cached → 32 reused, copied


def test_a_held_slot_is_taken_only_for_a_prompt_it_holds_half_of() -> None:
    """Slots 0 and 1 end first and are padded by slot 2's decode; slot 2 then ends holding its prompt's blocks. A prompt
    sharing one of those blocks (16 of its 76 tokens) takes the lowest free slot, not slot 2; one that continues slot
    2's prompt takes slot 2."""
    llm = _llm(_tiny())
    runner = llm.runner
    assert isinstance(runner, SlotModelRunner)
    one, four = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 4))
    third = _words(33, 40)
    for prompt, params in ((_words(31, 20), one), (_words(32, 20), one), (third, four)):
        llm.add_request(prompt, params)
    while llm.has_work():
        llm.step_fn()
    cache = _cache(llm).cache
    gets = []
    for prompt, slot in ((third[:16] + _words(34, 60), 0), (third + _words(35, 8), 2)):
        seq = llm.add_request(prompt, one)
        cache._by_key = CountingGets(cache._by_key)
        llm.step_fn()
        gets.append(cache._by_key.gets)
        assert runner._slot[seq] == slot
        while llm.has_work():
            llm.step_fn()
    # the continuation's lookup starts after slot 2's two blocks: its third block is looked up, and again when stored
    # (a walk from the first block would look up all three first)
    assert gets[1] == 2


def test_a_prompt_sharing_only_the_held_chains_last_block_does_not_start_from_it() -> None:
    """The runner starts a lookup after a held slot's chain only where the prompt begins with every token that slot
    stored, not just its last block's: a prompt whose second block equals the held one but whose first does not
    reuses nothing, and its tokens equal an engine without a cache."""
    x, y, other = _words(41, 16), _words(42, 16), _words(43, 16)
    engines = {"cached": _llm(_tiny()), "plain": _llm(_tiny(), 0.0)}
    got = {}
    for name, llm in engines.items():
        llm.generate([x + y + _words(44, 5)], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        got[name] = llm.generate([other + y + _words(45, 20)], GREEDY)
    assert got["cached"] == got["plain"]
    assert _stats(engines["cached"])[1] == 0


async def test_an_idle_loop_stores_and_holds_a_finished_sequence_before_the_next_request() -> None:
    """When the serving loop runs out of work it lets go of the finished sequences (their prompt and answer stored,
    their slot held for the next turn), so that is not part of the next request's time to first token."""
    llm = _llm(_tiny())
    runner = llm.runner
    assert isinstance(runner, SlotModelRunner)
    prompt = _words(50, 40)
    async with AsyncLLMEngine(llm, None, async_scheduling=True) as engine:
        got = [e.token_id async for e in engine.add(prompt, GREEDY) if e.token_id is not None]
        for _ in range(200):  # the loop thread goes idle right after the last token
            if runner._held:  # set last, after the store
                break
            await asyncio.sleep(0.01)
        assert runner._slot == {} and list(runner._held) == [0]
        # the prompt's 40 tokens and the 11 answer tokens fed back: three blocks cached, before any next request
        assert len(_cache(llm).cache.match(tuple(prompt + got[:11]))) == 3


async def test_async_scheduling_and_metrics_count_the_hits() -> None:
    from miaohui.server.metrics import Metrics
    from miaohui.server.observer_metrics import MetricsObserver

    metrics = Metrics()
    system = _words(12, 40)
    prompts = [system + _words(40 + k, 5) for k in range(3)]
    plain = _llm(_tiny(), 0.0).generate(prompts, GREEDY)
    llm = _llm(_tiny(), max_prefill_seqs=1)
    async with AsyncLLMEngine(llm, MetricsObserver(metrics, "t", 1), async_scheduling=True) as engine:
        streams = [engine.add(p, GREEDY) for p in prompts]
        got = [[e.token_id for e in [ev async for ev in s] if e.token_id is not None] for s in streams]
        # the last to finish still holds its slot (the others' were padding rows of its decode steps): its next
        # turn (45 + 12 + 2 + 5 tokens) takes that slot and copies none of the 48 cached tokens it reuses
        turn = prompts[2] + got[2] + [2, 13] + _words(43, 5)
        nxt = [e.token_id async for e in engine.add(turn, GREEDY) if e.token_id is not None]
    assert got == [g[0] for g in plain]
    assert nxt == _llm(_tiny(), 0.0).generate([turn], GREEDY)[0][0]
    sample = metrics.registry.get_sample_value
    assert sample("miaohui_prefix_cache_queried_tokens_total", {"model": "t"}) == 3 * 45 + 64
    assert sample("miaohui_prefix_cache_hit_tokens_total", {"model": "t"}) == 2 * 32 + 48
    assert sample("miaohui_prefix_cache_kept_tokens_total", {"model": "t"}) == 48


def test_smollm2_conversation_matches_no_cache(smollm: tuple[Any, Any]) -> None:
    slots = 2
    from miaohui.zoo.smollm import encode_chat

    model, tok = smollm
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a concise bank advisor."}]
    turns = ["What is a fixed deposit?", "And its interest rate?", "Is it safe?"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    engines = []
    for mb in (64.0, 0.0):
        dec = StaticKVDecoder.from_hf(model, num_slots=slots, max_len=MAX_LEN)
        opts = SlotEngineOptions(num_slots=slots, max_len=MAX_LEN, dtype="fp32")
        engines.append(_llm(TorchSlotEngine(dec, [tok.eos_token_id], 0, opts), mb))
    replies: list[list[list[int]]] = [[], []]
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        prompt = encode_chat(messages, tokenizer=tok)
        outs = [llm.generate([prompt], params)[0][0] for llm in engines]
        for got, out in zip(replies, outs, strict=True):
            got.append(out)
        messages.append({"role": "assistant", "content": tok.decode(outs[1], skip_special_tokens=True)})
    assert replies[0] == replies[1]
    # each turn reuses the blocks of the previous prompt + the 15 reply tokens fed back: 27 + 15 → 32, 59 + 15 → 64
    assert [len(p) for p in _prompts(messages, tok)] == [27, 59, 90]
    assert _stats(engines[0]) == (27 + 59 + 90, 32 + 64)


def _prompts(messages: list[dict[str, str]], tok: Any) -> list[list[int]]:
    from miaohui.zoo.smollm import encode_chat

    return [encode_chat(messages[: 2 + 2 * k], tokenizer=tok) for k in range(len(messages) // 2)]


def _random_rounds(llm: LLMEngine, seed: int, rounds: int = 24) -> list[list[int]]:
    """Four conversations and unrelated prompts, in rounds of one to four requests that start a few steps apart (so
    some prefill while others decode, decode steps pad with free slots, and a turn finds its slot held or taken); each
    conversation continues at most once a round, with its reply and a new user turn, and starts over near the slots'
    end. The choices come from ``seed`` alone, so two engines get the same requests while their answers agree. Returns
    every request's tokens in order."""
    rng = random.Random(seed)
    histories = [_words(100 + k, rng.randint(20, 60)) for k in range(4)]
    done: list[list[int]] = []
    for r in range(rounds):
        keys = rng.sample(["c0", "c1", "c2", "c3", "other", "other"], rng.choice([1, 1, 2, 2, 3, 4]))
        due: list[tuple[int, str, list[int], SamplingParams]] = []
        for i, key in enumerate(keys):
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True)
            prompt = _words(1000 + 10 * r + i, rng.randint(3, 40)) if key == "other" else histories[int(key[1])]
            due.append((rng.randint(0, 3), key, list(prompt), params))
        tokens: dict[int, list[int]] = {}
        which: dict[int, str] = {}
        step = 0
        while due or llm.has_work():
            for item in [d for d in due if d[0] <= step]:
                due.remove(item)
                seq = llm.add_request(item[2], item[3])
                tokens[seq], which[seq] = [], item[1]
            out = llm.step_fn()
            for up in out.updates if out is not None else ():
                if up.token_id is not None:
                    tokens[up.seq_id].append(up.token_id)
            step += 1
        for seq, got in tokens.items():
            done.append(got)
            if which[seq] != "other":
                k = int(which[seq][1])
                nxt = histories[k] + got + [2, 13] + _words(200 + 10 * r + k, rng.randint(3, 20))
                histories[k] = nxt if len(nxt) + 12 < MAX_LEN else _words(300 + 10 * r + k, 30)
    return done


@pytest.mark.parametrize(
    ("static_prefill", "async_scheduling", "mb"),
    [(False, False, 16.0), (True, True, 16.0), (False, True, 0.125)],
    ids=["eager", "static-async", "evicting"],
)
def test_random_rounds_of_conversations_and_other_prompts_match_no_cache(
    static_prefill: bool, async_scheduling: bool, mb: float
) -> None:
    """Whatever interleaves (held slots taken, padded or kept, the pool's copies, evictions under a budget of a few
    blocks), every answer equals the engine's without a prefix cache."""
    engines = {"cached": _llm(_tiny(static_prefill=static_prefill), mb), "plain": _llm(_tiny(), 0.0)}
    if async_scheduling:
        engines["cached"].use_async_scheduling()
    got = {name: _random_rounds(llm, seed=7) for name, llm in engines.items()}
    assert got["cached"] == got["plain"]
    stats = _cache(engines["cached"]).stats
    assert stats.hit_tokens > 0 and stats.kept_tokens > 0
    if mb < 1:
        assert _cache(engines["cached"]).cache.evicted_blocks > 0
