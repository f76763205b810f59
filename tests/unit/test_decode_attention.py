"""miaohui's split-KV decode attention (``miaohui.generation.kernels.decode_attention``): under Triton's interpreter against
the matmul form (the ``matmul`` decode path's arithmetic) for GQA groups of 1/3/6/8, head sizes 32–128, cache views
sliced out of a bigger cache, positions from 0 to the last slot, batch 1 to 6 (one to many slices per row); compiled
for the H200 (compute capability 9.0) on the CPU, as the GPU would compile them; the op's CPU path; the slicing plan.
The prefix-hit kernel (``miaohui.generation.kernels.prefix_attention``, blocks of tokens over their slot) likewise,
against SDPA with a mask. The interpreter must be on before Triton is imported, so that check runs in a child process."""

from __future__ import annotations

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.generation.kernels import decode_attention as da
from miaohui.generation.kernels.decode_attention import (
    BLOCK_T,
    BLOCK_T_BATCHED,
    TARGET_PROGRAMS,
    decode_attention_op,
    plan,
)
from miaohui.generation.kernels.decode_attention import matmul_decode_attention as reference

CHECK = """
import torch
from miaohui.generation.kernels.decode_attention import matmul_decode_attention, triton_decode_attention

torch.manual_seed(0)
cases = [  # b, H, KVH, D, T (attended bucket), cache slots / max_len (a view of a bigger cache), dtype, target
    (1, 12, 2, 128, 160, (2, 192), torch.float32, 264),  # the 1.5B model's heads at batch 1: 5 slices of 32
    (3, 9, 3, 64, 96, (3, 96), torch.float32, 264),  # SmolLM2's heads, ragged bucket (96 = 3 blocks)
    (6, 4, 4, 32, 64, (8, 128), torch.float32, 8),  # no grouping, one slice per row (few target programs)
    (2, 8, 1, 64, 72, (2, 96), torch.float16, 264),  # one KV head for 8 queries, fp16, bucket not a block multiple
]
for b, h, kvh, d, t, (slots, max_len), dtype, target in cases:
    kc = torch.randn(slots, kvh, max_len, d).to(dtype)
    vc = torch.randn(slots, kvh, max_len, d).to(dtype)
    keys, values = kc[:b, :, :t], vc[:b, :, :t]
    q = torch.randn(b, h, d).to(dtype)
    positions = torch.randint(0, t, (b,))
    positions[0] = 0  # one row sees one position
    positions[-1] = t - 1  # one row sees the whole bucket
    got = triton_decode_attention(q, keys, values, positions, target=target)
    want = matmul_decode_attention(q.float(), keys.float(), values.float(), positions)
    assert got.dtype == dtype and got.shape == (b, h, d), (got.dtype, got.shape)
    err = float((got.float() - want).abs().max())
    assert err < (1e-4 if dtype == torch.float32 else 5e-3), (b, h, kvh, d, t, dtype, err)
# cache_rows: each row attends in a named cache row (mixed steps: decode rows in their slot, idle rows in a scratch row)
kc, vc = torch.randn(5, 2, 64, 64), torch.randn(5, 2, 64, 64)
rows = torch.tensor([3, 0, 3, 3, 4, 1])
positions = torch.tensor([40, 63, 0, 1, 0, 32])
q = torch.randn(6, 12, 64)
got = triton_decode_attention(q, kc, vc, positions, rows)
want = matmul_decode_attention(q, kc[rows], vc[rows], positions)
assert float((got - want).abs().max()) < 1e-4
print("ok", len(cases) + 1)
"""


def test_kernels_match_the_matmul_attention_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok 5"


PREFIX_CHECK = """
import torch
from miaohui.generation.kernels.prefix_attention import tokens_per_program
from miaohui.generation.models.static_kv_layers import prefix_attention

torch.manual_seed(0)
# a prefix hit's rests (the GPU form: blocks of tokens per program) against SDPA over the slots with a mask: one token
# per program (an odd rest), 4 (no GQA), 8 tokens of 6 query heads over two prompts, 16 tokens of 3 heads
cases = [
    (1, 5, 12, 2, 64, [37], [2]),
    (3, 4, 4, 4, 32, [0, 16, 9], [0, 3, 1]),
    (2, 16, 12, 2, 64, [40, 3], [4, 1]),
    (1, 16, 9, 3, 64, [47], [0]),
]
for n, s, heads, kvh, d, starts, slots in cases:
    kc, vc = torch.randn(5, kvh, 64, d), torch.randn(5, kvh, 64, d)
    q = torch.randn(n, s, heads, d)
    positions = torch.tensor(starts)[:, None] + torch.arange(s)[None, :]
    rows = torch.tensor(slots)[:, None].expand(n, s).contiguous()
    kv_len = int(positions.max()) + 1
    got = prefix_attention(q, kc, vc, rows, positions, kv_len, kernel=True)
    want = prefix_attention(q, kc, vc, rows, positions, kv_len, kernel=False)
    assert got.shape == want.shape == (n, heads, s, d), (got.shape, want.shape)
    assert float((got - want).abs().max()) < 1e-4, float((got - want).abs().max())
assert [tokens_per_program(heads // kvh, s) for _, s, heads, kvh, *_ in cases] == [1, 4, 8, 16]
# slices over a whole 256-position slot, 64 each: the rests end in the second slice, the last two stop at once and
# leave their weighted values unwritten (NaN here: every float32 buffer starts as NaN), which the merge must not read
from miaohui.generation.kernels.prefix_attention import triton_prefix_attention
_empty = torch.empty
def nan_empty(*args, **kwargs):
    t = _empty(*args, **kwargs)
    return t.fill_(float("nan")) if t.dtype == torch.float32 else t
torch.empty = nan_empty
kc, vc = torch.randn(3, 2, 256, 64), torch.randn(3, 2, 256, 64)
q = torch.randn(2, 16, 12, 64)
positions = torch.tensor([[60], [100]]) + torch.arange(16)[None, :]
rows = torch.tensor([[2], [0]]).expand(2, 16).contiguous()
want = prefix_attention(q, kc, vc, rows, positions, 116, kernel=False)
for rows_per_program in (64, 128):  # 8 or 16 tokens of 6 query heads per program
    got = triton_prefix_attention(q, kc, vc, positions, rows, chunk=64, rows_per_program=rows_per_program, stages=2)
    got = got.view(2, 16, 12, 64).transpose(1, 2)
    assert float((got - want).abs().max()) < 1e-4, float((got - want).abs().max())
print("ok")
"""


