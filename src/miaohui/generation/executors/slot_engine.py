"""The GPU generation engine (backend ``inductor``): a static-KV decoder, compiled, one CUDA graph per bucket.

:class:`TorchSlotEngine` wraps a :class:`~miaohui.generation.models.static_kv.StaticKVDecoder`:

* **decode** — the running rows are padded to the next *batch bucket* (rows are slots, so the bucket is
  the smallest one holding the highest slot in use; the runner hands out the lowest free slot, which
  keeps that small) and the attended cache length to the next *length bucket*. The step is captured
  as one CUDA graph per ``(batch bucket, length bucket)``: a step is then two tiny host→device copies
  from pinned memory and one ``graph.replay()``, with no Python per layer.
* **prefill** — prompts right-padded to a common length (at least 2, so a one-token prompt does not make
  Dynamo specialise a new graph under load); with ``static_prefill`` padded to (prompts, length) buckets and
  replayed as one CUDA graph per bucket.
* **compile** — Inductor compiles one layer's pieces for decode and for prefill (weights are arguments, so
  one graph serves all layers; prefill's attention is SDPA, eager) and the head, with dynamic batch/length:
  seconds, not the minutes a whole unrolled model takes.
* **logits stay on the device**: greedy rows take one ``argmax`` kernel and copy ``batch`` ints back;
  only rows that sample with temperature/top-p copy their logits to the host (so the same seeded numpy
  sampler as the CPU engines decides, token for token).

On a machine without CUDA the same engine runs eagerly on the CPU (no compile, no graphs) — what the CPU
tests exercise. Graph outputs are static buffers: a step's :class:`TorchLogits` is valid until the next
step (the runner samples at once).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from miaohui.errors import InputError
from miaohui.generation.executors.base import SlotCausalLMEngine, StepLogits
from miaohui.generation.executors.slot_capture import Kind, SlotGraphs
from miaohui.generation.executors.slot_options import SlotEngineOptions, bucket_for
from miaohui.generation.executors.slot_steps import (
    DTYPES,
    Graph,
    HostTokens,
    PrefillBuffers,
    TorchLogits,
    allow_specialisations,
    fill_decode_rows,
    replay_or_run,
    resolve_device,
    torch_compile_fn,
)
from miaohui.generation.models import mixed_step
from miaohui.generation.models.static_kv import StaticKVDecoder

if TYPE_CHECKING:
    from miaohui.engines.precompiled import Precompiled
    from miaohui.generation.cache.slot_prefix import SlotPrefixKV

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _under_step_lock(
    method: Callable[Concatenate[TorchSlotEngine, _P], _R],
) -> Callable[Concatenate[TorchSlotEngine, _P], _R]:
    """A step method run under the engine's step lock, which a capture after ready (:meth:`TorchSlotEngine.
    capture_deferred`) holds for one bucket at a time: a step never runs while a bucket's warm run touches the engine's
    static inputs, picks or cache."""

    @functools.wraps(method)
    def locked(self: TorchSlotEngine, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._step_lock:
            return method(self, *args, **kwargs)

    return locked


class TorchSlotEngine(SlotGraphs, SlotCausalLMEngine):
    """See the module docstring. Build with :meth:`create`; call :meth:`warmup` before timing or serving."""

    name = "inductor"

    def __init__(
        self,
        model: StaticKVDecoder,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        options: SlotEngineOptions,
        compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ) -> None:
        """``compile_fn`` compiles each of the model's pieces when ``options`` compile: :func:`torch_compile_fn`
        unless given, e.g. the build's recorder or serve's precompiled graphs
        (:mod:`miaohui.engines.precompiled`)."""
        super().__init__(model.dims, eos_token_ids, pad_token_id, model.num_slots, model.max_len)
        self.model = model
        self.options = options
        self.device = model.embed.device
        cuda = self.device.type == "cuda"
        self.runs_async = cuda
        self.feeds_tokens = True
        self.compiled = options.compile if options.compile is not None else cuda
        self.graphs_on = (options.cuda_graphs if options.cuda_graphs is not None else cuda) and cuda
        self.batch_buckets, self.length_buckets = options.buckets()
        self.precision = options.dtype
        self._decode_fn: Callable[..., torch.Tensor] = model.decode
        self._prefill_fn: Callable[..., torch.Tensor] = model.prefill
        model.decode_attention = options.decode_attention
        if options.int8_batch1:
            model.add_int8(kernel=options.int8_kernel)
        if self.compiled:
            allow_specialisations()
            if compile_fn is None:
                compile_fn = torch_compile_fn(options)
            model.use_compiled(compile_fn)
            if options.mixed_prefill_tokens:
                mixed_step.use_compiled(model, compile_fn)
        top = max(self.batch_buckets)
        pin = cuda
        # a decode step's inputs, one host→device copy per step: row 0 the host's token ids, row 1 positions,
        # row 2 1 where row 0 holds the token, 0 where the slot's previous greedy pick (``_picked``) is fed.
        # Host staging alternates between two pinned buffers (a step may be launched while the previous step's
        # copy is still queued).
        self._io_host = [torch.zeros((3, top), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._io_dev = torch.zeros((3, top), dtype=torch.int64, device=self.device)
        self._picked = torch.zeros(top + 1, dtype=torch.int64, device=self.device)
        """Per slot, the greedy token its last decode or prefill picked (written inside the step's graph); the last
        entry takes a mixed step's padding prompts' picks."""
        self._decode_tokens = HostTokens(top, self.device)
        self._graphs: dict[tuple[int, int], Graph] = {}
        self._launched = {"decode": 0, "prefill": 0, "mixed": 0}
        self.prefill_batches, self.prefill_lengths = options.prefill_buckets()
        self.max_prefill_prompts = max(self.prefill_batches) if options.static_prefill else None
        self.eager_prefills = 0
        """Prefills that fell back to the eager path with ``static_prefill`` on (the first one is logged)."""
        self.static_prefix_steps = 0
        """Prefix-hit prefills through the static prefill buffers (with ``static_prefill``)."""
        self.prefix_graph_steps = 0
        """Those of them that replayed a CUDA graph."""
        if options.static_prefill:
            pb, ps = max(self.prefill_batches), max(self.prefill_lengths)
            self._pf_host = [PrefillBuffers(pb, ps, "cpu", pin) for _ in range(2)]
            self._pf_dev = PrefillBuffers(pb, ps, self.device, False)
        self._prefill_tokens = HostTokens(model.num_slots, self.device)  # a prefill fills at most every slot
        self._prefill_graphs: dict[tuple[int, int], Graph] = {}
        self._prefix_graphs: dict[tuple[int, int], Graph] = {}
        self.mixed_tokens = tuple(sorted(set(options.mixed_prefill_tokens)))
        self.mixed_prompts = options.mixed_prefill_prompts
        self.mixed_lengths = options.mixed_lengths()
        self.mixed_steps = 0
        """Steps that ran as mixed steps (decode and prompts in one pass)."""
        if self.mixed_tokens:  # more prompts in a step would take the separate (slower) prefill
            self.max_prefill_prompts = min(self.max_prefill_prompts or self.mixed_prompts, self.mixed_prompts)
            # a mixed step's inputs (one copy): rows token, position, cache row, given (as the decode step's row 2)
            # over decode rows then prompt tokens; then the rows the head reads and the slots of the prompts
            width = top + max(self.mixed_tokens)
            self._mx_host = [torch.zeros((6, width), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
            self._mx_dev = torch.zeros((6, width), dtype=torch.int64, device=self.device)
        self._mixed_graphs: dict[tuple[int, int, int], Graph] = {}
        self.warmup_seconds: float | None = None
        self.start_phases: dict[str, float] = {}
        """Where the start went, in seconds: ``load`` (weights and compile cache, set by the loader), ``compile``
        (torch.compile during :meth:`warmup`), ``capture`` (the rest of the warm-up: CUDA graphs, first runs) and,
        once done, ``capture_after_ready`` (the graphs :meth:`capture_deferred` captured after ready)."""
        self.precompiled: Precompiled | None = None
        """The build's precompiled graphs, where they are the compiled pieces (set by the loader): no call compiles
        after load."""
        self._pools: dict[str, Any] = {}
        self._deferred: list[tuple[Kind, tuple[int, ...]]] = []
        """Buckets :meth:`warmup` left for :meth:`capture_deferred`, in capture order."""
        self._step_lock = threading.RLock()
        self._capture_thread: threading.Thread | None = None
        self._closing = False

    @classmethod
    def create(
        cls,
        config: dict[str, Any],
        state: dict[str, torch.Tensor],
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        options: SlotEngineOptions | None = None,
        compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ) -> TorchSlotEngine:
        """From an HF config dict and HF-named weights (``compile_fn``: see ``__init__``)."""
        opts = options or SlotEngineOptions()
        model = StaticKVDecoder.from_state_dict(
            config,
            state,
            num_slots=opts.num_slots,
            max_len=opts.max_len,
            dtype=DTYPES[opts.dtype],
            device=resolve_device(opts),
        )
        return cls(model, eos_token_ids, pad_token_id, opts, compile_fn)

    def _next_turn(self, kind: str) -> tuple[int, Callable[[], bool]]:
        """Which of the two staging buffers this step of ``kind`` uses, and a check that its outputs were not
        overwritten yet (by a later step of the same kind)."""
        self._launched[kind] += 1
        n = self._launched[kind]
        return n % 2, lambda: self._launched[kind] == n

    # ---- steps -------------------------------------------------------------------------------------------

    def _static_prefill(
        self, slots: list[int], prompts: list[list[int]], starts: list[int] | None = None
    ) -> StepLogits | None:
        """Prefill through the padded static buffers (a CUDA graph replay when captured, else the same step without
        one); None when the prompts fit no bucket (more prompts than the largest prefill bucket, or a longer one).
        ``starts``: the prompts are the rests of prompts whose first ``starts`` tokens their slots hold (a prefix-cache
        hit, :meth:`_prefill_from`), run as ``prefix`` steps attending over the whole slot; None also where a padded
        rest would pass the slot's end.

        Padding rows repeat the first prompt (and start) into its own slot: they write the same keys and values to the
        same places, and their logits are dropped; so a full engine (no free slot) still prefills through its graphs."""
        n, width = len(prompts), max(len(p) for p in prompts)
        if n > self.prefill_batches[-1] or width > self.prefill_lengths[-1]:
            return None
        nb, sb = bucket_for(n, self.prefill_batches), bucket_for(width, self.prefill_lengths)
        at_0 = starts or [0] * n
        if max(at_0) + sb > self.max_len:
            return None
        turn, valid = self._next_turn("prefill")
        host, dev = self._pf_host[turn], self._pf_dev
        tok, lens, rows, at = host.tokens.numpy(), host.lengths.numpy(), host.slots.numpy(), host.starts.numpy()
        tok[:nb, :sb] = self.pad_token_id
        for r, p in enumerate(prompts):
            tok[r, : len(p)] = p
        tok[n:nb, : len(prompts[0])] = prompts[0]
        lens[:n], rows[:n], at[:n] = [len(p) for p in prompts], slots, at_0
        lens[n:nb], rows[n:nb], at[n:nb] = len(prompts[0]), slots[0], at_0[0]
        dev.all[:nb].copy_(host.all[:nb], non_blocking=True)
        kind: Kind = "prefill" if starts is None else "prefix"
        graph = self._graph_table(kind).get((nb, sb))
        logits, best = replay_or_run(graph, self._step_for(kind, (nb, sb)))
        if kind == "prefix":
            self.static_prefix_steps += 1
            self.prefix_graph_steps += graph is not None
        return TorchLogits(logits, range(n), self._prefill_tokens.start(best, self.chaining), valid)

    @_under_step_lock
    def _prefill(self, slots: list[int], prompts: list[list[int]]) -> StepLogits:
        if self.options.static_prefill:
            out = self._static_prefill(slots, prompts)
            if out is not None:
                return out
            self.eager_prefills += 1
            if self.eager_prefills == 1:
                logger.warning(
                    "a prefill of %d prompts (longest %d tokens) is past the static prefill buckets %s x %s and runs "
                    "eagerly (slow: every stream waits); raise prefill_batch_buckets / prefill_length_buckets or cap "
                    "the scheduler's max_prefill_seqs",
                    len(prompts), max(map(len, prompts)), self.prefill_batches, self.prefill_lengths,
                )  # fmt: skip
        width = max(2, *(len(p) for p in prompts))
        ids = np.full((len(prompts), width), self.pad_token_id, dtype=np.int64)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = p
        dev = self.device
        _, valid = self._next_turn("prefill")
        with torch.inference_mode():  # pageable host arrays: each copy has taken its data when it returns
            logits, best = self._prefill_step(
                torch.from_numpy(ids).to(dev, non_blocking=True),
                torch.tensor([len(p) for p in prompts], dtype=torch.int64).to(dev),
                torch.tensor(slots, dtype=torch.int64).to(dev),
            )
        return TorchLogits(logits, range(len(prompts)), self._prefill_tokens.start(best, self.chaining), valid)

    @_under_step_lock
    def _prefill_from(self, slots: list[int], prompts: list[list[int]], starts: list[int]) -> StepLogits:
        """The rests of prompts whose first ``starts`` tokens their slots already hold: with ``prefix_graphs``
        through the static buffers (:meth:`_static_prefill`) where they fit, else eagerly, right-padded to the longest
        rest."""
        rests = [p[s:] for p, s in zip(prompts, starts, strict=True)]
        if self.options.static_prefill and self.options.prefix_graphs:
            out = self._static_prefill(slots, rests, starts)
            if out is not None:
                return out
        width = max(len(r) for r in rests)
        if width == 1 and max(starts) + 2 <= self.max_len:  # as prefill: no one-token graph specialised under load
            width = 2
        kv_len = max(s + width for s in starts)
        if kv_len > self.max_len:
            raise InputError(
                f"a prefill from positions {starts[:8]} over {width} tokens passes the slots' {self.max_len}",
                "report this (runner bug): a row that reuses a prefix must end at its prompt's end",
            )
        ids = np.full((len(rests), width), self.pad_token_id, dtype=np.int64)
        for r, rest in enumerate(rests):
            ids[r, : len(rest)] = rest
        dev = self.device
        _, valid = self._next_turn("prefill")
        with torch.inference_mode():  # pageable host arrays: each copy has taken its data when it returns
            rows = torch.tensor(slots, dtype=torch.int64).to(dev)
            logits = self.model.prefill_from(
                torch.from_numpy(ids).to(dev, non_blocking=True),
                torch.tensor([len(r) for r in rests], dtype=torch.int64).to(dev),
                rows,
                torch.tensor(starts, dtype=torch.int64).to(dev),
                kv_len,
            )
            best = logits.argmax(dim=-1)
            self._picked.index_copy_(0, rows, best)
        return TorchLogits(logits, range(len(prompts)), self._prefill_tokens.start(best, self.chaining), valid)

    def prefix_cache(self, block_size: int, budget_bytes: int) -> SlotPrefixKV:
        """A block pool of ``budget_bytes`` on this engine's device beside its slots (allocated now)."""
        from miaohui.generation.cache.slot_prefix import SlotPrefixKV

        return SlotPrefixKV(self.model.k_cache, self.model.v_cache, block_size, budget_bytes)

    def decode_rows(self, slots: Sequence[int]) -> int:
        """The batch bucket holding the highest slot: a decode step's rows are slots ``0 .. bucket-1``."""
        return bucket_for(max(slots) + 1, self.batch_buckets)

    @_under_step_lock
    def _decode(self, slots: list[int], tokens: list[int | None], positions: np.ndarray) -> StepLogits:
        b = self.decode_rows(slots)
        t = bucket_for(int(positions.max()) + 1, self.length_buckets)
        turn, valid = self._next_turn("decode")
        io = self._io_host[turn].numpy()
        fill_decode_rows(io[0], io[1], io[2], b, self.pad_token_id, slots, tokens, positions)
        self._io_dev.copy_(self._io_host[turn], non_blocking=True)  # whole (contiguous) buffer: 1.5 KB at 64 slots
        logits, best = replay_or_run(self._graphs.get((b, t)), lambda: self._decode_step(b, t))
        return TorchLogits(logits, slots, self._decode_tokens.start(best, self.chaining), valid)

    @_under_step_lock
    def _mixed(
        self,
        slots: list[int],
        tokens: list[int | None],
        positions: np.ndarray,
        new_slots: list[int],
        prompts: list[list[int]],
    ) -> tuple[StepLogits, StepLogits] | None:
        """The decode and the prefill as one mixed step (:mod:`~miaohui.generation.models.mixed_step`); None when mixed
        steps are off, the prompts fit no token bucket, or (with CUDA graphs) the bucket has no graph."""
        n, total = len(prompts), sum(len(p) for p in prompts)
        if not self.mixed_tokens or n > self.mixed_prompts or total > self.mixed_tokens[-1]:
            return None
        b = bucket_for(max(slots) + 1, self.batch_buckets)
        p = bucket_for(total, self.mixed_tokens)
        t = bucket_for(max(int(positions.max()) + 1, max(len(q) for q in prompts)), self.mixed_lengths)
        graph = self._mixed_graphs.get((b, p, t))
        if graph is None and self.graphs_on:
            return None
        turn, valid = self._next_turn("mixed")
        tok, pos, rows, given, out_rows, prompt_slots = self._mx_host[turn].numpy()
        scratch, k = self.model.scratch_row, b + self.mixed_prompts
        tok[b : b + p], pos[b : b + p], rows[: b + p] = self.pad_token_id, 0, scratch
        fill_decode_rows(tok, pos, given, b, self.pad_token_id, slots, tokens, positions)
        rows[slots] = slots
        out_rows[:k], prompt_slots[: self.mixed_prompts] = 0, scratch
        out_rows[:b] = np.arange(b)
        at = b
        for i, (slot, prompt) in enumerate(zip(new_slots, prompts, strict=True)):
            end = at + len(prompt)
            tok[at:end], pos[at:end], rows[at:end] = prompt, np.arange(len(prompt)), slot
            out_rows[b + i], prompt_slots[i] = end - 1, slot
            at = end
        self._mx_dev.copy_(self._mx_host[turn], non_blocking=True)
        logits, best = replay_or_run(graph, lambda: self._mixed_step(b, p, t))
        self.mixed_steps += 1
        decode = TorchLogits(logits, slots, self._decode_tokens.start(best[:b], self.chaining), valid)
        prefill = TorchLogits(logits[b:], range(n), self._prefill_tokens.start(best[b : b + n], self.chaining), valid)
        return decode, prefill

    def close(self) -> None:
        """Drop the graphs and free the engine's own buffers now (the KV cache: GBs at a GPU server's sizes); the
        engine cannot step after it (a capture after ready still running stops first). Freed in place (each buffer's
        storage emptied), not left to whoever drops the last reference: a stopped version's engine is still held by
        reference cycles (its loop, asyncio futures, frames) that only Python's next full collection frees, so a server
        that swapped or unloaded a version, or a test that stopped one, kept its KV cache until then. The weights are
        left to the garbage collector: an engine made with :meth:`StaticKVDecoder.from_hf` shares them with the live
        HF model. Idempotent."""
        self._closing = True
        if self._capture_thread is not None and self._capture_thread is not threading.current_thread():
            self._capture_thread.join()
        self._deferred.clear()
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._prefix_graphs.clear()
        self._mixed_graphs.clear()
        with torch.no_grad():
            for t in self.model.buffers():
                t.untyped_storage().resize_(0)
