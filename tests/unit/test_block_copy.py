"""A prefix hit's copy and a store as one Triton kernel each (``miaohui.generation.kernels.block_copy``, the GPU forms
of ``SlotPrefixKV.copy_in`` and ``store``, keys and values in one launch): under Triton's interpreter a store leaves the pool as the stack form does
(from the slot's first block and from a later one), and a load leaves the slot exactly as the gather form does, both
what the cached tokens' KV was (from the first block, and from a later one where the slot holds those before); compiled for the H200 (compute capability 9.0) on the CPU. The interpreter must be
on before Triton is imported, so that check runs in a child process."""

from __future__ import annotations

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.generation.kernels import block_copy

CHECK = """
import torch
from miaohui.generation.cache.slot_prefix import SlotPrefixKV
from miaohui.generation.kernels.block_copy import address_table

torch.manual_seed(0)
layers, slots, kvh, max_len, d, block = 3, 4, 2, 64, 8, 4
keys = [torch.randn(slots, kvh, max_len, d) for _ in range(layers)]
values = [torch.randn(slots, kvh, max_len, d) for _ in range(layers)]
gather = SlotPrefixKV(keys, values, block, 1 << 20)  # the reference forms (no address tables: a CPU's)
kernel = SlotPrefixKV(keys, values, block, 1 << 20)
kernel._table = address_table(keys + values)  # what a GPU's SlotPrefixKV makes
prompt = list(range(100, 130))  # 30 tokens: 7 full blocks, slot 2 holds them
other = list(range(500, 540))  # another chain, in slot 1
for cache in (gather, kernel):  # stores: 4 blocks, then the 3 after them (from block 4 of the slot), then another
    assert cache.store(prompt[:17], 2) == 4 and cache.store(prompt, 2) == 3 and cache.store(other, 1) == 10
for pool in ("pool_k", "pool_v"):
    used = torch.tensor([b.payload.index for b in kernel.cache.match(prompt) + kernel.cache.match(other)])
    assert torch.equal(getattr(kernel, pool)[:, used], getattr(gather, pool)[:, used]), pool
want_k = [k[2, :, :28].clone() for k in keys]
want_v = [v[2, :, :28].clone() for v in values]
idx = kernel._indices([b.payload.index for b in kernel.cache.match(prompt)[:7]])
before = [t[3].clone() for t in (*keys, *values)]
for form in (False, True):
    for t, b in zip((*keys, *values), before):
        t[3].copy_(b)
    kernel.copy_in(idx, 3, kernel=form)
    for t, w in zip((*keys, *values), (*want_k, *want_v)):
        assert torch.equal(t[3, :, :28], w), form
    for t, b in zip((*keys, *values), before):
        assert torch.equal(t[3, :, 28:], b[:, 28:]), form  # nothing past the blocks
    # a slot that already holds the first two blocks: only the others are copied, to their places
    for t, b in zip((*keys, *values), before):
        t[3].copy_(b)
    kernel.copy_in(idx[2:], 3, kernel=form, start_block=2)
    for t, w, b in zip((*keys, *values), (*want_k, *want_v), before):
        assert torch.equal(t[3, :, 8:28], w[:, 8:]) and torch.equal(t[3, :, :8], b[:, :8]), form
        assert torch.equal(t[3, :, 28:], b[:, 28:]), form
print("ok")
"""


def test_kernel_copy_matches_the_gather_copy_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok"


@pytest.mark.skipif(block_copy.triton is None, reason="Triton is not installed (it comes with CUDA builds of torch)")
@pytest.mark.parametrize("to_slot", [True, False])
def test_kernel_compiles_for_the_h200(to_slot: bool) -> None:
    compile_for_h200(
        block_copy._copy_blocks,
        ["*i64", "*bf16", "*i64", "i32", "i32", "i32"],
        {"KV_HEADS": 2, "CHUNK": 2048, "DTYPE": block_copy.tl.bfloat16, "TO_SLOT": to_slot},
    )


def test_supported_needs_a_power_of_two_chunk() -> None:
    caches = [torch.zeros(2, 2, 8, 6) for _ in range(2)]
    assert not block_copy.supported(caches, 4)  # 24 elements per block and head
    assert block_copy.supported([torch.zeros(2, 2, 8, 8) for _ in range(2)], 4) == (block_copy.triton is not None)
