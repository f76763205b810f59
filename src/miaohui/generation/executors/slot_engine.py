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
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar

import numpy as np
import torch

from miaohui.engines.graph_capture import capturing, compiles_so_far
from miaohui.errors import InputError
from miaohui.generation.executors.base import SlotCausalLMEngine, StepLogits
from miaohui.generation.executors.compile_clock import CompileClock, cache_counters
from miaohui.generation.executors.slot_options import SlotEngineOptions, bucket_for
from miaohui.generation.executors.slot_steps import (
    DTYPES,
    Graph,
    HostTokens,
    Outputs,
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
    from miaohui.generation.cache.slot_prefix import SlotPrefixKV

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Kind = Literal["decode", "prefill", "mixed"]


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


class TorchSlotEngine(SlotCausalLMEngine):
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
        if options.static_prefill:
            pb, ps = max(self.prefill_batches), max(self.prefill_lengths)
            self._pf_host = [PrefillBuffers(pb, ps, "cpu", pin) for _ in range(2)]
            self._pf_dev = PrefillBuffers(pb, ps, self.device, False)
        self._prefill_tokens = HostTokens(model.num_slots, self.device)  # a prefill fills at most every slot
        self._prefill_graphs: dict[tuple[int, int], Graph] = {}
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
        self.precompiled_graphs = False
        """The compiled pieces are the build's precompiled graphs (set by the loader): no call compiles after load."""
        self._pools: dict[str, Any] = {}
        self._deferred: list[tuple[_Kind, tuple[int, ...]]] = []
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

    # ---- warm-up / capture -----------------------------------------------------------------------------

    @property
    def defers_capture(self) -> bool:
        """Whether :meth:`warmup` with ``defer`` may leave graphs for after ready: CUDA graphs on, and no compile can
        follow the load (the build's precompiled graphs, or compile off), so a bucket without its graph yet runs the
        same kernels, not a compile under load."""
        return self.graphs_on and (self.precompiled_graphs or not self.compiled)

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
        keep: Callable[[_Kind, int, int], bool] = lambda kind, rows, tokens: True  # noqa: E731
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
            f"{len(self._prefill_graphs)} prefill and {len(self._mixed_graphs)} mixed CUDA graphs, "
            f"compile={'on' if self.compiled else 'off'} ({clock.compiles} compiles, {clock.seconds:.1f}s{counted}), "
            f"graphs and first runs {self.start_phases['capture']:.1f}s"
            + (f"; {len(self._deferred)} graphs left for after ready" if self._deferred else "")
        )
        return self.warmup_seconds

    def _capture(self, log: Callable[[str], None], keep: Callable[[_Kind, int, int], bool]) -> None:
        pool = self._pools["decode"] = torch.cuda.graph_pool_handle()
        self._decode_inputs()
        later: list[tuple[_Kind, tuple[int, ...]]] = []
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

    def _mixed_inputs(self) -> None:
        """The static mixed-step inputs for a warm run or capture: every row a padding row (pad token, position 0,
        the scratch cache row)."""
        io = self._mx_dev
        io.zero_()
        io[0].fill_(self.pad_token_id)
        io[2].fill_(self.model.scratch_row)
        io[3].fill_(1)
        io[5].fill_(self.model.scratch_row)

    def _step_for(self, kind: _Kind, key: tuple[int, ...]) -> Callable[[], Outputs]:
        """The static step of bucket ``key`` of ``kind`` over the engine's static inputs."""
        if kind == "decode":
            return functools.partial(self._decode_step, *key)
        if kind == "mixed":
            return functools.partial(self._mixed_step, *key)
        buf, (n, s) = self._pf_dev, key
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

    def _graph_table(self, kind: _Kind) -> dict[Any, Graph]:
        if kind == "decode":
            return self._graphs
        return self._prefill_graphs if kind == "prefill" else self._mixed_graphs

    def _isolated_warm_run(self, kind: _Kind, step: Callable[[], Outputs]) -> None:
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
        elif kind == "prefill":
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
        isolate: _Kind | None = None,
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

    def _capture_prefill(self, log: Callable[[str], None], keep: Callable[[_Kind, int, int], bool]) -> None:
        """One CUDA graph per (prompts, prompt length) prefill bucket over the static prefill buffers. Capture
        runs write the pad token's K/V into slot 0's rows, which hold no sequence during warm-up."""
        pool = self._pools["prefill"] = torch.cuda.graph_pool_handle()
        self._prefill_inputs(0)
        later: list[tuple[_Kind, tuple[int, ...]]] = []
        for n in sorted(self.prefill_batches, reverse=True):
            for s in sorted(self.prefill_lengths, reverse=True):
                if not keep("prefill", n, n * s):
                    later.append(("prefill", (n, s)))
                    continue
                self._prefill_graphs[(n, s)] = self._capture_one(self._step_for("prefill", (n, s)), pool)
        self._deferred += reversed(later)
        log(f"captured {len(self._prefill_graphs)} prefill graphs")

    def _capture_mixed(self, log: Callable[[str], None], keep: Callable[[_Kind, int, int], bool]) -> None:
        """One CUDA graph per (batch, length, prompt tokens) bucket over the static mixed-step inputs: every row a
        padding row (pad token, position 0, the scratch cache row)."""
        pool = self._pools["mixed"] = torch.cuda.graph_pool_handle()
        self._mixed_inputs()
        later: list[tuple[_Kind, tuple[int, ...]]] = []
        for b in sorted(self.batch_buckets, reverse=True):
            for t in sorted(self.mixed_lengths, reverse=True):
                for p in sorted(self.mixed_tokens, reverse=True):
                    if not keep("mixed", b, p):
                        later.append(("mixed", (b, p, t)))
                        continue
                    self._mixed_graphs[(b, p, t)] = self._capture_one(self._step_for("mixed", (b, p, t)), pool)
        self._deferred += reversed(later)
        log(f"captured {len(self._mixed_graphs)} mixed-step graphs")

    def _next_turn(self, kind: str) -> tuple[int, Callable[[], bool]]:
        """Which of the two staging buffers this step of ``kind`` uses, and a check that its outputs were not
        overwritten yet (by a later step of the same kind)."""
        self._launched[kind] += 1
        n = self._launched[kind]
        return n % 2, lambda: self._launched[kind] == n

    # ---- steps -------------------------------------------------------------------------------------------

    def _static_prefill(self, slots: list[int], prompts: list[list[int]]) -> StepLogits | None:
        """Prefill through the padded static buffers (a CUDA graph replay when captured); None when the prompts
        fit no bucket (more prompts than the largest prefill bucket, or a longer one).

        Padding rows repeat the first prompt into its own slot: they write the same keys and values to the same
        places, and their logits are dropped; so a full engine (no free slot) still prefills through its graphs."""
        n, width = len(prompts), max(len(p) for p in prompts)
        if n > self.prefill_batches[-1] or width > self.prefill_lengths[-1]:
            return None
        nb, sb = bucket_for(n, self.prefill_batches), bucket_for(width, self.prefill_lengths)
        turn, valid = self._next_turn("prefill")
        host, dev = self._pf_host[turn], self._pf_dev
        tok, lens, rows = host.tokens.numpy(), host.lengths.numpy(), host.slots.numpy()
        tok[:nb, :sb] = self.pad_token_id
        for r, p in enumerate(prompts):
            tok[r, : len(p)] = p
        tok[n:nb, : len(prompts[0])] = prompts[0]
        lens[:n], rows[:n] = [len(p) for p in prompts], slots
        lens[n:nb], rows[n:nb] = len(prompts[0]), slots[0]
        dev.all[:nb].copy_(host.all[:nb], non_blocking=True)
        logits, best = replay_or_run(
            self._prefill_graphs.get((nb, sb)),
            lambda: self._prefill_step(dev.tokens[:nb, :sb], dev.lengths[:nb], dev.slots[:nb]),
        )
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
        """The rests of prompts whose first ``starts`` tokens their slots already hold (eagerly: the static prefill
        graphs and mixed steps start every prompt at position 0), right-padded to the longest rest."""
        rests = [p[s:] for p, s in zip(prompts, starts, strict=True)]
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

    @_under_step_lock
    def _decode(self, slots: list[int], tokens: list[int | None], positions: np.ndarray) -> StepLogits:
        b = bucket_for(max(slots) + 1, self.batch_buckets)
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
        self._mixed_graphs.clear()
        with torch.no_grad():
            for t in self.model.buffers():
                t.untyped_storage().resize_(0)
