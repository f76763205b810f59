"""An int4 decoder's one-stream decode steps write the key/value cache in place
(:mod:`miaohui.generation.executors.ort_in_place`): the same logits and tokens as the copying path, and no cache a
step returned ever changes.

A tiny random Llama (2 layers × 64, SmolLM2's tokenizer) built as int4, served twice: as the engine runs it, and with
its in-place path off (every step through ``session.run``, the kernel copying the past into a fresh present).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from tests.tiny_decoders import save_tiny_decoder, smollm_tokenizer

from miaohui.generation.build.artifact import build_causal_lm
from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.executors.base import KVCache
from miaohui.generation.executors.ort_engine import OrtCausalLMEngine
from miaohui.generation.executors.ort_in_place import HEADROOM

TOLERANCE = 1e-4
PROMPT = [1, 17, 230, 4521, 88, 9]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[OrtCausalLMEngine, OrtCausalLMEngine]]:
    """(in place, copying) engines of one tiny int4 Llama version."""
    root = tmp_path_factory.mktemp("in-place")
    source = save_tiny_decoder("llama", root / "Tiny-llama", smollm_tokenizer())
    version = build_causal_lm(root / "repo", "llama", "int4", source=source)
    in_place, copying = OrtCausalLMEngine(version, threads=2), OrtCausalLMEngine(version, threads=2)
    assert in_place._in_place is not None  # a fused one-row graph
    copying._in_place = None
    with in_place, copying:
        yield in_place, copying


def _close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)


def _same_cache(a: KVCache, b: KVCache) -> None:
    assert (a.length, a.batch) == (b.length, b.batch) and np.array_equal(a.mask, b.mask)
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        _close(x, y)


def test_steps_match_the_copying_path_across_a_buffer_growth(
    engines: tuple[OrtCausalLMEngine, OrtCausalLMEngine],
) -> None:
    """A prefill and enough greedy steps to outgrow the first buffer: logits and caches within 1e-4 (the same
    kernel: in practice bit for bit), and the buffer copied into a longer one once the row filled it."""
    fast, slow = engines
    (a, kv_a), (b, kv_b) = fast.prefill([PROMPT]), slow.prefill([PROMPT])
    capacities = set()
    for _ in range(HEADROOM + 20):
        token = int(b[0].argmax())
        (a, kv_a), (b, kv_b) = fast.decode([token], kv_a), slow.decode([token], kv_b)
        _close(a, b)
        assert fast._in_place is not None
        capacities.add(fast._in_place.capacity)
    _same_cache(kv_a, kv_b)
    assert len(capacities) == 2 and min(capacities) > len(PROMPT) + 1  # one growth


def test_a_returned_cache_never_changes_and_can_be_decoded_again(
    engines: tuple[OrtCausalLMEngine, OrtCausalLMEngine],
) -> None:
    """Steps after a cache was returned write past its end only; decoding that older cache again (a branch) copies it
    into new buffers and gives the copying path's logits, and so does going on from the newer one."""
    fast, slow = engines
    (_, kv), (_, kv_ref) = fast.prefill([PROMPT]), slow.prefill([PROMPT])
    (_, kv), (_, kv_ref) = fast.decode([5], kv), slow.decode([5], kv_ref)
    saved = [x.copy() for x in kv.keys + kv.values]
    (_, newer), (_, newer_ref) = fast.decode([6], kv), slow.decode([6], kv_ref)
    (_, newer), (_, newer_ref) = fast.decode([7], newer), slow.decode([7], newer_ref)
    assert all(np.array_equal(x, y) for x, y in zip(kv.keys + kv.values, saved, strict=True))
    (a, branch), (b, branch_ref) = fast.decode([8], kv), slow.decode([8], kv_ref)  # the older cache again
    _close(a, b)
    _same_cache(branch, branch_ref)
    (a, _), (b, _) = fast.decode([9], newer), slow.decode([9], newer_ref)  # and the newer one
    _close(a, b)


def test_a_one_token_prompt_and_a_cached_prefix_run_in_place(
    engines: tuple[OrtCausalLMEngine, OrtCausalLMEngine],
) -> None:
    """A one-token prefill runs the one-row graph too: alone (an empty past) and after a prefix (the prefix cache's
    last token left to compute)."""
    fast, slow = engines
    (a, kv_a), (b, kv_b) = fast.prefill([[42]]), slow.prefill([[42]])
    _close(a, b)
    _same_cache(kv_a, kv_b)
    (_, prefix), (_, prefix_ref) = fast.prefill([PROMPT[:-1]]), slow.prefill([PROMPT[:-1]])
    (a, kv_a), (b, kv_b) = fast.prefill([PROMPT[-1:]], prefix), slow.prefill([PROMPT[-1:]], prefix_ref)
    _close(a, b)
    _same_cache(kv_a, kv_b)


def test_generation_through_the_runner_gives_the_same_tokens(
    engines: tuple[OrtCausalLMEngine, OrtCausalLMEngine],
) -> None:
    """The model runner's mix: batches with padding (rows that leave, a lone padded row), single streams, and next
    turns that reuse the last one's cache from the prefix cache (the first computes one token on the retained row's
    own arrays, in place): the same greedy tokens either way."""
    fast, slow = engines
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [PROMPT, [3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    results = []
    for engine in (fast, slow):
        llm = LLMEngine(engine, None)
        batch = [r[0] for r in llm.generate(prompts, params)]
        first = llm.generate([PROMPT], params)[0][0]
        turn = llm.generate([PROMPT + first], params)[0][0]
        again = llm.generate([PROMPT + first + turn + [13, 14]], params)[0][0]
        results.append((batch, first, turn, again))
    assert results[0] == results[1]
