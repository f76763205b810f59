"""The compiled (``torch.compile``) decode step on the CPU: two engines of different dtypes in one process
both compile every decode bucket and give the eager step's logits.

Regression: the compiled layer halves are shared by all engines of a process (Dynamo caches per code object);
an fp32 engine then a bf16 one passed Dynamo's default recompile limit and ``fullgraph=True`` made that a hard
``FailOnRecompileLimitHit`` (seen on the H200 in tests/gpu/test_slot_engine_gpu.py, reproduced here).
"""

from __future__ import annotations

import pytest
import torch
from tests.tiny_llm import tiny_qwen

from miaohui.generation.slot_engine import TorchSlotEngine
from miaohui.generation.slot_options import SlotEngineOptions
from miaohui.generation.static_kv import StaticKVDecoder

pytestmark = pytest.mark.slow


def _eager_decode(model: StaticKVDecoder, *args: object) -> torch.Tensor:
    """The same step with the compiled halves taken off (the class's eager functions show through)."""
    compiled = {k: model.__dict__.pop(k) for k in ("_attn_in", "_attn_out_mlp", "_final")}
    try:
        return model.decode(*args)  # type: ignore[arg-type]
    finally:
        model.__dict__.update(compiled)


def test_fp32_then_bf16_engines_compile_every_bucket_and_match_eager() -> None:
    hf = tiny_qwen()
    for name, dtype, tol in (("fp32", torch.float32, 1e-4), ("bf16", torch.bfloat16, 2e-2)):
        opts = SlotEngineOptions(num_slots=8, max_len=256, dtype=name, compile=True, cuda_graphs=False)
        engine = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=dtype), [999], 0, opts)
        assert engine.compiled
        engine.warmup()
        model = engine.model
        gen = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            for b in engine.batch_buckets:
                for length in engine.length_buckets:
                    tokens = torch.randint(5, 1000, (b,), generator=gen)
                    positions = torch.randint(0, length, (b,), generator=gen)
                    got = engine._decode_fn(tokens, positions, length)  # compiled halves
                    want = _eager_decode(model, tokens, positions, length)
                    assert got.shape == (b, hf.config.vocab_size)
                    err = float((got - want).norm() / want.norm())
                    assert err < tol, f"{name} batch {b} length {length}: relative logit error {err:.2e}"
