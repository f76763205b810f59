"""Options of the static-KV (slot) generation engine; no torch here, so configs load without it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

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
    decode_attention: Literal["matmul", "sdpa", "flex"] = "matmul"
    """Decode's attention over the cache: two batched matmuls and a softmax (``matmul``), one
    ``scaled_dot_product_attention`` call (``sdpa``) or FlexAttention (``flex``: compiled, Inductor's
    flash-decoding kernel). H200, 1.5B shape, batch 64: sdpa 2.43 vs matmul 2.51 ms per step (session 9); flex not
    measured yet, so ``matmul`` stays the default."""
    decode_layer: Literal["split", "fused"] = "split"
    """``split``: each layer's two compiled halves (RMSNorm→QKV→RoPE; attention→MLP) around eager ``index_copy_``
    cache writes, 4 launches per layer outside compiled code; ``fused``: the whole layer, cache write included (an
    in-place ``index_put_``), in one compiled graph. Not measured on a GPU yet, so ``split`` stays the default; not
    with ``decode_attention: flex``."""
    batch_buckets: tuple[int, ...] = ()
    """Decode batch sizes (default: powers of two up to num_slots, and num_slots)."""
    length_buckets: tuple[int, ...] = ()
    """Attended cache lengths (default: 128, 256, ... up to max_len, and max_len)."""

    static_prefill: bool = False
    """Prefill on static buffers padded to (prompts, prompt length) buckets, one CUDA graph per bucket on a GPU:
    one replay instead of ~20 kernel launches per layer from Python (an eager prefill of one 128-token prompt kept
    the 1.5B engine's thread launching kernels for 17 % of its time under 64 streams). Off by default: built
    without GPU time, so not yet measured there. On a CPU the same padded path runs eagerly (tests)."""
    prefill_batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    """Prompts per static prefill; more new prompts in one step are prefilled eagerly."""
    prefill_length_buckets: tuple[int, ...] = ()
    """Padded prompt lengths (default: 16, 32, ... up to max_len); longer prompts are prefilled eagerly."""

    @model_validator(mode="after")
    def _fused_layer_attention(self) -> SlotEngineOptions:
        if self.decode_layer == "fused" and self.decode_attention == "flex":
            raise ConfigError(
                "decode_layer 'fused' does not take decode_attention 'flex'",
                "use decode_attention matmul or sdpa with the fused layer, or decode_layer split",
            )
        return self

    def prefill_buckets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        lengths = self.prefill_length_buckets or _powers(16, self.max_len)
        return tuple(sorted(set(self.prefill_batch_buckets))), tuple(sorted(set(lengths)))

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