def test_prefix_attention_kernel_form_matches_sdpa_under_the_interpreter() -> None:
    assert run_interpreted(PREFIX_CHECK) == "ok"


def test_prefix_kernel_compiles_for_the_h200() -> None:
    """The prefix-hit kernel down to a cubin for compute capability 9.0 (the 1.5B shape: 8 tokens of 6 query heads)."""
    from miaohui.generation.kernels import prefix_attention as pa

    kernel = compile_for_h200(
        pa._prefix_partial_kernel,
        ["*bf16", "*bf16", "*bf16", "*i64", "*i64", "*fp32", "*fp32", "*fp32", *["i32"] * 8, "fp32"],
        {"KVH": 2, "GROUP": 6, "G_PAD": 16, "TOK": 8, "R_PAD": 64, "D": 128, "CHUNK": 512, "SPLITS": 8,
         "BLOCK": pa.BLOCK, "PRECISION": "tf32"},
    )  # fmt: skip
    assert "ld.global.v4" in kernel.asm["ptx"]


@pytest.mark.parametrize(
    ("dtype", "block", "indirect"),
    [("bf16", BLOCK_T, False), ("bf16", BLOCK_T_BATCHED, True), ("fp32", 32, False)],
)
def test_kernels_compile_for_the_h200(dtype: str, block: int, indirect: bool) -> None:
    """Triton's whole pipeline down to a cubin for compute capability 9.0, on the CPU: a kernel that only the
    interpreter has run can still fail to compile for the GPU. bf16 at one row and batched with cache rows, and fp32
    (IEEE dots); fp16 compiles as bf16 does."""

    ptr, dims = f"*{dtype}", {"KVH": 2, "GROUP": 6, "G_PAD": 16, "D": 128}
    partial = compile_for_h200(
        da._partial_kernel,
        [ptr, ptr, ptr, "*i64", "*i64", "*fp32", "*fp32", "*fp32", *["i32"] * 8, "fp32"],
        {
            **dims,
            "CHUNK": 2 * block,
            "SPLITS": 8,
            "BLOCK": block,
            "PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "INDIRECT": indirect,
        },
    )
    merge = compile_for_h200(da._merge_kernel, ["*fp32", "*fp32", "*fp32", ptr, "i32", "i32"],
                             {**dims, "SPLITS": 8, "S_PAD": 8})  # fmt: skip
    assert merge
    loads = partial.asm["ptx"]
    # the cache is read 16 bytes per thread per load (fp32: 4 values), never one 2-byte value at a time
    assert "ld.global.v4.b32" in loads and "ld.global.b16" not in loads


def test_the_op_runs_the_matmul_form_on_the_cpu() -> None:
    torch.manual_seed(1)
    kc, vc = torch.randn(4, 2, 64, 32), torch.randn(4, 2, 64, 32)
    q, positions = torch.randn(3, 6, 32), torch.tensor([0, 17, 63])
    got = decode_attention_op(q, kc[:3], vc[:3], positions)
    # row 0 sees only position 0: its output is that position's value for every head of the group
    assert torch.allclose(got[0], vc[0, :, 0].repeat_interleave(3, dim=0), atol=1e-6)
    assert torch.allclose(got, reference(q, kc[:3], vc[:3], positions), atol=1e-6)
    rows = torch.tensor([2, 2, 0])
    by_row = da.decode_attention(q, kc, vc, positions, rows)
    assert torch.allclose(by_row, reference(q, kc[rows], vc[rows], positions), atol=1e-6)
    assert not torch.allclose(by_row[:2], got[:2], atol=1e-3)  # rows 0 and 1 read slot 2 here, not slots 0 and 1


def test_the_plan_fills_the_gpu_with_slices_of_whole_blocks() -> None:
    assert plan(1, 2, 512) == (32, 16)  # batch 1: one block per slice, 32 programs
    chunk, splits = plan(64, 2, 512)  # batch 64: 128 (row, head) pairs, ~2 slices each
    assert chunk % BLOCK_T == 0 and splits * chunk >= 512 and 64 * 2 * splits >= TARGET_PROGRAMS
    assert plan(256, 2, 512) == (512, 1)  # enough rows: one slice each
    assert plan(1, 1, 20) == (32, 1)  # shorter than a block
