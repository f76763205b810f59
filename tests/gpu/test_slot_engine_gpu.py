"""The static-KV decoder engine on CUDA: compiled + CUDA graphs gives the same tokens as eager, and runs
behind the scheduler with batches that grow and shrink (skipped without CUDA, like all of tests/gpu)."""

from __future__ import annotations

import pytest
import torch
from tests.tiny_llm import tiny_qwen

from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.static_kv import StaticKVDecoder

pytestmark = pytest.mark.gpu


def _engine(
    hf: torch.nn.Module,
    *,
    graphs: bool,
    attention: str | None = None,
    int8_batch1: bool = False,
    int8_kernel: str = "inductor",
) -> TorchSlotEngine:
    """A tiny-model engine; the attention defaults to the engine's own default (triton)."""
    chosen = {"decode_attention": attention} if attention is not None else {}
    opts = SlotEngineOptions(
        num_slots=8, max_len=256, dtype="fp32", compile=graphs, cuda_graphs=graphs, int8_batch1=int8_batch1,
        int8_kernel=int8_kernel, **chosen,
    )  # fmt: skip
    dec = StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32)
    engine = TorchSlotEngine(dec, [999], 0, opts)
    engine.warmup()
    return engine


def test_graphs_match_eager_tokens() -> None:
    """The engine's defaults (triton attention) in CUDA graphs against the same engine run eagerly."""
    hf = tiny_qwen("cuda")
    fast, slow = _engine(hf, graphs=True), _engine(hf, graphs=False)
    assert fast.graphs_on and len(fast._graphs) == len(fast.batch_buckets) * len(fast.length_buckets)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60))]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = LLMEngine(fast, None).generate(prompts, params)
    want = LLMEngine(slow, None).generate(prompts, params)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert all(len(g[0]) == 40 for g in got)


@pytest.mark.parametrize("attention", ["matmul", "triton"])
def test_decode_attentions_in_graphs_match_eager_matmul_tokens(attention: str) -> None:
    """Each decode attention (triton: miaohui's split-KV kernels; the tiny model's head size, 32, is one they take)
    in the compiled decode layer (cache write inside it, in place) in the CUDA graphs: the eager matmul engine's
    tokens, across a length bucket."""
    hf = tiny_qwen("cuda")
    fast = _engine(hf, graphs=True, attention=attention)
    slow = _engine(hf, graphs=False, attention="matmul")
    assert fast.graphs_on and fast.model.decode_attention == attention
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 160))]  # the last one crosses a length bucket
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = LLMEngine(fast, None).generate(prompts, params)
    want = LLMEngine(slow, None).generate(prompts, params)
    assert [g[0] for g in got] == [w[0] for w in want]


@pytest.mark.parametrize("kernel", ["inductor", "gemv_layer"])
def test_int8_graphs_match_the_eager_int8_engine(kernel: str) -> None:
    """``int8_batch1`` (the batch-1 graphs read the int8 copy: with ``inductor`` compiled with coordinate-descent
    tuning into Triton reductions over the int8 weights, with ``gemv_layer`` miaohui's one-row kernels) against the
    eager engine on the same int8 weights: one stream, then three. ``inductor``'s eager twin computes the
    dequantizing ``F.linear``, so the compiled reductions are checked against another computation; ``gemv_layer``
    folds the norms' weights into its own int8 copy, so its eager twin runs ``gemv_layer`` too (eager on CUDA: the
    same kernels outside graphs); the CPU test checks their arithmetic against the dequantized model,
    ``test_w8_layer_gpu.py`` the kernels against their torch form."""
    hf = tiny_qwen("cuda")
    fast = _engine(hf, graphs=True, int8_batch1=True, int8_kernel=kernel)
    slow = _engine(hf, graphs=False, int8_batch1=True, int8_kernel=kernel)
    assert fast.graphs_on and fast.model._q8 is not None
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompts in ([list(range(20, 60))], [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 160))]):
        got = LLMEngine(fast, None).generate(prompts, params)
        want = LLMEngine(slow, None).generate(prompts, params)
        assert [g[0] for g in got] == [w[0] for w in want]


