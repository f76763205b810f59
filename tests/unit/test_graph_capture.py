"""``compiles_so_far``: the count a bucket's warm-up reads to decide whether to run once more before its capture
(``capturing`` itself needs CUDA: tests/gpu/test_precompiled_gpu.py and test_slot_engine_gpu.py capture with it)."""

from __future__ import annotations

import torch

from miaohui.engines.graph_capture import compiles_so_far


def test_a_compile_is_counted_and_a_cached_call_is_not() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    compiled = torch.compile(f, backend="eager")
    before = compiles_so_far()
    compiled(torch.ones(3))
    assert compiles_so_far() == before + 1
    compiled(torch.ones(3))
    assert compiles_so_far() == before + 1
