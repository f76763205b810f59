"""Which CPUs quantize int8 weights to 7 bits (``engines.target.int8_reduce_range``): x86 without VNNI, where ONNX
Runtime's U8S8 kernels saturate; the quantization tests in ``tests/integration`` run the real quantizer on this
machine's CPU either way."""

from __future__ import annotations

import pytest

from miaohui.engines.target import cpu_flags, int8_reduce_range


@pytest.mark.parametrize(
    ("flags", "reduce"),
    [
        (("avx2", "fma", "f16c"), True),  # AVX2 only: vpmaddubsw's int16 pair sums saturate
        (("avx2", "avx512f", "avx512bw", "avx512vl"), True),  # AVX-512 without VNNI: the same instruction
        (("avx2", "avx512f", "avx512_vnni"), False),
        (("avx2", "avx_vnni"), False),
        (("avx2", "amx_int8"), False),
        (("asimd",), False),  # Arm: dot-product kernels
        ((), False),  # flags unknown (not Linux): full range, as before
    ],
)
def test_reduce_range_only_on_x86_without_vnni(flags: tuple[str, ...], reduce: bool) -> None:
    assert int8_reduce_range(flags) is reduce


def test_this_machine_is_answered_from_its_own_flags() -> None:
    assert int8_reduce_range() is int8_reduce_range(cpu_flags())