def test_static_kv_matches_hf_logits_bf16() -> None:
    """bf16 weights + cache move the logits about as far from HF fp32 as HF's own bf16 model does (the CPU
    twin, eager, is tests/integration/test_static_engine.py::test_bf16_prefill_logits_are_as_close_to_fp32_as_hf_bf16)."""
    hf = tiny_qwen("cuda")
    engine = TorchSlotEngine(
        StaticKVDecoder.from_hf(hf, num_slots=4, max_len=256, dtype=torch.bfloat16),
        [999], 0, SlotEngineOptions(num_slots=4, max_len=256, dtype="bf16"),
    )  # fmt: skip
    engine.warmup()
    prompt = list(range(30, 90))
    row = torch.as_tensor(engine.prefill([2], [prompt]).rows([0])[0])
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu()
        hf_bf16 = tiny_qwen("cuda").to(torch.bfloat16)
        hf_bf16.load_state_dict(hf.state_dict())
        hf_err = float((hf_bf16(torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu() - ref).norm())
    err = float((row - ref).norm())
    # reported with both errors relative to the fp32 logits, so a failure says by how much (undiagnosed on the
    # H200 once: > 10 % there, 0.6 % on the CPU)
    assert err < 2 * hf_err, (
        f"relative logit error {err / float(ref.norm()):.4f}, HF bf16 {hf_err / float(ref.norm()):.4f}"
    )


def test_static_prefill_graphs_match_eager_tokens() -> None:
    """Prefill through CUDA graphs of padded (prompts, length) buckets gives the eager engine's tokens."""
    hf = tiny_qwen("cuda")
    opts = SlotEngineOptions(num_slots=8, max_len=256, dtype="fp32", static_prefill=True)
    fast = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32), [999], 0, opts)
    fast.warmup()
    assert len(fast._prefill_graphs) == len(fast.prefill_batches) * len(fast.prefill_lengths)
    slow = _engine(hf, graphs=False)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60))]  # 3 prompts: the 4-prompt graph, one pad row
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = LLMEngine(fast, None).generate(prompts, params)
    want = LLMEngine(slow, None).generate(prompts, params)
    assert [g[0] for g in got] == [w[0] for w in want]


async def test_async_scheduling_on_the_gpu_matches_the_eager_synchronous_engine() -> None:
    """Async scheduling on the GPU: step N+1 launched before step N is read, its tokens the graphs' own picks (static
    prefill graphs too), 12 requests through 8 slots (slots reused while a step is in flight), one sampled request
    (the loop falls back to collect-then-schedule while it runs). Greedy tokens = the eager synchronous engine's."""
    from miaohui.generation.engine.engine_loop import AsyncLLMEngine
    from miaohui.generation.engine.scheduler import SchedulerConfig

    hf = tiny_qwen("cuda")
    opts = SlotEngineOptions(num_slots=8, max_len=256, dtype="fp32", static_prefill=True)
    fast = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32), [999], 0, opts)
    fast.warmup()
    slow = _engine(hf, graphs=False)
    prompts = [[5 + i, 6, 7, 8 + i] * (1 + i % 3) for i in range(12)]
    lengths = [10 + 7 * (i % 4) for i in range(12)]
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    want = [LLMEngine(slow, None).generate([p], sp)[0][0] for p, sp in zip(prompts, greedy, strict=True)]
    llm = LLMEngine(fast, None, SchedulerConfig(max_running_seqs=8, max_batched_tokens=512, max_model_len=256))
    async with AsyncLLMEngine(llm, async_scheduling=True) as loop:
        sampled = loop.add([3, 4, 5], SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True))
        streams = [loop.add(p, sp) for p, sp in zip(prompts, greedy, strict=True)]
        got = [[e.token_id async for e in st if e.token_id is not None] for st in streams]
        assert len([e async for e in sampled if e.token_id is not None]) == 12
    assert got == want


