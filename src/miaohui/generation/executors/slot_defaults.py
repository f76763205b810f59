"""What a GPU decoder runs with when its model has no ``generation.yaml``: slots, buckets, token budget and the
loop's flags, chosen from the model's dims and the GPU's memory (a pure function: no torch, testable anywhere); on a
CPU, slots and length from the server's scheduler, within a share of the machine's memory (:func:`choose_cpu_defaults`).

The flags are those ``docs/gpu.md``'s best H200 configuration uses (``static_prefill``, ``async_scheduling``,
``max_batched_tokens: 4096``, as many running sequences as slots). ``int8_batch1`` changes the numbers a model
computes, so it is on only where the decoder gate passed on it (``int8_gate_passed``): ``miaohui validate NAME`` runs
the gate a second time with the engine's int8 batch-1 weights and stores the result in the version's
``causal_lm.json`` (``validation["int8_batch1"]``, read by :func:`int8_gate_passed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miaohui.errors import ConfigError
from miaohui.generation.executors.slot_options import SlotEngineOptions

MAX_SLOTS = 64
"""Most KV slots chosen: the 64 streams of the best measured configuration."""
HEADROOM = 0.25
"""Share of the GPU's memory left for activations, CUDA graphs' pools and the allocator."""
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
CPU_KV_SHARE = 0.25
"""Most of the machine's memory a CPU decoder's KV cache is given when its model has no ``generation.yaml``."""
MAX_CPU_SLOTS = 4096
"""``SlotEngineOptions.num_slots``' bound."""


@dataclass(frozen=True)
class ServeDefaults:
    """The engine options and the scheduler fields chosen (``scheduler``: SchedulerConfig keyword arguments)."""

    engine: SlotEngineOptions
    scheduler: dict[str, Any]
    reason: str
    """One line for the log and the manifest: what was chosen and why."""


def int8_gate_passed(validation: dict[str, Any] | None) -> bool:
    """Whether a version's stored decoder gate result (``causal_lm.json``'s ``validation``) passed with the engine's
    int8 batch-1 weights (:class:`~miaohui.validate.decoder_gate.Int8GateResult`). No result, a failed one or one
    that could not run: False."""
    int8 = (validation or {}).get("int8_batch1")
    return isinstance(int8, dict) and int8.get("passed") is True


def choose_defaults(
    dims: dict[str, Any], gpu_memory_bytes: int, precision: str = "bf16", int8_gate_passed: bool = False
) -> ServeDefaults:
    """Slots and lengths that fit ``gpu_memory_bytes`` next to the weights; ConfigError when not even one slot does.

    ``dims``: :class:`~miaohui.generation.models.dims.DecoderDims` fields (hidden, layers, kv heads, head dim,
    intermediate, vocab, max_positions)."""
    size = BYTES[precision]
    hidden, layers, vocab = int(dims["hidden"]), int(dims["num_layers"]), int(dims["vocab"])
    kv_width = int(dims["num_kv_heads"]) * int(dims["head_dim"])
    heads_width = int(dims["num_heads"]) * int(dims["head_dim"])
    per_layer = hidden * (heads_width + 2 * kv_width) + heads_width * hidden + 3 * hidden * int(dims["intermediate"])
    weights = (layers * per_layer + 2 * vocab * hidden) * size
    if int8_gate_passed:
        weights += weights // 4  # the int8 copy: half the bytes of the bf16 weights it mirrors
    max_len = min(2048, int(dims["max_positions"]))
    per_slot = kv_bytes_per_slot(dims, max_len, precision)
    room = int(gpu_memory_bytes * (1 - HEADROOM)) - weights
    slots = MAX_SLOTS
    while slots >= 1 and slots * per_slot > room:
        slots //= 2
    if slots < 1:
        raise ConfigError(
            f"the model's weights ({weights / 2**30:.1f} GiB) and one KV slot of {max_len} tokens "
            f"({per_slot / 2**30:.2f} GiB) do not fit {gpu_memory_bytes / 2**30:.1f} GiB of GPU memory",
            "use a GPU with more memory, or set engine.max_len lower in the model's generation.yaml",
        )
    engine = SlotEngineOptions(
        num_slots=slots, max_len=max_len, dtype=precision,  # type: ignore[arg-type]  # a key of BYTES
        static_prefill=True, int8_batch1=int8_gate_passed,
    )  # fmt: skip
    scheduler = {"max_running_seqs": slots, "max_batched_tokens": 4096, "async_scheduling": True}
    reason = (
        f"{slots} slots x {max_len} tokens ({slots * per_slot / 2**30:.1f} GiB KV, weights {weights / 2**30:.1f} GiB "
        f"of {gpu_memory_bytes / 2**30:.0f} GiB), static prefill, async scheduling, 4096 tokens a step, "
        f"int8 at batch 1 {'on (the decoder gate passed on it)' if int8_gate_passed else 'off (no gate passed on it)'}"
    )
    return ServeDefaults(engine, scheduler, reason)


