"""Prefix caching on the ONNX Runtime runner: greedy tokens with the cache equal those without it, on tiny random
decoders (Llama; Gemma 3, whose sliding-window layers count cache slots) and on the real SmolLM2: multi-turn
conversations, a shared system prompt, eviction under a tiny budget, partial-block prefixes and a request aborted
while its prefill computed. The reused token counts are exact (blocks of 16)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.prebuild import ensure_llm_repository
from tests.tiny_decoders import save_tiny_decoder, smollm_tokenizer

from miaohui.generation.build.artifact import build_causal_lm, latest_version
from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.engine.runner import ModelRunner
from miaohui.generation.engine.scheduler import SchedulerConfig
from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return smollm_tokenizer()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request: pytest.FixtureRequest, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(f"prefix-{request.param}")
    source = save_tiny_decoder(request.param, root / f"Tiny-{request.param}", tokenizer)
    with OrtCausalLMEngine(build_causal_lm(root / "repo", "t", "fp32", source=source)) as engine:
        yield engine


def _llm(engine: OrtCausalLMEngine, mb: float = 64.0, tokenizer: Any = None) -> LLMEngine:
    return LLMEngine(engine, tokenizer, SchedulerConfig(prefix_cache_mb=mb, max_model_len=1024))


def _stats(llm: LLMEngine) -> tuple[int, int]:
    runner = llm.runner
    assert isinstance(runner, ModelRunner) and runner.prefix_cache is not None
    return runner.prefix_cache.stats.queried_tokens, runner.prefix_cache.stats.hit_tokens


def _conversation(llm: LLMEngine, system: list[int], users: list[list[int]], end: list[int]) -> list[list[int]]:
    """Turn after turn: the prompt is the history (system, then each user turn and its reply, closed by ``end``)."""
    history, replies = list(system), []
    for user in users:
        history += user
        reply = llm.generate([history], GREEDY)[0][0]
        replies.append(reply)
        history += reply + end
    return replies


def _words(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 5000 + 100 for i in range(n)]


def test_multi_turn_shared_system_prompt_and_partial_blocks_match_no_cache(tiny: OrtCausalLMEngine) -> None:
    system, users, end = _words(1, 21), [_words(10 + k, 5 + k) for k in range(4)], [2, 13]
    cached, plain = _llm(tiny), _llm(tiny, 0.0)
    assert _conversation(cached, system, users, end) == _conversation(plain, system, users, end)
    # turn 1 (26 tokens) misses; each later turn reuses the previous turn's retained row whole: its prompt + the 11
    # reply tokens fed back (the 12th was sampled, never computed): 37, 57, 78 (blocks alone would give 32, 48, 64)
    assert _stats(cached) == (26 + 46 + 67 + 89, 0 + 37 + 57 + 78)
    # another session with the same system prompt (21 tokens: one full block, then a partial one)
    other = [_words(50, 9)]
    assert _conversation(cached, system, other, end) == _conversation(plain, system, other, end)
    assert _stats(cached)[1] == 172 + 16  # its system prompt's full block (no retained row begins this prompt)


def test_prompts_prefilled_together_with_different_prefixes(tiny: OrtCausalLMEngine) -> None:
    base = _words(3, 40)
    cached, plain = _llm(tiny), _llm(tiny, 0.0)
    cached.generate([base], GREEDY)  # caches 40 + 11 tokens: blocks of 16 → 48
    prompts = [base[:35] + _words(4, 3), base + _words(5, 30), _words(6, 7), base[:20]]
    assert cached.generate(prompts, GREEDY) == plain.generate(prompts, GREEDY)
    # cached: 32 of the 1st (2 blocks), 32 of the 2nd (its 3rd block departs from the cached reply), 16 of the 4th;
    # the widest rest is the 2nd's 38 tokens, and a row that reuses its prefix computes that width (no padding between
    # prefix and rest): the 2nd reuses its 32, the 1st (38 tokens) and the 4th (20) compute everything
    queried, hit = _stats(cached)
    assert (queried - 40, hit) == (38 + 70 + 7 + 20, 32)


def test_a_retained_row_reused_in_part_beside_a_fresh_prompt(tiny: OrtCausalLMEngine) -> None:
    base = _words(11, 40)
    cached, plain = _llm(tiny), _llm(tiny, 0.0)
    reply = cached.generate([base], GREEDY)[0][0]
    held = base + reply[:11]  # the row that left holds its prompt and the 11 reply tokens fed back
    prompts = [[*held, *_words(12, 5)], _words(13, 30)]
    assert cached.generate(prompts, GREEDY) == plain.generate(prompts, GREEDY)
    # the fresh prompt's 30 tokens set the step's width: the continuation computes its last 30 and takes the first 26
    # of the retained row's 51 (a slice of it), not the 48 its blocks hold
    queried, hit = _stats(cached)
    assert (queried - 40, hit) == (56 + 30, 26)


def test_eviction_under_a_tiny_budget_keeps_outputs_equal(tiny: OrtCausalLMEngine) -> None:
    d = tiny.dims
    block = 16 * d.num_layers * 2 * d.num_kv_heads * d.head_dim * 4
    budget_mb = 3 * block / 2**20  # three blocks
    system, users, end = _words(7, 30), [_words(20 + k, 6) for k in range(3)], [2]
    cached, plain = _llm(tiny, budget_mb), _llm(tiny, 0.0)
    assert _conversation(cached, system, users, end) == _conversation(plain, system, users, end)
    runner = cached.runner
    assert isinstance(runner, ModelRunner) and runner.prefix_cache is not None
    cache = runner.prefix_cache.cache
    # one chain never evicts itself: the conversation's history fills the budget and stops there
    assert (len(cache), cache.evicted_blocks, len(cache.match(system + users[0]))) == (3, 0, 2)
    other = _words(99, 36)  # two blocks, and its answer (11 fed tokens) fills no third
    assert cached.generate([other], GREEDY) == plain.generate([other], GREEDY)
    # another prompt's two blocks evict the two least recent: the conversation's last blocks, not its first
    assert (len(cache), cache.used_bytes, cache.evicted_blocks) == (3, 3 * block, 2)
    assert (len(cache.match(system)), len(cache.match(other))) == (1, 2)


def test_a_request_aborted_during_its_prefill_leaves_a_valid_prefix(tiny: OrtCausalLMEngine) -> None:
    prompt = _words(8, 37)
    cached, plain = _llm(tiny), _llm(tiny, 0.0)
    seq = cached.add_request(prompt, GREEDY)
    out = cached.scheduler.schedule()
    result = cached.runner.execute(out)  # the step computes while the client goes away
    assert cached.abort(seq)
    assert cached.scheduler.update(result) == []
    assert cached.generate([[*prompt, 5]], GREEDY) == plain.generate([[*prompt, 5]], GREEDY)
    assert _stats(cached) == (37 + 38, 37)  # the aborted row, retained whole: its 37 prompt tokens
    # a prompt the blocks hold whole reuses all but its last token: 31, part of the second block (no retained row
    # begins it: theirs are longer)
    assert cached.generate([prompt[:32]], GREEDY) == plain.generate([prompt[:32]], GREEDY)
    assert _stats(cached) == (37 + 38 + 32, 37 + 31)


def test_smollm2_conversation_matches_no_cache() -> None:
    from miaohui.generation.build.artifact import ChatTokenizer, read_info

    repo = ensure_llm_repository() / "smollm2"
    version = repo / str(latest_version(repo))
    chat = ChatTokenizer.from_dir(version, read_info(version))
    system = {"role": "system", "content": "You are a concise bank advisor."}
    turns = ["What is a fixed deposit?", "And its interest rate?", "Is it safe?"]
    with OrtCausalLMEngine(version) as engine:
        results = []
        for mb in (64.0, 0.0):
            llm, messages, replies = _llm(engine, mb, chat.tokenizer), [system], []
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                ids, text, _ = llm.generate(
                    [chat.encode_chat(messages)], SamplingParams(max_tokens=16, temperature=0.0)
                )[0]
                replies.append(ids)
                messages.append({"role": "assistant", "content": text})
            results.append((replies, llm))
    (with_cache, llm), (without, _) = results
    assert with_cache == without
    # each turn reuses the previous turn's retained row: its prompt + the 15 reply tokens fed back, 27 + 15 and 59 + 15
    assert _stats(llm) == (27 + 59 + 90, 42 + 74)


async def test_hit_tokens_reach_the_metrics(tiny: OrtCausalLMEngine) -> None:
    from miaohui.generation.engine.engine_loop import AsyncLLMEngine
    from miaohui.server.metrics import Metrics
    from miaohui.server.observer_metrics import MetricsObserver

    metrics = Metrics()
    prompt = _words(9, 40)
    async with AsyncLLMEngine(_llm(tiny), MetricsObserver(metrics, "t", 1)) as engine:
        for p in (prompt, [*prompt, 7]):
            async for _ in engine.generate(p, GREEDY):
                pass
    sample = metrics.registry.get_sample_value
    # the second prompt reuses the first's 40 tokens + 11 of its answer, in whole blocks: 48
    assert sample("miaohui_prefix_cache_queried_tokens_total", {"model": "t"}) == 40 + 41
    assert sample("miaohui_prefix_cache_hit_tokens_total", {"model": "t"}) == 32
