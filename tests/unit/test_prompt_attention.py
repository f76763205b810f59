"""The packed-prompt attention of mixed steps (``miaohui.generation.prompt_attention``): under Triton's interpreter
against the matmul form and against the decode kernel reading the same keys from a cache (what mixed steps did
before); compiled for the H200 on the CPU; the op's CPU path and the mixed step's attention op. The interpreter must
be on before Triton is imported, so that check runs in a child process."""

from __future__ import annotations

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.generation import prompt_attention as pa
from miaohui.generation.decode_attention import matmul_decode_attention
from miaohui.generation.mixed_step import mixed_attention_op

CHECK = """
import torch
from miaohui.generation.decode_attention import matmul_decode_attention
from miaohui.generation.prompt_attention import matmul_prompt_attention, triton_prompt_attention

torch.manual_seed(0)
cases = [  # prompt lengths (then padding rows up to the bucket), bucket, H, KVH, D, dtype, block_m
    ((20, 11), 36, 12, 2, 128, torch.float32, 32),   # the 1.5B heads; prompts cross row blocks
    ((128,), 128, 12, 2, 64, torch.float32, 32),     # one whole prompt, no padding
    ((5, 40, 1, 70), 128, 9, 3, 64, torch.float16, 16),  # four prompts, a 1-token one, fp16
    ((33,), 64, 8, 8, 32, torch.float32, 64),        # no grouping, a block wider than the prompt's rows
]
for lengths, bucket, h, kvh, d, dtype, block in cases:
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(bucket - sum(lengths), dtype=torch.long)])
    q, k, v = torch.randn(bucket, h, d).to(dtype), torch.randn(bucket, kvh, d).to(dtype), torch.randn(bucket, kvh, d).to(dtype)
    got = triton_prompt_attention(q, k, v, positions, block_m=block)
    want = matmul_prompt_attention(q.float(), k.float(), v.float(), positions)
    assert got.dtype == dtype and got.shape == (bucket, h, d), (got.dtype, got.shape)
    err = float((got.float() - want).abs().max())
    assert err < (1e-4 if dtype == torch.float32 else 5e-3), (lengths, dtype, err)
    # the same rows through the cache, as session 20's mixed step attended: each prompt's keys in its own slot
    slots = len(lengths) + 1
    kc, vc = torch.zeros(slots, kvh, bucket, d), torch.zeros(slots, kvh, bucket, d)
    rows, at = torch.full((bucket,), slots - 1), 0
    for i, n in enumerate(lengths):
        rows[at : at + n] = i
        at += n
    kc[rows, :, positions], vc[rows, :, positions] = k.float(), v.float()
    by_cache = matmul_decode_attention(q.float(), kc, vc, positions, rows)
    real = slice(0, sum(lengths))  # padding rows share a scratch slot in the cache, not in the packed form
    assert float((got[real].float() - by_cache[real]).abs().max()) < (1e-4 if dtype == torch.float32 else 5e-3)
# written into a given output view: the rows past the view stay as they were
out = torch.full((40, 12, 128), 7.0)
q, k, v = torch.randn(36, 12, 128), torch.randn(36, 2, 128), torch.randn(36, 2, 128)
positions = torch.cat((torch.arange(30), torch.arange(6)))
triton_prompt_attention(q, k, v, positions, out[4:])
assert float((out[4:] - matmul_prompt_attention(q, k, v, positions)).abs().max()) < 1e-4
assert bool((out[:4] == 7.0).all())
print("ok", len(cases) + 1)
"""


def test_kernel_matches_the_matmul_form_and_the_cache_path_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok 5"


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_kernel_compiles_for_the_h200(dtype: str) -> None:
    """Triton's whole pipeline down to a cubin for compute capability 9.0, on the CPU."""
    ptr = f"*{dtype}"
    kernel = compile_for_h200(
        pa._prompt_kernel,
        [ptr, ptr, ptr, "*i64", ptr, "i32", *["i32"] * 8, "fp32"],
        {"GROUP": 6, "D": 128, "BLOCK_M": 32, "BLOCK_N": 32, "PRECISION": "ieee" if dtype == "fp32" else "tf32"},
        divisible=("rows",),
    )
    assert "cubin" in kernel.asm


def test_the_op_runs_the_matmul_form_on_the_cpu() -> None:
    torch.manual_seed(2)
    q, k, v = torch.randn(8, 6, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 0])  # prompts of 3 and 4 tokens, one padding row
    got = pa.prompt_attention(q, k, v, positions)
    # a prompt's first token and the padding row see only themselves: their own value for every head of the group
    for r in (0, 3, 7):
        assert torch.allclose(got[r], v[r].repeat_interleave(3, dim=0), atol=1e-6)
    # the second prompt never sees the first: changing the first prompt's keys leaves it alone
    k2 = k.clone()
    k2[:3] += 5.0
    again = pa.prompt_attention(q, k2, v, positions)
    assert torch.allclose(again[3:], got[3:]) and not torch.allclose(again[1:3], got[1:3])


def test_the_mixed_attention_op_splits_decode_rows_from_prompt_rows() -> None:
    """Decode rows read their cache rows; prompt rows read the packed keys: the op's CPU path against both forms."""
    torch.manual_seed(3)
    kc, vc = torch.randn(5, 2, 64, 32), torch.randn(5, 2, 64, 32)
    q, k, v = torch.randn(7, 6, 32), torch.randn(7, 2, 32), torch.randn(7, 2, 32)
    positions = torch.tensor([10, 63, 0, 0, 1, 2, 0])  # 2 decode rows, then prompts of 1 and 3 tokens, 1 padding
    rows = torch.tensor([0, 3, 1, 2, 2, 2, 4])
    got = mixed_attention_op(q, k, v, kc, vc, positions, rows, 2)
    decode = matmul_decode_attention(q[:2], kc, vc, positions[:2], rows[:2])
    assert torch.allclose(got[:2], decode, atol=1e-6)
    assert torch.allclose(got[2:], pa.matmul_prompt_attention(q[2:], k[2:], v[2:], positions[2:]), atol=1e-6)
