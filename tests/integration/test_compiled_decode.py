"""The compiled (``torch.compile``) decode step and prefill on the CPU: two engines of different dtypes in one
process both compile every decode bucket and give the eager step's logits; compiled prefill gives eager prefill's.

Regression: the compiled layer halves are shared by all engines of a process (Dynamo caches per code object);
an fp32 engine then a bf16 one passed Dynamo's default recompile limit and ``fullgraph=True`` made that a hard
``FailOnRecompileLimitHit`` (seen on the H200 in tests/gpu/test_slot_engine_gpu.py, reproduced here).
"""

from __future__ import annotations

import pytest
import torch
from tests.tiny_llm import tiny_qwen

from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.static_kv import StaticKVDecoder

pytestmark = pytest.mark.slow


_COMPILED = ("_attn_in", "_attn_out_mlp", "_attn_proj_mlp", "_final", "_decode_layer")


def _eager(fn_name: str, model: StaticKVDecoder, *args: object) -> torch.Tensor:
    """``model.<fn_name>(*args)`` with the compiled pieces taken off (the class's eager functions show through)."""
    compiled = {k: model.__dict__.pop(k) for k in _COMPILED if k in model.__dict__}
    try:
        return getattr(model, fn_name)(*args)  # type: ignore[no-any-return]
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
                    want = _eager("decode", model, tokens, positions, length)
                    assert got.shape == (b, hf.config.vocab_size)
                    err = float((got - want).norm() / want.norm())
                    assert err < tol, f"{name} batch {b} length {length}: relative logit error {err:.2e}"


def test_compiled_prefill_matches_eager_prefill() -> None:
    hf = tiny_qwen()
    opts = SlotEngineOptions(num_slots=8, max_len=256, dtype="fp32", compile=True, cuda_graphs=False)
    engine = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32), [999], 0, opts)
    engine.warmup()
    model = engine.model
    assert all(k in model.__dict__ for k in _COMPILED[:4])  # prefill runs the compiled pieces too
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for n, s in ((1, 16), (3, 40), (2, 7)):
            tokens = torch.randint(5, 1000, (n, s), generator=gen)
            lengths = torch.randint(1, s + 1, (n,), generator=gen)
            slots = torch.arange(n)
            got = model.prefill(tokens, lengths, slots)
            got_k = model.k_cache[0][:n, :, :s].clone()
            want = _eager("prefill", model, tokens, lengths, slots)
            err = float((got - want).norm() / want.norm())
            assert err < 1e-4, f"prefill {n}x{s}: relative logit error {err:.2e}"
            assert torch.allclose(got_k, model.k_cache[0][:n, :, :s], atol=1e-5)


@pytest.mark.parametrize("attention", ["matmul", "triton"])
def test_decode_layers_give_the_eager_matmul_logits_and_cache(attention: str) -> None:
    """The decode layer (the cache write inside the compiled layer) with each decode attention (triton: on the CPU its
    op's matmul form), compiled and eager, against the reference (the matmul attention, eager, in a second model): the
    same logits at every bucket, rows at different positions (the mask), a grouped-query model, and, after the steps,
    the same keys/values in every slot."""
    hf = tiny_qwen()
    opts = SlotEngineOptions(
        num_slots=8, max_len=256, dtype="fp32", compile=True, cuda_graphs=False, decode_attention=attention
    )
    engine = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32), [999], 0, opts)
    model = engine.model
    reference = StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32)
    assert model.decode_attention == attention and "_decode_layer" in model.__dict__ and model.groups > 1
    assert reference.decode_attention == "matmul" and reference._decode_layer is None
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        prompts = torch.randint(5, 1000, (8, 150), generator=gen)
        for m in (model, reference):
            m.prefill(prompts, torch.full((8,), 150), torch.arange(8))
        # largest first, as the engine captures its graphs: the first compile sees kv_len = max_len and
        # batch = num_slots (with the triton attention op that once broke the recompiles for the smaller buckets)
        for b in sorted(engine.batch_buckets, reverse=True):
            for length in sorted(engine.length_buckets, reverse=True):
                tokens = torch.randint(5, 1000, (b,), generator=gen)
                positions = torch.randint(0, min(length, 151), (b,), generator=gen)
                eager = _eager("decode", model, tokens, positions, length)  # also rewrites the same cache entries
                compiled = engine._decode_fn(tokens, positions, length)
                want = reference.decode(tokens, positions, length)
                for got, how in ((compiled, "compiled"), (eager, "eager")):
                    err = float((got - want).norm() / want.norm())
                    assert err < 1e-4, f"{attention} {how} batch {b} length {length}: relative logit error {err:.2e}"
    for i in range(len(reference.k_cache)):
        assert torch.allclose(model.k_cache[i], reference.k_cache[i], atol=1e-5), f"layer {i} keys"
        assert torch.allclose(model.v_cache[i], reference.v_cache[i], atol=1e-5), f"layer {i} values"


