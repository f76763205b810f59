"""A prefix-cache hit's copy on the GPU: cached token blocks from the prefix pool into a slot of every layer's static KV
cache, as one Triton kernel launch instead of a gather and one copy per layer; and the other way, a slot's new blocks
into the pool (a store), instead of a slice per layer, a stack and an index copy. Keys and values go in the same
launch: the table lists the keys' layers then the values', and the pool holds them in that order.

The pool (:class:`~miaohui.generation.cache.slot_prefix.SlotPrefixKV`) is one contiguous
``[2 × layers, pool_blocks, kv_heads, block, head_dim]`` tensor; each layer's cache is its own
``[slots, kv_heads, max_len, head_dim]`` tensor, reached through a table of their addresses (``int64 [2 × layers]``,
made once: the caches are allocated once and never move). One program copies one block of one KV head of one layer,
``block * head_dim`` contiguous elements on both sides. On an H100, for a 2,000-token prefix of a 28-layer model:
0.25 ms (then a launch each for keys and values) against 1.41 ms for the gather and the multi-tensor copy and 3.03 ms
layer by layer (``lab/probes/slot_prefix_copy.py``, ``lab/results/slot_prefix_copy_h100.json``), most of the
difference being the host's time to issue the copies. Checked on the CPU under Triton's interpreter
(``tests/unit/test_block_copy.py``).
"""

from __future__ import annotations

import torch

try:  # Triton comes with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

if triton is not None:

    @triton.jit
    def _copy_blocks(
        table_ptr,  # int64 [layers]: each layer's cache tensor's address
        pool_ptr,  # [layers, pool_blocks, kv_heads, block, head_dim], contiguous
        idx_ptr,  # int64 [used]: the pool blocks, in the slot's block order
        slot_offset,  # elements from a layer cache's start to (slot, head 0, first position)
        stride_head,  # elements between a layer cache's heads
        pool_blocks,
        KV_HEADS: tl.constexpr,
        CHUNK: tl.constexpr,  # block * head_dim: a block of one head is contiguous in the pool and in the slot
        DTYPE: tl.constexpr,
        TO_SLOT: tl.constexpr,  # pool → slot (a hit's load), else slot → pool (a store)
    ) -> None:
        layer, j, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        block = tl.load(idx_ptr + j)
        base = tl.load(table_ptr + layer).to(tl.pointer_type(DTYPE))
        offs = tl.arange(0, CHUNK)
        pool = pool_ptr + ((layer * pool_blocks + block) * KV_HEADS + head) * CHUNK + offs
        slot = base + slot_offset + head * stride_head + j * CHUNK + offs
        if TO_SLOT:
            tl.store(slot, tl.load(pool))
        else:
            tl.store(pool, tl.load(slot))


def supported(caches: list[torch.Tensor], block_size: int) -> bool:
    """Whether the kernel takes these caches: Triton present, contiguous caches of one 16/32-bit dtype on one device,
    and ``block_size * head_dim`` a power of two (``tl.arange``)."""
    first = caches[0]
    chunk = block_size * first.shape[-1]
    return (
        triton is not None
        and first.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and chunk & (chunk - 1) == 0
        and all(c.is_contiguous() and c.dtype == first.dtype and c.shape == first.shape for c in caches)
    )


def address_table(caches: list[torch.Tensor]) -> torch.Tensor:
    """The caches' addresses, ``int64 [layers]`` on their device (the kernel's ``table_ptr``)."""
    return torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=caches[0].device)


def copy_blocks(
    table: torch.Tensor,
    first: torch.Tensor,
    pool: torch.Tensor,
    blocks: torch.Tensor,
    slot: int,
    *,
    to_slot: bool,
    start_block: int = 0,
) -> None:
    """Copy between pool blocks ``blocks`` (int64 [used]) of every layer and ``slot``'s positions from
    ``start_block * block`` on, of the caches ``table`` addresses (``first``: one of them, for shape and strides):
    ``to_slot`` pool → slot (a hit's load), else slot → pool (a store)."""
    if triton is None:
        raise RuntimeError("copy_blocks needs Triton (it comes with CUDA builds of torch)")
    layers, pool_blocks, kv_heads, block, head_dim = pool.shape
    dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[first.dtype]
    offset = slot * first.stride(0) + start_block * block * first.stride(2)
    _copy_blocks[(layers, blocks.shape[0], kv_heads)](
        table, pool, blocks, offset, first.stride(1), pool_blocks,
        KV_HEADS=kv_heads, CHUNK=block * head_dim, DTYPE=dtype, TO_SLOT=to_slot,
    )  # fmt: skip
