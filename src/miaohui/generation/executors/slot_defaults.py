"""What a GPU decoder runs with when its model has no ``generation.yaml``: slots, buckets, token budget and the
loop's flags, chosen from the model's dims and the GPU's memory (a pure function: no torch, testable anywhere).

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
    per_slot = 2 * layers * kv_width * max_len * size
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