@pytest.mark.parametrize("kernel", ["inductor", "gemv_layer"])
def test_int8_steps_decode_with_the_int8_weights_and_the_others_without(kernel: str) -> None:
    """``int8_batch1``: a compiled one-row step reads the int8 copy and gives the logits of the same model whose GEMM
    weights and LM head are replaced by their int8 values × scale (so it really reads the int8 copy; ``gemv_layer``'s
    kernels through their custom ops' CPU paths here); a step of 2+ rows gives the unquantized model's logits."""
    from miaohui.generation.kernels.int8_weights import FusedGemvWeight, GluGemvWeight, RopeGemvWeight
    from miaohui.generation.kernels.w8_layer import unpair_halves
    from miaohui.generation.models.static_kv import _Layer

    hf = tiny_qwen()
    opts = SlotEngineOptions(
        num_slots=8, max_len=256, dtype="fp32", compile=True, cuda_graphs=False, int8_batch1=True, int8_kernel=kernel
    )
    engine = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32), [999], 0, opts)
    plain = StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32)
    dequant = StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32)
    q8 = engine.model._q8
    assert q8 is not None and engine.model._q8_head is not None
    assert all(w[0].dtype == torch.int8 for per_layer in q8 for w in per_layer.values())
    if kernel == "inductor":  # plain (int8, scale) tuples
        assert all(type(w) is tuple for lay in q8 for w in lay.values())
    else:  # QKV rows paired per head, gate/up interleaved, O and down and the head for the one-row GEMV
        assert all(isinstance(lay["qkv"], RopeGemvWeight) and isinstance(lay["gate_up"], GluGemvWeight) for lay in q8)
        assert all(isinstance(lay[n], FusedGemvWeight) for lay in q8 for n in ("o", "down"))
        assert isinstance(engine.model._q8_head, FusedGemvWeight)
    with torch.no_grad():
        for lay, per_layer in zip(dequant.layers, q8, strict=True):
            assert isinstance(lay, _Layer)
            for name, (q, s, *bias) in per_layer.items():
                w = q.float() * s[:, None]
                if isinstance(per_layer[name], RopeGemvWeight):
                    w = unpair_halves(w.T, dequant.dims.head_dim).T
                    if lay.qkv_bias is not None:  # the paired copy of the same bias
                        assert torch.equal(unpair_halves(bias[0], dequant.dims.head_dim), lay.qkv_bias)
                elif isinstance(per_layer[name], GluGemvWeight):
                    w = w.reshape(-1, 2, w.shape[1]).transpose(0, 1).reshape(w.shape)
                getattr(lay, name).copy_(w)
            if kernel == "gemv_layer":  # the norms' weights live in the int8 QKV and gate/up copies
                lay.in_norm.fill_(1.0)
                lay.post_norm.fill_(1.0)
        q, s = engine.model._q8_head
        dequant.head.copy_(q.float() * s[:, None])
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        prompts = torch.randint(5, 1000, (8, 120), generator=gen)
        engine.model.prefill(prompts, torch.full((8,), 120), torch.arange(8))
        for b in (1, 4, 1):
            ours = (*engine.model.k_cache, *engine.model.v_cache)
            for m in (plain, dequant):  # every step starts from the engine's cache (prefill and earlier steps)
                for mine, theirs in zip((*m.k_cache, *m.v_cache), ours, strict=True):
                    mine.copy_(theirs)
            tokens = torch.randint(5, 1000, (b,), generator=gen)
            positions = torch.full((b,), 121 if b == 4 else 120)
            got = engine._decode_fn(tokens, positions, 128)
            int8 = b == 1
            want_plain = plain.decode(tokens, positions, 128)
            want_int8 = dequant.decode(tokens, positions, 128)
            want = want_int8 if int8 else want_plain
            err = float((got - want).norm() / want.norm())
            assert err < 1e-4, f"{kernel} batch {b} int8={int8}: relative logit error {err:.2e}"
            # the int8 weights change the logits (else the test could not tell the paths apart)
            assert float((want_int8 - want_plain).norm() / want_plain.norm()) > 1e-4


