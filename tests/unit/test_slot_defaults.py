"""The GPU decoder's default serving choice as a pure function of the model's dims and the GPU's memory."""

from __future__ import annotations

import pytest

from miaohui.errors import ConfigError
from miaohui.generation.executors.slot_defaults import choose_defaults

QWEN2_1_5B = {
    "num_layers": 28, "hidden": 1536, "num_heads": 12, "num_kv_heads": 2, "head_dim": 128, "intermediate": 8960,
    "vocab": 151936, "max_positions": 32768,
}  # fmt: skip
GIB = 2**30


def test_a_1_5b_decoder_on_an_h200_gets_the_best_measured_configuration() -> None:
    got = choose_defaults(QWEN2_1_5B, 139 * GIB)
    assert (got.engine.num_slots, got.engine.max_len, got.engine.static_prefill) == (64, 2048, True)
    assert got.engine.int8_batch1 is False
    assert got.scheduler == {"max_running_seqs": 64, "max_batched_tokens": 4096, "async_scheduling": True}
    assert got.reason.endswith("int8 at batch 1 off (no gate passed on it)")


def test_int8_at_batch_1_only_where_the_gate_passed() -> None:
    assert choose_defaults(QWEN2_1_5B, 139 * GIB, int8_gate_passed=True).engine.int8_batch1 is True


def test_slots_halve_until_the_kv_cache_fits_and_max_len_follows_the_model() -> None:
    # weights 3.4 GiB; a slot of 2048 tokens holds 56 MiB of KV: 8 GiB x 0.75 leaves room for 32 slots, not 64
    assert choose_defaults(QWEN2_1_5B, 8 * GIB).engine.num_slots == 32
    assert choose_defaults(QWEN2_1_5B | {"max_positions": 1024}, 139 * GIB).engine.max_len == 1024


def test_a_gpu_too_small_for_one_slot_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"do not fit 4.0 GiB of GPU memory") as err:
        choose_defaults(QWEN2_1_5B, 4 * GIB)
    assert err.value.fix == "use a GPU with more memory, or set engine.max_len lower in the model's generation.yaml"
