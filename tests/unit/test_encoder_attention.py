"""The encoder's Triton attention (``miaohui.models.encoder_attention``): under Triton's interpreter against the SDPA
form FastBert runs today; compiled for the H200 on the CPU; the probe's table; refused shapes (FastBert with the
switch on: ``test_fast_bert_switches.py``). The
interpreter must be on before Triton is imported, so that check runs in a child process."""

from __future__ import annotations

import pytest
import torch
from tests.triton_checks import compile_for_h200, run_interpreted

from miaohui.models import encoder_attention as ea

CHECK = """
import torch
from miaohui.models.encoder_attention import sdpa_encoder_attention, triton_encoder_attention
from miaohui.models.fast_bert import MASK_BIAS

torch.manual_seed(0)
cases = [  # batch, sequence, heads, head size, dtype, padded keys per sequence, configuration (None: the default)
    (1, 128, 12, 64, torch.float32, (0,), None),          # BERT-base at 1x128: 32-query blocks, two key blocks
    (3, 100, 12, 32, torch.float32, (0, 37, 99), None),   # e5's head size; a sequence not a multiple of the blocks
    (2, 16, 4, 64, torch.float16, (5, 0), None),          # one short key block, fp16
    (12, 64, 12, 64, torch.float16, (0,) * 11 + (63,), None),  # 64-query blocks (144 programs); one key unpadded
    (2, 100, 4, 64, torch.float32, (0, 60), (16, 128, 2, 2)),  # one 128-key step over 100 keys, 16-query blocks
    (1, 80, 4, 32, torch.float16, (30,), (128, 32, 8, 3)),     # one query block past the end, three key steps
]
for b, s, h, d, dtype, padded, config in cases:
    qkv = torch.randn(b, s, 3 * h * d).to(dtype)
    mask = torch.ones(b, s)
    for i, p in enumerate(padded):
        if p:
            mask[i, s - p :] = 0
    bias = ((1.0 - mask[:, None, None, :]) * MASK_BIAS).to(dtype)
    got = triton_encoder_attention(qkv, bias, h, config)
    want = sdpa_encoder_attention(qkv.float(), bias.float(), h)
    assert got.dtype == dtype and got.shape == (b, s, h * d), (got.dtype, got.shape)
    err = float((got.float() - want).abs().max())
    assert err < (1e-4 if dtype == torch.float32 else 5e-3), (b, s, h, d, dtype, err)
    # the padded keys do not count: the same queries over the unpadded keys alone
    kept = int(mask[-1].sum())
    alone = sdpa_encoder_attention(
        qkv[-1:].view(1, s, 3, h * d)[:, :kept].reshape(1, kept, 3 * h * d).float(),
        torch.zeros(1, 1, 1, kept), h,
    )
    assert float((got[-1:, :kept].float() - alone).abs().max()) < (1e-4 if dtype == torch.float32 else 5e-3)
# a strided qkv (a view of a wider buffer) is read as such
wide = torch.randn(2, 40, 3 * 4 * 32 + 8)
qkv, bias = wide[:, :, : 3 * 4 * 32], torch.zeros(2, 1, 1, 40)
assert float((triton_encoder_attention(qkv, bias, 4) - sdpa_encoder_attention(qkv, bias, 4)).abs().max()) < 1e-4
print("ok", len(cases) + 1)
"""


def test_kernel_matches_sdpa_under_the_interpreter() -> None:
    assert run_interpreted(CHECK) == "ok 7"


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize(("d", "block_n"), [(32, 64), (64, 64), (64, 128)])
def test_kernel_compiles_for_the_h200(dtype: str, d: int, block_n: int) -> None:
    """Triton's whole pipeline down to a cubin for compute capability 9.0, on the CPU, for e5's and BERT-base's
    head sizes."""
    ptr = f"*{dtype}"
    kernel = compile_for_h200(
        ea._encoder_kernel,
        [ptr, ptr, ptr, "i32", *["i32"] * 5, "fp32"],
        {
            "HEADS": 12,
            "D": d,
            "BLOCK_M": 64,
            "BLOCK_N": block_n,
            "PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "LOG2E": ea.LOG2E,
        },
        divisible=("seq",),
    )
    assert "cubin" in kernel.asm


def test_bad_shapes_are_refused_with_the_shapes_named() -> None:
    with pytest.raises(ValueError, match=r"qkv \(2, 8, 100\), bias \(2, 1, 1, 8\), heads 12: need qkv"):
        ea.sdpa_encoder_attention(torch.zeros(2, 8, 100), torch.zeros(2, 1, 1, 8), 12)
    with pytest.raises(ValueError, match=r"bias \(1, 8\)"):
        ea.sdpa_encoder_attention(torch.zeros(2, 8, 36), torch.zeros(1, 8), 3)


def test_the_default_configuration_keeps_the_sms_busy() -> None:
    assert ea.default_config(1, 12, 128) == (32, 64, 4, 1)  # 24 programs of 64 would leave most SMs idle
    assert ea.default_config(32, 12, 128) == (64, 64, 4, 1)