def test_compiled_mixed_step_matches_the_eager_mixed_step() -> None:
    """The mixed step's layer (cache writes by row and position, attention by cache row) compiled by Inductor, as the
    GPU engine compiles it, against the same step eager: logits of the decode rows and the prompts' last tokens."""
    from miaohui.generation.models import mixed_step

    hf = tiny_qwen()
    opts = SlotEngineOptions(num_slots=8, max_len=256, dtype="fp32", compile=True, cuda_graphs=False,
                             mixed_prefill_tokens=(32, 64))  # fmt: skip
    engine = TorchSlotEngine(StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32), [999], 0, opts)
    model = engine.model
    assert model._mixed_layer is not None
    gen = torch.Generator().manual_seed(3)
    scratch = model.scratch_row
    # 4 decode rows (row 2 padding), then a 20-token and an 11-token prompt into slots 5 and 6, then 1 padding row
    tokens = torch.randint(5, 1000, (36,), generator=gen)
    positions = torch.cat((torch.tensor([40, 7, 0, 99]), torch.arange(20), torch.arange(11), torch.tensor([0])))
    rows = torch.cat(
        (torch.tensor([0, 1, scratch, 3]), torch.full((20,), 5), torch.full((11,), 6), torch.tensor([scratch]))
    )
    out_rows = torch.tensor([0, 1, 2, 3, 23, 34])
    with torch.inference_mode():
        for c in (*model.k_cache, *model.v_cache):
            c.normal_(generator=gen)
        saved = [c.clone() for c in (*model.k_cache, *model.v_cache)]
        got = mixed_step.mixed_forward(model, tokens, positions, rows, out_rows, 128, 4)
        got_cache = [c.clone() for c in (*model.k_cache, *model.v_cache)]
        for c, s in zip((*model.k_cache, *model.v_cache), saved, strict=True):
            c.copy_(s)
        compiled, model._mixed_layer = model._mixed_layer, None
        want = mixed_step.mixed_forward(model, tokens, positions, rows, out_rows, 128, 4)
        model._mixed_layer = compiled
    assert got.shape == (6, hf.config.vocab_size)
    # Both padding rows (decode row 2 and the last row) write the scratch row's position 0, and which write lands
    # is up to the kernel's threads, so the padding row's logits (out row 2) and the scratch row are not compared:
    # the engine discards both. Every slot's rows of the cache are.
    real = [0, 1, 3, 4, 5]
    err = float((got[real] - want[real]).norm() / want[real].norm())
    assert err < 1e-4, err
    for mine, theirs in zip(got_cache, (*model.k_cache, *model.v_cache), strict=True):
        assert torch.allclose(mine[:scratch], theirs[:scratch], rtol=1e-4, atol=1e-4)
