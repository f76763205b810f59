"""Options of the static-KV (slot) generation engine; no torch here, so configs load without it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from miaohui.config import Frozen
from miaohui.errors import ConfigError


class SlotEngineOptions(Frozen):
    """How a static-KV engine is laid out and run (``generation.yaml`` → ``engine:``)."""

    num_slots: int = Field(default=64, ge=1, le=4096)
    """KV cache rows = most sequences decoding at once (the scheduler's max_running_seqs is capped to it)."""
    max_len: int = Field(default=2048, ge=16)
    """Tokens (prompt + output) one slot holds."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    device: str = "auto"
    """``auto``: ``cuda`` when available, else ``cpu`` (eager, for tests)."""
    compile: bool | None = None
    """Compile decode/prefill with Inductor (default: on CUDA only)."""
    cuda_graphs: bool | None = None
    """One CUDA graph per (batch, length) bucket for decode (default: on CUDA only)."""
    autotune: bool = False
    """Inductor ``max-autotune-no-cudagraphs`` for decode (slower warm-up, sometimes faster steps)."""
    decode_attention: Literal["matmul", "triton"] = "triton"
    """Decode's attention over the cache. ``triton`` (default): miaohui's split-KV decode kernels
    (:mod:`miaohui.generation.kernels.decode_attention`), which read each row's cache only up to its position; faster
    than the matmul form at every batch measured on the H200. ``matmul``: two batched matmuls around a softmax over the
    whole attended-length bucket, the reference form. On the CPU, or with a head size that is not a power of two, the
    triton op computes the matmul form."""
    int8_batch1: bool = False
    """Weight-only int8 for decode steps of one row: an int8 copy of the layers' GEMM weights and the LM head
    (per-output-row scales, +50 % weight memory) that batch-1 graphs read through ``int8_kernel`` instead of the
    model-dtype weights, so a lone stream reads half the weight bytes per token. Steps of 2+ rows keep the
    model-dtype weights, so a sequence's tokens may differ with whether it decoded alone: off by default."""
    int8_kernel: Literal["inductor", "gemv_layer"] = "gemv_layer"
    """The kernels that read the int8 copy in steps of one row. ``gemv_layer`` (default, the faster on the H200):
    miaohui's one-row Triton kernels (:mod:`miaohui.generation.kernels.w8_layer`) with the RMSNorms folded in, the QKV
    kernel also applying RoPE and writing the key/value into the cache, the gate/up kernel writing ``silu(gate) · up``
    and the O/down kernels adding the residual: six kernels per layer. ``inductor``: the dequantizing ``F.linear``
    compiled by Inductor with coordinate-descent tuning into one Triton reduction per GEMM (gpt-fast's recipe), the
    reference form."""
    batch_buckets: tuple[int, ...] = ()
    """Decode batch sizes (default: powers of two up to num_slots, and num_slots)."""
    length_buckets: tuple[int, ...] = ()
    """Attended cache lengths (default: 128, 256, ... up to max_len, and max_len)."""

    static_prefill: bool = False
    """Prefill on static buffers padded to (prompts, prompt length) buckets, one CUDA graph per bucket on a GPU: one
    replay instead of ~20 kernel launches per layer from Python, which otherwise keep a GPU server's engine thread
    busy under many streams. Off by default, where it costs padding and capture time for nothing (CPU engines, batch
    jobs); the GPU server benchmarks turn it on (``bench_generation_gpu.py --static-prefill``). With it the engine
    caps the scheduler's prefills at the largest prompts bucket
    (:attr:`~miaohui.generation.executors.base.SlotCausalLMEngine.max_prefill_prompts`). On a CPU the same padded path
    runs eagerly (tests)."""
    prefill_batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    """Prompts per static prefill; more new prompts in one step are prefilled eagerly."""
    prefill_length_buckets: tuple[int, ...] = ()
    """Padded prompt lengths (default: 16, 32, ... up to max_len); longer prompts are prefilled eagerly."""

    mixed_prefill_tokens: tuple[int, ...] = (128, 256, 512)
    """Mixed steps (:mod:`miaohui.generation.models.mixed_step`): when a step both decodes and takes new prompts, the
    prompts' tokens run as extra rows of the decode step (one pass over the weights, not two; vLLM's chunked-prefill
    idea), padded to the smallest of these token counts that holds them; one CUDA graph per (batch, length, token)
    bucket. Prompts that fit no bucket (or more than ``mixed_prefill_prompts``) take the separate prefill; empty: off.
    On by default: on the H200 a mixed step costs less than a decode step plus a prefill, and a server's throughput
    and TTFT both improve."""
    mixed_prefill_prompts: int = Field(default=4, ge=1, le=64)
    """The most prompts one mixed step takes."""
    mixed_length_buckets: tuple[int, ...] = ()
    """Attended cache lengths of mixed steps (default: ``max_len`` only, one graph per (batch, tokens) bucket). The
    decode kernel reads each row's cache only up to its position, so a longer bucket costs a mixed step little
    (empty slices of the split-KV grid), while every length bucket multiplies the graphs captured at load: with the
    decode steps' five lengths at 64 slots, 105 mixed graphs instead of 21."""

    prefix_graphs: bool = True
    """With ``static_prefill``: a prefix-cache hit's rest (a prompt whose first tokens its slot already holds) runs
    through the static prefill buffers, attending over the whole slot, as one CUDA graph per (prompts, padded rest)
    bucket up to 512 tokens, captured after ready; ``false``: such a rest runs eagerly, attending only up to its end.
    On by default: a conversation's next turn is the common case of a chat server, and run eagerly a 50-token rest
    after a 2,000-token history cost as much as prefilling the whole conversation (``bench_prefix_cache_gpu.py``:
    the graphs' outputs equal the engine's without a cache, ``tests/gpu/test_slot_engine_gpu.py``)."""

    capture_after_ready: bool = True
    """Serve a GPU version before all its CUDA graphs are captured: ``serve`` captures the buckets a start's first
    requests use (:meth:`before_ready`) before the version reports ready, and the rest on a background thread after it
    (``miaohui_model_start_seconds{phase="engine_capture_after_ready"}``). Until a bucket's graph exists, a step of
    that shape runs the same compiled kernels without a graph (slower per step, the same tokens); a step that would mix
    decode and prompts runs as a decode step and a prefill. Used only where the build's precompiled graphs load (no
    compile can happen after ready); ``false``: every graph before ready."""
    ready_rows: int = Field(default=4, ge=1)
    """Before ready (with ``capture_after_ready``): decode graphs of up to this many rows, prefill graphs of up to this
    many prompts."""
    ready_tokens: int = Field(default=512, ge=16)
    """Before ready (with ``capture_after_ready``): decode graphs attending up to this many positions, prefill graphs
    of up to this many tokens in all (prompts x padded length)."""

    def before_ready(self, kind: Literal["decode", "prefill", "prefix", "mixed"], rows: int, tokens: int) -> bool:
        """Whether ``serve`` captures this bucket before ready when graphs may follow after it: decode (``rows``
        batch, ``tokens`` attended length) and prefill (``rows`` prompts, ``tokens`` = prompts x padded length) within
        ``ready_rows`` / ``ready_tokens``; mixed steps and prefix-hit prefills never (a step without its mixed graph
        runs as decode + prefill, both from graphs captured before ready; a prefix hit before its graph runs its step
        without one)."""
        if kind in ("mixed", "prefix"):
            return False
        return rows <= self.ready_rows and tokens <= self.ready_tokens

    def prefill_buckets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        lengths = self.prefill_length_buckets or _powers(16, self.max_len)
        return tuple(sorted(set(self.prefill_batch_buckets))), tuple(sorted(set(lengths)))

    def mixed_lengths(self) -> tuple[int, ...]:
        lengths = tuple(sorted(set(self.mixed_length_buckets or (self.max_len,))))
        if lengths[-1] < self.max_len:
            raise ConfigError(
                f"mixed_length_buckets {lengths} do not reach max_len={self.max_len}",
                "make the largest mixed length bucket max_len, or leave mixed_length_buckets empty",
            )
        return lengths

    def buckets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        batch = self.batch_buckets or _powers(1, self.num_slots)
        length = self.length_buckets or _powers(128, self.max_len)
        if max(batch) < self.num_slots or max(length) < self.max_len:
            raise ConfigError(
                f"buckets batch={batch} length={length} do not reach num_slots={self.num_slots} / "
                f"max_len={self.max_len}",
                "make the largest batch bucket num_slots and the largest length bucket max_len",
            )
        return tuple(sorted(set(batch))), tuple(sorted(set(length)))


def _powers(start: int, top: int) -> tuple[int, ...]:
    out, v = [], start
    while v < top:
        out.append(v)
        v *= 2
    return (*out, top)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ConfigError(f"{n} is over the largest bucket {buckets[-1]}", "raise num_slots / max_len")
