"""The packed-prompt attention of mixed steps (``miaohui.generation.kernels.prompt_attention``): under Triton's interpreter
against the matmul form and against the decode attention's arithmetic reading the same keys from the cache;
compiled for the H200 on the CPU; the op's CPU path and the mixed step's attention op. The interpreter must
be on before Triton is imported, so that check runs in a child process."""

from __future__ import annotations

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.generation.kernels import prompt_attention as pa
from miaohui.generation.kernels.decode_attention import matmul_decode_attention
from miaohui.generation.models.mixed_step import mixed_attention_op

CHECK = """
import torch
from miaohui.generation.kernels.decode_attention import matmul_decode_attention
from miaohui.generation.kernels.prompt_attention import matmul_prompt_attention, triton_prompt_attention

torch.manual_seed(0)
cases = [  # prompt lengths (then padding rows up to the bucket), bucket, H, KVH, D, dtype, block_m, block_n
    ((20, 11), 36, 6, 1, 128, torch.float32, 16, 64),  # the 1.5B model's group of 6 and D; prompts cross row blocks
    ((48,), 48, 4, 2, 64, torch.float32, 16, 16),  # one whole prompt, no padding, three key blocks
    ((5, 20, 1, 30), 64, 6, 2, 64, torch.float16, 16, 32),  # four prompts, a 1-token one, fp16
    ((33,), 64, 4, 4, 32, torch.float32, 64, 16),  # no grouping, a row block wider than the prompt
]
for lengths, bucket, h, kvh, d, dtype, bm, bn in cases:
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(bucket - sum(lengths), dtype=torch.long)])
    slots = len(lengths) + 1  # one slot per prompt, then the scratch row the padding rows write
    rows, at = torch.full((bucket,), slots - 1), 0
    for i, n in enumerate(lengths):
        rows[at : at + n] = i
        at += n
    keys, values = torch.randn(slots + 1, kvh, 96, d).to(dtype), torch.randn(slots + 1, kvh, 96, d).to(dtype)
    keys, values = keys[:, :, :bucket], values[:, :, :bucket]  # a view of the attended bucket, as the engine passes
    q = torch.randn(bucket, h, d).to(dtype)
    got = triton_prompt_attention(q, keys, values, positions, rows, block_m=bm, block_n=bn)
    want = matmul_prompt_attention(q.float(), keys.float(), values.float(), positions, rows)
    assert got.dtype == dtype and got.shape == (bucket, h, d), (got.dtype, got.shape)
    real = slice(0, sum(lengths))  # padding rows share the scratch row's position 0: their output is not used
    err = float((got[real].float() - want[real]).abs().max())
    assert err < (1e-4 if dtype == torch.float32 else 5e-3), (lengths, dtype, err)
    # the decode kernel's arithmetic over the same cache (each row in its slot up to its position): the same result
    by_cache = matmul_decode_attention(q.float(), keys.float(), values.float(), positions, rows)
    assert float((got[real].float() - by_cache[real]).abs().max()) < (1e-4 if dtype == torch.float32 else 5e-3)
# written into a given output view: the rows before the view stay as they were
out = torch.full((40, 4, 64), 7.0)
keys, values = torch.randn(3, 2, 64, 64), torch.randn(3, 2, 64, 64)
q, positions = torch.randn(36, 4, 64), torch.cat((torch.arange(30), torch.arange(6)))
rows = torch.tensor([0] * 30 + [1] * 6)
triton_prompt_attention(q, keys, values, positions, rows, out[4:])
assert float((out[4:] - matmul_prompt_attention(q, keys, values, positions, rows)).abs().max()) < 1e-4
assert bool((out[:4] == 7.0).all())
print("ok", len(cases) + 1)
"""


def test_kernel_matches_the_matmul_form_and_the_decode_arithmetic_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok 5"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernel_compiles_for_the_h200(dtype: str) -> None:
    """Triton's whole pipeline down to a cubin for compute capability 9.0, on the CPU (fp16 compiles as bf16 does)."""
    ptr = f"*{dtype}"
    kernel = compile_for_h200(
        pa._prompt_kernel,
        [ptr, ptr, ptr, "*i64", "*i64", ptr, "i32", *["i32"] * 10, "fp32"],
        {
            "GROUP": 6,
            "D": 128,
            "BLOCK_M": pa.BLOCK_M,
            "BLOCK_N": pa.BLOCK_N,
            "PRECISION": "ieee" if dtype == "fp32" else "tf32",
        },
        divisible=("rows",),
    )
    assert "cubin" in kernel.asm


def test_the_op_runs_the_matmul_form_on_the_cpu() -> None:
    torch.manual_seed(2)
    keys, values = torch.randn(4, 2, 16, 32), torch.randn(4, 2, 16, 32)
    q = torch.randn(8, 6, 32)
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 0])  # prompts of 3 and 4 tokens in slots 0 and 1, one padding row
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 1, 3])
    got = pa.prompt_attention(q, keys, values, positions, rows)
    # a prompt's first token and the padding row see only themselves: their own value for every head of the group
    for r in (0, 3, 7):
        assert torch.allclose(got[r], values[rows[r], :, 0].repeat_interleave(3, dim=0), atol=1e-6)
    # the second prompt never sees the first: changing the first prompt's keys leaves it alone
    changed = keys.clone()
    changed[0] += 5.0
    again = pa.prompt_attention(q, changed, values, positions, rows)
    assert torch.allclose(again[3:], got[3:]) and not torch.allclose(again[1:3], got[1:3])
    # cache positions past a row's prompt are never read
    changed = keys.clone()
    changed[:, :, 4:] = float("nan")
    assert torch.allclose(pa.prompt_attention(q, changed, values, positions, rows), got)


def test_the_mixed_attention_op_splits_decode_rows_from_prompt_rows() -> None:
    """Decode rows read their cache rows up to their positions; prompt rows only their prompt: the op's CPU path
    against both forms."""
    torch.manual_seed(3)
    keys, values = torch.randn(5, 2, 64, 32), torch.randn(5, 2, 64, 32)
    q = torch.randn(7, 6, 32)
    positions = torch.tensor([10, 63, 0, 0, 1, 2, 0])  # 2 decode rows, then prompts of 1 and 3 tokens, 1 padding
    rows = torch.tensor([0, 3, 1, 2, 2, 2, 4])
    got = mixed_attention_op(q, keys, values, positions, rows, 2)
    decode = matmul_decode_attention(q[:2], keys, values, positions[:2], rows[:2])
    assert torch.allclose(got[:2], decode, atol=1e-6)
    prompts = pa.matmul_prompt_attention(q[2:], keys, values, positions[2:], rows[2:])
    assert torch.allclose(got[2:], prompts, atol=1e-6)