def kv_bytes_per_slot(dims: dict[str, Any], max_len: int, precision: str) -> int:
    """One slot's KV cache: keys and values of every layer for ``max_len`` tokens."""
    return 2 * int(dims["num_layers"]) * int(dims["num_kv_heads"]) * int(dims["head_dim"]) * max_len * BYTES[precision]


def choose_cpu_defaults(
    dims: dict[str, Any], memory_bytes: int, precision: str, max_running_seqs: int, max_model_len: int
) -> ServeDefaults:
    """A decoder served on the CPU without a ``generation.yaml``: as many slots as the scheduler runs sequences
    (``max_running_seqs``) and slots of ``max_model_len`` tokens (at most the model's positions), halving the slots
    until the KV cache fits :data:`CPU_KV_SHARE` of ``memory_bytes`` (the machine's memory); ConfigError when not
    even one slot does.

    Why not the engine's own defaults (64 slots x 2048 tokens, sized for a GPU server): the static cache is allocated
    whole when the engine loads, and on a CPU it is in the model's precision, often fp32; SmolLM2-135M's fp32 KV is
    46 KB a token, so those defaults took 6 GB of RAM per loaded version (twice that while a version is swapped for
    another) for a scheduler that runs 16 sequences of 2048 tokens at most. The scheduler caps a static engine's
    running sequences to its slots anyway, so more slots than it runs are memory for nothing. Mixed steps stay on
    and static prefill off, as the engine's defaults have them on a CPU."""
    max_len = max(16, min(max_model_len, int(dims["max_positions"])))  # 16: SlotEngineOptions' least
    per_slot = kv_bytes_per_slot(dims, max_len, precision)
    room = int(memory_bytes * CPU_KV_SHARE)
    slots = min(max_running_seqs, MAX_CPU_SLOTS)
    while slots >= 1 and (slots + 1) * per_slot > room:  # + the scratch row of mixed steps
        slots //= 2
    if slots < 1:
        raise ConfigError(
            f"one KV slot of {max_len} tokens and the scratch row ({2 * per_slot / 2**30:.2f} GiB in {precision}) "
            f"do not fit {CPU_KV_SHARE:.0%} of this machine's {memory_bytes / 2**30:.1f} GiB of memory",
            "set engine.max_len (and scheduler.max_model_len) lower in the model's generation.yaml",
        )
    engine = SlotEngineOptions(num_slots=slots, max_len=max_len, dtype=precision)  # type: ignore[arg-type]
    reason = (
        f"on the CPU: {slots} slots x {max_len} tokens ({(slots + 1) * per_slot / 2**30:.2f} GiB {precision} KV, at "
        f"most {CPU_KV_SHARE:.0%} of {memory_bytes / 2**30:.0f} GiB), the scheduler's {max_running_seqs} sequences of "
        f"{max_model_len} tokens{'' if slots == max_running_seqs else ' (fewer slots: the memory)'}"
    )
    return ServeDefaults(engine, {"max_running_seqs": slots}, reason)
