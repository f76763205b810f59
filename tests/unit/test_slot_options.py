"""``SlotEngineOptions`` (no torch): the fused decode layer only with the matmul attention; gemv_fused without
int8_batched."""

from __future__ import annotations

import pytest

from miaohui.errors import ConfigError
from miaohui.generation.slot_options import SlotEngineOptions


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_fused_decode_layer_refuses_other_attentions(attention: str) -> None:
    """sdpa inside the fused graph failed Inductor's stride check on the H200 (torch 2.11); flex needs a 4-d query."""
    with pytest.raises(ConfigError, match=attention) as err:
        SlotEngineOptions(decode_attention=attention, decode_layer="fused")  # type: ignore[arg-type]
    assert "decode_layer split" in (err.value.fix or "")


def test_fused_decode_layer_with_matmul_and_split_with_any_attention() -> None:
    assert SlotEngineOptions(decode_layer="fused").decode_attention == "triton"
    assert SlotEngineOptions(decode_attention="flex", decode_layer="split").decode_layer == "split"


def test_the_default_layer_is_fused_unless_the_attention_needs_split() -> None:
    """fused was ahead in every decode graph and in both server orders on the H200 (s10f, s12a); sdpa/flex get split."""
    assert SlotEngineOptions().decode_layer == "fused"
    assert SlotEngineOptions(decode_layer=None).decode_layer == "fused"  # type: ignore[arg-type]
    assert SlotEngineOptions(decode_attention="sdpa").decode_layer == "split"
    assert SlotEngineOptions(decode_attention="flex").decode_layer == "split"
    assert SlotEngineOptions.model_validate({"decode_attention": "matmul"}).decode_layer == "fused"
    assert SlotEngineOptions(decode_attention="triton").decode_layer == "fused"


@pytest.mark.parametrize("kernel", ["gemv_fused", "gemv_layer"])
def test_folded_kernels_refuse_int8_batched(kernel: str) -> None:
    """gemv_fused and gemv_layer fold the RMSNorm weights into the int8 copy; int8_batched's steps read that copy
    unnormed."""
    with pytest.raises(ConfigError, match=f"int8_kernel '{kernel}' folds the RMSNorm weights") as err:
        SlotEngineOptions(int8_batch1=True, int8_kernel=kernel, int8_batched=True)
    assert err.value.fix == "use int8_kernel gemv with int8_batched, or int8_batched false"
    assert SlotEngineOptions(int8_batch1=True, int8_kernel="gemv", int8_batched=True).int8_kernel == "gemv"
    assert SlotEngineOptions().int8_kernel == "gemv_layer"
    assert SlotEngineOptions(int8_batch1=True, int8_batched=True).int8_kernel == "gemv"  # the default steps aside
