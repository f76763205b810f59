"""``save_fast`` / ``load_fast``: a fast model kept as weights + spec and rebuilt without its checkpoint (what
``fast_start`` answers with) gives the same outputs, keeps the weights' dtype, and refuses weights of another shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miaohui.models.checkpoint import load_checkpoint
from miaohui.models.fast_bert import FAST_WEIGHTS, from_module, load_fast, save_fast, spec_of, use_fused_gelu
from miaohui.models.intent import SentenceEncoder


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, 1000, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


@pytest.mark.parametrize("kind", ["intent", "encoder"])
def test_round_trip_gives_the_same_outputs(tiny_model: Path, tmp_path: Path, kind: str) -> None:
    source = load_checkpoint(tiny_model).module
    if kind == "encoder":
        source = SentenceEncoder(source.encoder)
    fast = use_fused_gelu(from_module(source), True)
    save_fast(fast, tmp_path)
    again = load_fast(tmp_path, "cpu")
    assert spec_of(again) == spec_of(fast) and spec_of(again).kind == kind and spec_of(again).fused_gelu
    with torch.no_grad():
        torch.testing.assert_close(again(*_inputs()), fast(*_inputs()), rtol=0, atol=0)
    assert not any(p.requires_grad or p.is_meta for p in again.parameters())


def test_weights_keep_their_dtype(tiny_model: Path, tmp_path: Path) -> None:
    fast = from_module(load_checkpoint(tiny_model).module).to(torch.bfloat16)
    save_fast(fast, tmp_path)
    assert {p.dtype for p in load_fast(tmp_path, "cpu").parameters()} == {torch.bfloat16}


def test_weights_of_another_shape_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    save_fast(from_module(load_checkpoint(tiny_model).module), tmp_path)
    state = load_file(str(tmp_path / FAST_WEIGHTS))
    state["head.weight"] = torch.cat([state["head.weight"], state["head.weight"][:1]])  # one label more
    save_file(state, str(tmp_path / FAST_WEIGHTS))
    with pytest.raises(RuntimeError, match="head.weight"):
        load_fast(tmp_path, "cpu")
