"""The slot engine's step pieces: pinned host buffers for greedy tokens and prefill inputs, device logits that a
step hands the runner, a graph's replay-or-eager run, and the compile settings (:mod:`.slot_engine` uses them)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from miaohui.errors import ConfigError
from miaohui.generation.executors.base import StepLogits
from miaohui.generation.executors.slot_options import SlotEngineOptions

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(options: SlotEngineOptions) -> torch.device:
    """``auto``: CUDA when available, else the CPU; ConfigError for CUDA on a machine without it."""
    if options.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(options.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {options.device!r} but CUDA is not available here", "use device: auto or cpu")
    return dev


class HostTokens:
    """Pinned host buffers for steps' greedy tokens. The device→host copy is queued right behind its step and an
    event marks it done, so reading a step's tokens never waits for a later step queued behind it (the chained
    loop launches step N+1 before it reads step N). Two buffers alternate: step N+1's copy does not overwrite step
    N's tokens before they are read (step N-1's were read before step N+1 was launched).

    Every torch call releases the GIL and must take it back; under the server's event loop each take-back can
    wait up to the switch interval, so the step's host path keeps its torch calls few (and waits in
    ``Event.synchronize``, which releases the GIL, so the event loop streams meanwhile)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._bufs = [torch.zeros(rows, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self._turn = 0

    def start(self, best: torch.Tensor, early: bool) -> Callable[[], list[int]]:
        """The call that returns ``best`` (int64 [rows] on the device) on the host. ``early``: queue its copy now,
        behind this step (the chained loop), and wait on an event; else copy when called and wait for the stream:
        one wait then covers a step's decode and prefill, queued back to back (one GIL take-back, not two)."""
        if not self.cuda:
            values = [int(v) for v in best.tolist()]
            return lambda: values
        turn, self._turn = self._turn, self._turn ^ 1
        host, done = self._bufs[turn][: best.shape[0]], self._events[turn]
        if not early:

            def copy_and_fetch() -> list[int]:
                host.copy_(best, non_blocking=True)
                torch.cuda.current_stream(best.device).synchronize()
                return [int(v) for v in host.tolist()]

            return copy_and_fetch
        host.copy_(best, non_blocking=True)
        done.record()

        def fetch() -> list[int]:
            done.synchronize()
            return [int(v) for v in host.tolist()]

        return fetch


class TorchLogits(StepLogits):
    """Device logits ``[bucket, vocab]`` of which ``rows`` are the step's sequences, in order; ``tokens`` waits for
    the step's greedy picks (argmax per row, computed on the device inside the step) and returns them.

    The logits live in static graph buffers that the next step of the same kind (decode or prefill) overwrites:
    ``valid`` says whether that has happened (:meth:`rows` refuses then)."""

    def __init__(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        tokens: Callable[[], list[int]],
        valid: Callable[[], bool] = lambda: True,
    ) -> None:
        self.logits = logits
        self.row_ids = list(rows)
        self._tokens = tokens
        self._valid = valid

    def argmax(self) -> list[int]:
        values = self._tokens()
        return [values[r] for r in self.row_ids]

    def rows(self, idx: Sequence[int]) -> np.ndarray:
        if not self._valid():
            raise RuntimeError(
                "a later step overwrote these logits before their sampled rows were read",
                # a loop that chains steps must not do so while a sequence samples (report this: a loop bug)
            )
        sel = torch.as_tensor([self.row_ids[i] for i in idx], device=self.logits.device)
        return self.logits.index_select(0, sel).float().cpu().numpy()


Outputs = tuple[torch.Tensor, torch.Tensor]
"""A step's logits and its greedy pick per row."""
Graph = tuple[torch.cuda.CUDAGraph, Outputs]
"""A captured CUDA graph and its static outputs."""


def replay_or_run(graph: Graph | None, run: Callable[[], Outputs]) -> Outputs:
    """The graph's outputs after a replay; without a graph for the shape (or on a CPU), ``run()`` eagerly."""
    if graph is not None:
        graph[0].replay()
        return graph[1]
    with torch.inference_mode():
        return run()


def fill_decode_rows(
    tok: np.ndarray,
    pos: np.ndarray,
    given: np.ndarray,
    b: int,
    pad: int,
    slots: list[int],
    tokens: list[int | None],
    positions: np.ndarray,
) -> None:
    """Host inputs of a decode step's rows ``0..b-1`` (row = slot): the token (``pad`` where the row holds no
    sequence), the position, and ``given`` 1 where the host names the token, 0 where the step feeds the slot's previous
    greedy pick (``None`` in ``tokens``)."""
    tok[:b] = pad
    pos[:b] = 0
    given[:b] = 1
    if None in tokens:
        known = [i for i, v in enumerate(tokens) if v is not None]
        fed = [slots[i] for i, v in enumerate(tokens) if v is None]
        tok[[slots[i] for i in known]] = [tokens[i] for i in known]
        given[fed] = 0
    else:
        tok[slots] = tokens
    pos[slots] = positions


class PrefillBuffers:
    """Static prefill inputs in one tensor (one host→device copy): per prompt row, ``length`` token ids, then its
    real length, its cache row (slot) and the position its tokens start at (0 but for a prefix-cache hit's rest)."""

    def __init__(self, prompts: int, length: int, device: torch.device | str, pin: bool) -> None:
        self.all = torch.zeros((prompts, length + 3), dtype=torch.int64, device=device)
        if pin:
            self.all = self.all.pin_memory()
        self.tokens, self.lengths, self.slots = self.all[:, :length], self.all[:, length], self.all[:, length + 1]
        self.starts = self.all[:, length + 2]


RECOMPILE_LIMIT = 64
"""Dynamo's per-function limit while decode engines are compiled (its default is 8)."""


def allow_specialisations() -> None:
    """Raise Dynamo's recompile limit so a second engine in one process still compiles.

    The compiled layer halves are shared by every layer, engine and dtype of the process (Dynamo caches per code
    object), and one engine adds ~5 specialisations of each (batch 1, the attention bias of each length bucket,
    the cache strides). A second engine (another dtype or model) passed the default limit of 8 and, with
    ``fullgraph=True``, failed hard (``FailOnRecompileLimitHit``: fp32 then bf16 engines in one process, found on
    the H200, reproduced on the CPU). The number of specialisations stays bounded by engines x buckets."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)


def compile_mode(options: SlotEngineOptions) -> str | None:
    """``torch.compile``'s mode for the engine's pieces: max-autotune (without Inductor's own CUDA graphs: the engine
    captures whole steps) when ``options.autotune``."""
    return "max-autotune-no-cudagraphs" if options.autotune else None


def torch_compile_fn(options: SlotEngineOptions) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The engine's default compile function: ``torch.compile``, dynamic, full graph, :func:`compile_mode`."""
    return functools.partial(torch.compile, dynamic=True, fullgraph=True, mode=compile_mode(options))
