"""``SlotEngineOptions`` (no torch): defaults, the kernel forms it takes and refuses, and bucket checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from miaohui.errors import ConfigError
from miaohui.generation.executors.slot_options import SlotEngineOptions, bucket_for


def test_defaults_are_the_fast_kernel_forms() -> None:
    opts = SlotEngineOptions()
    assert (opts.decode_attention, opts.int8_batch1, opts.int8_kernel) == ("triton", False, "gemv_layer")
    assert SlotEngineOptions(decode_attention="matmul", int8_kernel="inductor").int8_kernel == "inductor"


@pytest.mark.parametrize(
    ("field", "value"), [("decode_attention", "sdpa"), ("decode_attention", "flex"), ("int8_kernel", "gemv_fused")]
)
def test_deleted_kernel_forms_are_refused(field: str, value: str) -> None:
    """One reference and one fast form of each kernel: the others were deleted, and naming one is an error."""
    with pytest.raises(ValidationError, match=field):
        SlotEngineOptions.model_validate({field: value})


@pytest.mark.parametrize("field", ["decode_layer", "int8_batched"])
def test_deleted_fields_are_refused(field: str) -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        SlotEngineOptions.model_validate({field: "fused" if field == "decode_layer" else True})


def test_buckets_must_reach_the_slots_and_the_length() -> None:
    assert SlotEngineOptions(num_slots=6, max_len=300).buckets() == ((1, 2, 4, 6), (128, 256, 300))
    with pytest.raises(ConfigError, match=r"do not reach num_slots=8 / max_len=256") as err:
        SlotEngineOptions(num_slots=8, max_len=256, batch_buckets=(1, 4)).buckets()
    assert err.value.fix == "make the largest batch bucket num_slots and the largest length bucket max_len"
    assert bucket_for(5, (1, 4, 8)) == 8
    with pytest.raises(ConfigError, match="9 is over the largest bucket 8"):
        bucket_for(9, (1, 4, 8))


def test_mixed_steps_attend_one_length_bucket_unless_told() -> None:
    """Mixed steps capture one graph per (batch, tokens) at ``max_len`` by default: 21 graphs, not 105, at 64 slots."""
    options = SlotEngineOptions(num_slots=64, max_len=2048)
    assert options.mixed_lengths() == (2048,)
    assert len(options.buckets()[0]) * len(options.mixed_lengths()) * len(options.mixed_prefill_tokens) == 21
    assert SlotEngineOptions(max_len=512, mixed_length_buckets=(512, 128)).mixed_lengths() == (128, 512)
    with pytest.raises(ConfigError, match=r"mixed_length_buckets \(128,\) do not reach max_len=512"):
        SlotEngineOptions(max_len=512, mixed_length_buckets=(128,)).mixed_lengths()
