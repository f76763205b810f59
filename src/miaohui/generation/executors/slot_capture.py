"""The slot engine's CUDA graphs: its static steps (decode, prefill, prefix-hit prefill, mixed) over static inputs,
their warm-up and capture before ready, and the capture of the rest on a background thread after ready.

:class:`SlotGraphs` is the half of :class:`~miaohui.generation.executors.slot_engine.TorchSlotEngine` that owns the
graphs; the engine's step methods (``_decode``, ``_prefill``, ``_prefill_from``, ``_mixed``) fill the static inputs and
replay a bucket's graph, or run its step without one. Graph kinds and their buckets:

* ``decode`` — (batch bucket, attended length bucket);
* ``prefill`` — (prompts, padded length), with ``static_prefill``;
* ``prefix`` — the rest of prompts whose first tokens their slots already hold (prefix-cache hits), the same
  (prompts, padded length) buckets up to :data:`PREFIX_GRAPH_TOKENS`, attending over the whole slot (``max_len``) so
  that one graph serves every cached length, with ``static_prefill`` and ``prefix_graphs``; always captured after
  ready (a hit before its graph exists runs the same step without one);
* ``mixed`` — (batch, prompt tokens, attended length), with mixed steps on.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from miaohui.engines.graph_capture import capturing, compiles_so_far
from miaohui.generation.executors.compile_clock import CompileClock, cache_counters
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.executors.slot_steps import Graph, Outputs, PrefillBuffers
from miaohui.generation.models import mixed_step

if TYPE_CHECKING:
    from miaohui.engines.precompiled import Precompiled
    from miaohui.generation.models.static_kv import StaticKVDecoder

logger = logging.getLogger(__name__)

Kind = Literal["decode", "prefill", "prefix", "mixed"]

PREFIX_GRAPH_TOKENS = 512
"""Longest padded rest a prefix-hit prefill graph is captured for: a chat turn's new tokens (the history before it
is the cached prefix); a longer rest runs its step without a graph."""


class SlotGraphs:
    """The static steps and CUDA graphs of a slot engine (mixed into
    :class:`~miaohui.generation.executors.slot_engine.TorchSlotEngine`, which sets every attribute below)."""

    model: StaticKVDecoder
    options: SlotEngineOptions
    device: torch.device
    pad_token_id: int
    max_len: int
    compiled: bool
    graphs_on: bool
    precompiled: Precompiled | None
    batch_buckets: tuple[int, ...]
    length_buckets: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    mixed_tokens: tuple[int, ...]
    mixed_prompts: int
    mixed_lengths: tuple[int, ...]
    lengths: Any
    warmup_seconds: float | None
    start_phases: dict[str, float]
    _decode_fn: Callable[..., torch.Tensor]
    _prefill_fn: Callable[..., torch.Tensor]
    _io_dev: torch.Tensor
    _pf_dev: PrefillBuffers
    _mx_dev: torch.Tensor
    _picked: torch.Tensor
    _graphs: dict[tuple[int, int], Graph]
    _prefill_graphs: dict[tuple[int, int], Graph]
    _prefix_graphs: dict[tuple[int, int], Graph]
    _mixed_graphs: dict[tuple[int, int, int], Graph]
    _pools: dict[str, Any]
    _deferred: list[tuple[Kind, tuple[int, ...]]]
    _step_lock: threading.RLock
    _capture_thread: threading.Thread | None
    _closing: bool

    @property
    def defers_capture(self) -> bool:
        """Whether :meth:`warmup` with ``defer`` may leave graphs for after ready: CUDA graphs on, and no compile can
        follow the load (the build's precompiled graphs, or compile off), so a bucket without its graph yet runs the
        same kernels, not a compile under load."""
        return self.graphs_on and (self.precompiled is not None or not self.compiled)

    @property
    def pending_graphs(self) -> int:
        """CUDA graphs not captured yet (left by :meth:`warmup` with ``defer``; :meth:`capture_deferred` takes them)."""
        return len(self._deferred)

    def warmup(self, log: Callable[[str], None] = logger.info, defer: bool = False) -> float:
        """Compile and capture every bucket's CUDA graph; seconds taken. ``defer`` (serve, with
        ``options.capture_after_ready``, where :attr:`defers_capture`): capture only the buckets
        :meth:`SlotEngineOptions.before_ready` names, and leave the rest to :meth:`capture_deferred`."""
        started = time.perf_counter()
        self._deferred = []
        keep: Callable[[Kind, int, int], bool] = lambda kind, rows, tokens: True  # noqa: E731
        if defer and self.options.capture_after_ready and self.defers_capture:
            keep = self.options.before_ready
        with torch.inference_mode(), CompileClock() as clock:
            for n in (1, 2):  # Dynamo specialises one prompt apart from several: compile both now
                pads = torch.full((n, 16), self.pad_token_id, dtype=torch.int64, device=self.device)
                lengths, slots = torch.tensor([16, 9][:n], device=self.device), torch.arange(n, device=self.device)
                self._prefill_fn(pads, lengths, slots)
                # and the rest of a prompt whose prefix a slot holds (prefix cache hits; positions per row)
                self.model.prefill_from(pads, lengths, slots, torch.tensor([8, 3][:n], device=self.device), 24)
            if self.graphs_on:
                self._capture(log, keep)
                if self.options.static_prefill:
                    self._capture_prefill(log, keep)
                if self.mixed_tokens:
                    self._capture_mixed(log, keep)
                if self.options.static_prefill and self.options.prefix_graphs:  # last: every request's steps first
                    self._capture_prefix(log, keep)
            else:
                self._decode_step(2, self.length_buckets[0])
        self.lengths[:] = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_seconds = time.perf_counter() - started
        self.start_phases["compile"] = clock.seconds
        self.start_phases["capture"] = self.warmup_seconds - clock.seconds
        if not self._deferred:
            self.start_phases["capture_after_ready"] = 0.0
        counted = f"; {cache_counters()}" if self.compiled else ""
        log(
            f"decode engine ready in {self.warmup_seconds:.1f}s: {len(self._graphs)} decode, "
            f"{len(self._prefill_graphs)} prefill, {len(self._prefix_graphs)} prefix-hit and {len(self._mixed_graphs)} "
            "mixed CUDA graphs, "
            f"compile={'on' if self.compiled else 'off'} ({clock.compiles} compiles, {clock.seconds:.1f}s{counted}), "
            f"graphs and first runs {self.start_phases['capture']:.1f}s"
            + (f" ({self.precompiled.summary()})" if self.precompiled is not None else "")
            + (f"; {len(self._deferred)} graphs left for after ready" if self._deferred else "")
        )
        return self.warmup_seconds

    def _capture(self, log: Callable[[str], None], keep: Callable[[Kind, int, int], bool]) -> None:
        pool = self._pools["decode"] = torch.cuda.graph_pool_handle()
        self._decode_inputs()
        later: list[tuple[Kind, tuple[int, ...]]] = []
        # largest first, so the smaller graphs reuse the pool's memory
        for b in sorted(self.batch_buckets, reverse=True):
            # int8 batch-1 weights: Inductor's one-row GEMM → Triton reduction rewrite needs coordinate-descent tuning
            tune = (b == 1 and self.options.int8_batch1 and self.options.int8_kernel == "inductor") or (
                torch._inductor.config.coordinate_descent_tuning
            )
            with torch._inductor.config.patch(coordinate_descent_tuning=tune):
                for t in sorted(self.length_buckets, reverse=True):
                    if not keep("decode", b, t):
                        later.append(("decode", (b, t)))
                        continue
                    self._graphs[(b, t)] = self._capture_one(functools.partial(self._decode_step, b, t), pool)
            log(f"captured decode graphs for batch {b}")
        self._deferred += reversed(later)  # after ready, the smaller (sooner needed) buckets first

    def _decode_inputs(self) -> None:
        """The decode step's static inputs for a warm run or capture: the pad token at position 0 in every row."""
        self._io_dev.zero_()
        self._io_dev[0].fill_(self.pad_token_id)
        self._io_dev[2].fill_(1)

    def _prefill_inputs(self, slot: int) -> None:
        """The static prefill inputs for a warm run or capture: one pad token per prompt, each into ``slot``."""
        buf = self._pf_dev
        buf.tokens.fill_(self.pad_token_id)
        buf.lengths.fill_(1)
        buf.slots.fill_(slot)
        buf.starts.fill_(0)

    def _mixed_inputs(self) -> None:
        """The static mixed-step inputs for a warm run or capture: every row a padding row (pad token, position 0,
        the scratch cache row)."""
        io = self._mx_dev
        io.zero_()
        io[0].fill_(self.pad_token_id)
        io[2].fill_(self.model.scratch_row)
        io[3].fill_(1)
        io[5].fill_(self.model.scratch_row)

    def _step_for(self, kind: Kind, key: tuple[int, ...]) -> Callable[[], Outputs]:
        """The static step of bucket ``key`` of ``kind`` over the engine's static inputs."""
        if kind == "decode":
            return functools.partial(self._decode_step, *key)
        if kind == "mixed":
            return functools.partial(self._mixed_step, *key)
        buf, (n, s) = self._pf_dev, key
        if kind == "prefix":
            return functools.partial(self._prefix_step, buf.tokens[:n, :s], buf.lengths[:n], buf.slots[:n],
                                     buf.starts[:n])  # fmt: skip
        return functools.partial(self._prefill_step, buf.tokens[:n, :s], buf.lengths[:n], buf.slots[:n])

    def capture_deferred(self, log: Callable[[str], None] = logger.info) -> threading.Thread | None:
        """Capture the graphs :meth:`warmup` left (``defer``) on a background thread, after the version is ready; the
        thread, or None when none are left. One bucket at a time under the step lock (a step waits for at most one
        bucket's warm run and capture, ~50–65 ms for a 1.5B model on an H100), each warm run isolated from the
        sequences being served (:meth:`_isolated_warm_run`); until a bucket's graph exists its steps run without it.
        Done: ``start_phases["capture_after_ready"]`` and a log line."""
        if not self._deferred or self._capture_thread is not None:
            return None
        self._capture_thread = threading.Thread(
            target=self._capture_rest, args=(log,), name="miaohui-graph-capture", daemon=True
        )
        self._capture_thread.start()
        return self._capture_thread

    def _capture_rest(self, log: Callable[[str], None]) -> None:
        started, done = time.perf_counter(), 0
        try:
            if self.device.index is not None:
                torch.cuda.set_device(self.device)
            if self.precompiled is not None:  # outside the step lock: a step need not wait for a load
                self.precompiled.load_all()
            with torch.inference_mode():
                while self._deferred and not self._closing:
                    kind, key = self._deferred[0]
                    with self._step_lock:
                        if self._closing:
                            break
                        graph = self._capture_one(
                            self._step_for(kind, key), self._pools[kind], isolate=kind, error_mode="thread_local"
                        )
                        self._graph_table(kind)[key] = graph
                    self._deferred.pop(0)
                    done += 1
                    time.sleep(0.001)  # a step waiting on the lock takes it now (the lock is not fair)
        except Exception:  # the buckets left run without graphs: slower, the same tokens
            left = len(self._deferred)
            logger.exception("capturing CUDA graphs after ready stopped; %d buckets run without one", left)
        seconds = time.perf_counter() - started
        self.start_phases["capture_after_ready"] = seconds
        if not self._closing:
            log(f"captured {done} CUDA graphs after ready in {seconds:.1f}s ({len(self._deferred)} left)")

    def _graph_table(self, kind: Kind) -> dict[Any, Graph]:
        if kind == "decode":
            return self._graphs
        if kind == "prefix":
            return self._prefix_graphs
        return self._prefill_graphs if kind == "prefill" else self._mixed_graphs

    def _isolated_warm_run(self, kind: Kind, step: Callable[[], Outputs]) -> None:
        """``step()`` (a bucket's warm run) on an engine that is serving, leaving its sequences' state as it was: the
        static inputs are set to padding rows (a prefill's and a mixed step's into the scratch cache row), the slots'
        picks are saved and put back, and so is position 0 of the cache rows a decode step writes (rows are slots).
        Enqueued on the current stream between the served steps (the caller holds the step lock)."""
        picked = self._picked.clone()
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        if kind == "decode":
            self._decode_inputs()
            rows = max(self.batch_buckets)
            caches = zip(self.model.k_cache, self.model.v_cache, strict=True)
            saved = [(k[:rows, :, 0].clone(), v[:rows, :, 0].clone()) for k, v in caches]
        elif kind in ("prefill", "prefix"):
            self._prefill_inputs(self.model.scratch_row)
        else:
            self._mixed_inputs()
        step()
        for (k0, v0), k, v in zip(saved, self.model.k_cache, self.model.v_cache, strict=False):
            rows = k0.shape[0]
            k[:rows, :, 0].copy_(k0)
            v[:rows, :, 0].copy_(v0)
        self._picked.copy_(picked)

    def _decode_step(self, b: int, t: int) -> Outputs:
        """Decode rows ``0..b-1`` over ``t`` cached positions from the static inputs: each row's token is the host's
        (``io[2]`` = 1) or the slot's previous greedy pick; the step's own picks are stored for the next step."""
        io = self._io_dev
        tokens = torch.where(io[2, :b] != 0, io[0, :b], self._picked[:b])
        logits = self._decode_fn(tokens, io[1, :b], t)
        best = logits.argmax(dim=-1)
        self._picked[:b].copy_(best)
        return logits, best

    def _prefill_step(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> Outputs:
        """Prefill, and store each prompt's greedy pick as its slot's next decode token."""
        logits = self._prefill_fn(tokens, lengths, slots)
        best = logits.argmax(dim=-1)
        self._picked.index_copy_(0, slots, best)
        return logits, best

    def _prefix_step(
        self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor
    ) -> Outputs:
        """Prefill the rests of prompts whose first ``starts`` tokens their slots hold, attending over the whole slot
        (``max_len``: one graph for every cached length; positions past a row's own are masked), and store each
        prompt's greedy pick as its slot's next decode token."""
        logits = self.model.prefill_from(tokens, lengths, slots, starts, self.max_len)
        best = logits.argmax(dim=-1)
        self._picked.index_copy_(0, slots, best)
        return logits, best

    def _mixed_step(self, b: int, p: int, t: int) -> Outputs:
        """A mixed step from the static inputs (:meth:`_mixed`): decode rows ``0..b-1`` (tokens as in
        :meth:`_decode_step`), then ``p`` prompt-token rows; logits of the ``b`` decode rows and of each prompt's last
        token; the picks stored per slot as decode and prefill store them."""
        io, k = self._mx_dev, b + self.mixed_prompts
        decode_tokens = torch.where(io[3, :b] != 0, io[0, :b], self._picked[:b])
        tokens = torch.cat((decode_tokens, io[0, b : b + p]))
        logits = mixed_step.mixed_forward(self.model, tokens, io[1, : b + p], io[2, : b + p], io[4, :k], t, b)
        best = logits.argmax(dim=-1)
        self._picked[:b].copy_(best[:b])
        self._picked.index_copy_(0, io[5, : self.mixed_prompts], best[b:])
        return logits, best

    def _capture_one(
        self,
        step: Callable[[], Outputs],
        pool: Any,
        isolate: Kind | None = None,
        error_mode: str = "global",
    ) -> Graph:
        """Run ``step()`` on a side stream (loads the kernels and warms cuBLAS for the shape; once more where that
        run compiled), then capture it into a CUDA graph from ``pool`` (:func:`capturing`: no per-capture flush of the
        allocator); the graph and its static outputs. ``isolate``: the engine is serving, the warm runs go through
        :meth:`_isolated_warm_run` (the capture itself runs nothing)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            before = compiles_so_far()
            for _ in range(2):
                if isolate is None:
                    step()
                else:
                    self._isolated_warm_run(isolate, step)
                if compiles_so_far() == before:
                    break
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, pool, capture_error_mode=error_mode):
            out = step()
        return graph, out

    def _capture_prefill(self, log: Callable[[str], None], keep: Callable[[Kind, int, int], bool]) -> None:
        """One CUDA graph per (prompts, prompt length) prefill bucket over the static prefill buffers. Capture
        runs write the pad token's K/V into slot 0's rows, which hold no sequence during warm-up."""
        self._pools["prefill"] = torch.cuda.graph_pool_handle()
        self._capture_padded("prefill", self.prefill_lengths, log, keep)

    def _capture_prefix(self, log: Callable[[str], None], keep: Callable[[Kind, int, int], bool]) -> None:
        """One CUDA graph per (prompts, rest length) bucket of a prefix-hit prefill, rests up to
        :data:`PREFIX_GRAPH_TOKENS`, over the static prefill buffers (from the prefill graphs' pool: a prefix-hit
        prefill and a prefill never run at once, and a later one of either invalidates the other's logits)."""
        self._pools["prefix"] = self._pools["prefill"]
        self._capture_padded("prefix", [s for s in self.prefill_lengths if s <= PREFIX_GRAPH_TOKENS], log, keep)

    def _capture_padded(
        self,
        kind: Kind,
        lengths: Sequence[int],
        log: Callable[[str], None],
        keep: Callable[[Kind, int, int], bool],
    ) -> None:
        """The (prompts, padded length) buckets of ``kind`` (``prefill`` or ``prefix``) over the static prefill
        buffers, largest first; those ``keep`` declines are left for after ready."""
        self._prefill_inputs(0)
        table, pool = self._graph_table(kind), self._pools[kind]
        later: list[tuple[Kind, tuple[int, ...]]] = []
        for n in sorted(self.prefill_batches, reverse=True):
            for s in sorted(lengths, reverse=True):
                if not keep(kind, n, n * s):
                    later.append((kind, (n, s)))
                    continue
                table[(n, s)] = self._capture_one(self._step_for(kind, (n, s)), pool)
        self._deferred += reversed(later)
        log(f"captured {len(table)} {kind} graphs")

    def _capture_mixed(self, log: Callable[[str], None], keep: Callable[[Kind, int, int], bool]) -> None:
        """One CUDA graph per (batch, length, prompt tokens) bucket over the static mixed-step inputs: every row a
        padding row (pad token, position 0, the scratch cache row)."""
        pool = self._pools["mixed"] = torch.cuda.graph_pool_handle()
        self._mixed_inputs()
        later: list[tuple[Kind, tuple[int, ...]]] = []
        for b in sorted(self.batch_buckets, reverse=True):
            for t in sorted(self.mixed_lengths, reverse=True):
                for p in sorted(self.mixed_tokens, reverse=True):
                    if not keep("mixed", b, p):
                        later.append(("mixed", (b, p, t)))
                        continue
                    self._mixed_graphs[(b, p, t)] = self._capture_one(self._step_for("mixed", (b, p, t)), pool)
        self._deferred += reversed(later)
        log(f"captured {len(self._mixed_graphs)} mixed-step graphs")
