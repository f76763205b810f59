"""``SlotEngineOptions`` (no torch): the fused decode layer only with the matmul attention."""

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
    assert SlotEngineOptions(decode_layer="fused").decode_attention == "matmul"
    assert SlotEngineOptions(decode_attention="flex").decode_layer == "split"
