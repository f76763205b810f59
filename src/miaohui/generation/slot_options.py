"""Options of the static-KV (slot) generation engine; no torch here, so configs load without it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from miaohui.config import Frozen
from miaohui.errors import ConfigError

FUSED_ATTENTIONS = ("matmul", "triton")
"""The decode attentions the fused decode layer takes."""


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
    decode_attention: Literal["matmul", "sdpa", "flex", "triton"] = "triton"
    """Decode's attention over the cache: two batched matmuls and a softmax (``matmul``), one
    ``scaled_dot_product_attention`` call (``sdpa``) or FlexAttention (``flex``: compiled, Inductor's
    flash-decoding kernel). H200, 1.5B shape, CUDA graphs at (batch 64, 256 positions), session 10
    (``decode_whole_step_h200_s10a.json``): matmul 2.68 ms, sdpa 2.71 (cuDNN's kernel is faster than the two matmuls
    and the softmax, 268 vs 393 µs, but the step is not), flex 4.83 (its kernel alone 2.5 ms); ``matmul`` stayed then.
    ``triton`` (the default since session 18): miaohui's split-KV decode kernels
    (:mod:`miaohui.generation.decode_attention`: two kernels instead of three, each row's cache read only up to its
    position; takes the fused layer; on the CPU, or a head size that is not a power of two, its op computes the matmul
    form). H200, 1.5B shape, ``int8_batch1``, the same call (``run_h200.sh s19a``): graph step at batch 1 1.261 →
    **1.126 ms**, at batch 64 2.400 → **2.217 ms** (``profile_decode_int8b1_matmulattn_h200_s19a.json`` and the log);
    per layer 7.4 → 4.5 µs at batch 1 × 512, 12.5 → 9.6 at 64 × 256 (``decode_attention_probe_h200_s19{a,b}.json``),
    half the matmul form's error against fp32."""
    decode_layer: Literal["split", "fused"] = "fused"
    """``fused``: a whole decode layer, cache write included (an in-place ``index_put_`` fused into the RoPE kernel),
    one compiled graph; ``split``: each layer's two compiled halves (RMSNorm→QKV→RoPE; attention→MLP) around eager
    ``index_copy_`` cache writes. Default: ``fused`` with the matmul or triton attention, ``split`` when
    ``decode_attention`` is sdpa or flex (with sdpa the fused graph failed Inductor's stride check on the H200,
    torch 2.11, ``gpu_tests_slot_engine_fused_h200_s10e.txt``). H200, 1.5B shape: fused is 4–9 % faster in every
    one of the 28 captured decode graphs (``decode_buckets_h200_s10f.json``; batch 64 × 256: 2.34 vs 2.55 ms;
    batch 1: 1.92 vs 2.02), and through the async server, split / fused / split / fused in one call, 20 s each
    (``generation_gpu_qwen1.5b_server_s12a_*.json``): 16,434 / **16,777** / 15,968 / **16,192** tok/s (with
    ``int8_batch1`` on the fused side, ``…_s11f_*``: +4.5–5 %)."""
    int8_batch1: bool = False
    """Weight-only int8 for decode steps of one row: an int8 copy of the layers' GEMM weights and the LM head
    (per-output-row scales, +50 % weight memory) that batch-1 graphs read instead of the model-dtype weights, through
    ``int8_kernel`` (below; ``inductor``: compiled with Inductor's coordinate-descent tuning, one Triton reduction per
    GEMM reading the int8 bytes, gpt-fast's int8 recipe). H200, 1.5B shape, GEMMs of one step at one row
    (``decode_quant_probe_h200_s11d.json``): 1.27 ms cuBLAS bf16 → 0.87 ms (Inductor), 0.78 (gemv). Steps of 2+ rows
    keep the model-dtype weights (int8 there was 2× slower), so a sequence's tokens may differ with whether it decoded
    alone. Off by default."""
    int8_kernel: Literal["inductor", "gemv", "gemv_fused", "gemv_layer"] = "gemv_layer"
    """Which kernel reads the int8 copy in steps of one row: ``gemv_layer`` (the default; ``gemv`` when
    ``int8_batched`` is on, whose steps would read the folded copies), ``gemv_fused``, ``gemv`` or ``inductor``.
    ``gemv`` is miaohui's matrix-vector kernel (:func:`miaohui.generation.w8a16.w8_gemv`, one configuration per weight
    shape measured by ``scripts/gpu/gemv_sweep.py``; opaque to Inductor, so the RMSNorm and SiLU·up before it are
    kernels of their own); ``gemv_fused`` is the same kernel also taking the RMS of its input (the RMSNorm's weight
    folded into the QKV and gate/up copies) and adding the residual after O and down; ``gemv_layer`` is gemv_fused
    with the QKV kernel also applying RoPE and writing the key/value into the cache and the gate/up kernel writing
    ``silu(gate) · up`` (:mod:`miaohui.generation.w8_layer`: six kernels per layer, not nine); ``inductor`` is the
    coordinate-descent Triton reduction above, with the norm and SiLU·up fused in. H200, 1.5B shape, batch-1 graph
    step: inductor 1.65 ms (``profile_decode_int8b1_graph_h200_s17c.json``), gemv 1.37 / 1.36 ms (382 kernels;
    ``…_gemv_h200_s17d.json``, ``…_s18a``), gemv_fused 1.27 ms (298 kernels; ``…_gemvfused_h200_s18a.json``); with
    the triton attention (session 19, ``run_h200.sh s20a``, attended bucket 256) gemv_fused 1.115 ms (265 kernels) →
    gemv_layer **0.999 ms** (181 kernels; ``profile_decode_int8b1_gemvlayer_h200_s20a.json``); TPOT at one stream
    (``s20b``, ``generation_gpu_qwen1.5b_int8b1_gemv{fused,layer}_h200_s20b.json``) 1.283 → **1.084 ms** through
    synchronous scheduler steps, 1.134 → **1.023 ms** through the async engine thread."""
    int8_batched: bool = False
    """Weight-only int8 for decode steps of 2+ rows: the same int8 copy, read through miaohui's Triton GEMM
    (``miaohui.generation.w8a16``; Inductor's int8 form was 2× slower than cuBLAS bf16 there). **Measured slower than
    bf16**: the step's GEMMs on the H200 (``decode_quant_probe_h200_s12b.json``, 28 layers + LM head, L2-cold) at 8
    rows 1,219 µs vs cuBLAS bf16 1,203, at 64 rows 1,884 vs 1,276 (its gate/up and LM head win at ≤ 8 rows, the
    down projection's long K loses: one program per output tile walks all 8,960). Kept, off, for kernel work; the
    GPU test passes (``gpu_tests_slot_engine_int8_h200_s12.txt``)."""
    batch_buckets: tuple[int, ...] = ()
    """Decode batch sizes (default: powers of two up to num_slots, and num_slots)."""
    length_buckets: tuple[int, ...] = ()
    """Attended cache lengths (default: 128, 256, ... up to max_len, and max_len)."""

    static_prefill: bool = False
    """Prefill on static buffers padded to (prompts, prompt length) buckets, one CUDA graph per bucket on a GPU:
    one replay instead of ~20 kernel launches per layer from Python (an eager prefill of one 128-token prompt kept
    the 1.5B engine's thread launching kernels for 17 % of its time under 64 streams). Every 1.5B server figure since
    session 7 has it on (``bench_generation_gpu.py --static-prefill``); off by default, where it costs padding and
    capture time for nothing (CPU engines, batch jobs). With it the engine caps the scheduler's prefills at the largest
    prompts bucket (:attr:`~miaohui.generation.base.SlotCausalLMEngine.max_prefill_prompts`). On a CPU the same
    padded path runs eagerly (tests)."""
    prefill_batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    """Prompts per static prefill; more new prompts in one step are prefilled eagerly."""
    prefill_length_buckets: tuple[int, ...] = ()
    """Padded prompt lengths (default: 16, 32, ... up to max_len); longer prompts are prefilled eagerly."""

    mixed_prefill_tokens: tuple[int, ...] = (128, 256, 512)
    """Mixed steps (:mod:`miaohui.generation.mixed_step`): when a step both decodes and takes new prompts, the
    prompts' tokens run as extra rows of the decode step (one pass over the weights, not two; vLLM's chunked-prefill
    idea), padded to the smallest of these token counts that holds them; one CUDA graph per (batch, length, token)
    bucket. Prompts that fit no bucket (or more than ``mixed_prefill_prompts``) take the separate prefill; empty:
    off. H200, 1.5B shape (``run_h200.sh s21b``–``s21e``): a 64-row decode step 2.05 ms, one 128-token prompt's own
    prefill 2.4 ms, the two as one mixed step 2.8 ms (64 + 256 tokens: 3.7); through the async server (64 streams,
    int8_batch1, static prefill) 21,921 / 22,673 / **24,483** tok/s with TTFT p99 45 / 30 / 20 ms against 19,073–21,212
    without (``generation_gpu_qwen1.5b_server_*_s21{a,c,e}.json``)."""
    mixed_prefill_prompts: int = Field(default=4, ge=1, le=64)
    """The most prompts one mixed step takes."""

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        if data.get("decode_layer") is None:
            fusable = data.get("decode_attention", "triton") in FUSED_ATTENTIONS
            data = {**data, "decode_layer": "fused" if fusable else "split"}
        if data.get("int8_kernel") is None:
            data = {**data, "int8_kernel": "gemv" if data.get("int8_batched") else "gemv_layer"}
        return data

    @model_validator(mode="after")
    def _fused_layer_attention(self) -> SlotEngineOptions:
        if self.decode_layer == "fused" and self.decode_attention not in FUSED_ATTENTIONS:
            raise ConfigError(
                f"decode_layer 'fused' does not take decode_attention {self.decode_attention!r}",
                "use decode_attention matmul or triton with the fused layer, or decode_layer split",
            )
        if self.int8_kernel in ("gemv_fused", "gemv_layer") and self.int8_batched:
            raise ConfigError(
                f"int8_kernel {self.int8_kernel!r} folds the RMSNorm weights into the int8 copy that int8_batched's "
                "steps would also read",
                "use int8_kernel gemv with int8_batched, or int8_batched false",
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