async def test_mixed_step_graphs_match_the_eager_engine() -> None:
    """Mixed steps in CUDA graphs (decode rows + prompt tokens in one pass; cache writes and the triton attention by
    cache row) under async scheduling, requests of different lengths admitted two per step through 8 slots: the
    eager synchronous engine's greedy tokens; most prompts ran mixed."""
    from miaohui.generation.engine.engine_loop import AsyncLLMEngine
    from miaohui.generation.engine.scheduler import SchedulerConfig

    hf = tiny_qwen("cuda")
    opts = SlotEngineOptions(num_slots=8, max_len=256, dtype="fp32", static_prefill=True,
                             mixed_prefill_tokens=(32, 64), mixed_prefill_prompts=2)  # fmt: skip
    fast = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32), [999], 0, opts)
    fast.warmup()
    assert len(fast._mixed_graphs) == len(fast.batch_buckets) * len(fast.mixed_lengths) * 2
    slow = _engine(hf, graphs=False)
    prompts = [[5 + i, 6, 7, 8 + i] * (1 + i % 4) for i in range(16)]
    lengths = [10 + 7 * (i % 4) for i in range(16)]
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    want = [LLMEngine(slow, None).generate([p], sp)[0][0] for p, sp in zip(prompts, greedy, strict=True)]
    sched = SchedulerConfig(max_running_seqs=8, max_batched_tokens=512, max_model_len=256, max_prefill_seqs=2)
    async with AsyncLLMEngine(LLMEngine(fast, None, sched), async_scheduling=True) as loop:
        streams = [loop.add(p, sp) for p, sp in zip(prompts, greedy, strict=True)]
        got = [[e.token_id async for e in st if e.token_id is not None] for st in streams]
    assert got == want
    assert fast.mixed_steps >= 4, fast.mixed_steps


def test_prefix_hit_graphs_match_the_engine_without_a_cache() -> None:
    """A conversation whose turns reuse their history from the prefix cache: the rests run through the prefix-hit
    CUDA graphs (the whole slot attended, padding rows repeating the first) and give the greedy tokens of the same
    graphs engine without a prefix cache, turn after turn; two conversations at once take a two-prompt graph. A turn
    finds its history in the slots the turn before left, or, after other requests took those slots, copies it from
    the pool (the block-copy kernel)."""
    from miaohui.generation.engine.scheduler import SchedulerConfig

    hf = tiny_qwen("cuda")
    opts = SlotEngineOptions(num_slots=8, max_len=256, dtype="fp32", static_prefill=True, prefix_graphs=True,
                             mixed_prefill_tokens=())  # fmt: skip
    fast = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32), [999], 0, opts)
    fast.warmup()
    assert sorted(fast._prefix_graphs) == [(n, s) for n in fast.prefill_batches for s in fast.prefill_lengths]
    sched = {"max_model_len": 256, "max_batched_tokens": 512}
    cached = LLMEngine(fast, None, SchedulerConfig(prefix_cache_mb=4.0, **sched))
    plain = LLMEngine(fast, None, SchedulerConfig(prefix_cache_mb=0.0, **sched))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    talks = [[3, 4, 5] * 12, [40, 41, 42, 43] * 9]
    for turn in range(4):
        got = [g[0] for g in cached.generate(talks, params)]
        want = [w[0] for w in plain.generate(talks, params)]
        assert got == want, f"turn {turn}"
        talks = [t + a + [7 + turn, 8, 9 + turn] for t, a in zip(talks, got, strict=True)]
        if turn % 2:  # other requests take the slots the conversations left: the next turn copies from the pool
            cached.generate([[60 + turn] * 20, [70 + turn] * 20], params)
    assert fast.prefix_graph_steps >= 2, fast.prefix_graph_steps
    stats = cached.runner.prefix_cache.stats
    assert 0 < stats.kept_tokens < stats.hit_tokens, stats
