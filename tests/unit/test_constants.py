"""``with_constants``: an int given through it is a constant of a ``dynamic=True`` graph, where the same int passed as
an argument, as the compiled function's own default, from a closure or bound by ``functools.partial`` is a symbol (and a
kernel then indexes by dividing by it at run time)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from miaohui.generation.models.constants import with_constants


def _heads_view(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.view(x.shape[0], heads, -1) * 2


def _graph_inputs(fn: Callable[..., Any], *args: Any) -> list[str]:
    """The kinds of the graph inputs Dynamo makes of ``fn``, compiled with ``dynamic=True`` and called on ``args``."""
    kinds: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        kinds.extend(type(n.meta.get("example_value")).__name__ for n in gm.graph.nodes if n.op == "placeholder")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, dynamic=True)(*args)
    assert torch.equal(out, _heads_view(args[0], 8))
    return kinds


def test_an_int_argument_default_closure_or_partial_is_a_symbol() -> None:
    x = torch.randn(4, 64)
    heads = 8

    def own_default(x: torch.Tensor, heads: int = 8) -> torch.Tensor:
        return _heads_view(x, heads)

    def closure(x: torch.Tensor) -> torch.Tensor:
        return _heads_view(x, heads)

    # the batch size's symbols, x, and one more symbol: the head count
    assert _graph_inputs(_heads_view, x, 8).count("SymInt") == 3
    assert _graph_inputs(own_default, x).count("SymInt") == 3
    assert _graph_inputs(closure, x).count("SymInt") == 3
    assert _graph_inputs(functools.partial(_heads_view, heads=8), x).count("SymInt") == 3


def test_with_constants_makes_the_int_a_constant_and_keeps_the_batch_dynamic() -> None:
    fn = with_constants(_heads_view, heads=8)
    kinds = _graph_inputs(fn, torch.randn(4, 64))
    assert kinds.count("SymInt") == 2 and kinds.count("FakeTensor") == 1  # the batch's symbols and x only
    calls: list[int] = []

    def counting(gm: torch.fx.GraphModule, example: Any) -> Any:
        calls.append(1)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counting, dynamic=True)
    for rows in (4, 6, 9):  # one graph for every batch size
        assert torch.equal(compiled(x := torch.randn(rows, 64)), _heads_view(x, 8))
    assert calls == [1]
