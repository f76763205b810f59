"""Ints that a graph compiled with ``torch.compile(dynamic=True)`` should hold as constants, not as symbols."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def with_constants(fn: Callable[..., T], **consts: int) -> Callable[..., T]:
    """``fn`` called with ``consts`` added as keyword arguments, which Dynamo then treats as constants of the graph.

    With ``dynamic=True`` every int that a compiled function receives becomes a symbol, also one that it reads from a
    closure or a ``functools.partial``. Inductor's kernels then index with 64-bit divisions by values known only at run
    time: with the head count a symbol, the query's RoPE kernel of the 1.5B decode layer took 2.4–6.1 µs per layer on
    the H200. Dynamo does specialize the default values of a function it inlines, so ``consts`` reach ``fn`` as
    one."""

    def inner(args: tuple[Any, ...], kwargs: dict[str, Any], consts: dict[str, int] = consts) -> T:
        return fn(*args, **kwargs, **consts)

    def bound(*args: Any, **kwargs: Any) -> T:
        return inner(args, kwargs)

    bound.__qualname__ = getattr(fn, "__qualname__", bound.__qualname__)  # names the piece (engines.precompiled)
    return bound
