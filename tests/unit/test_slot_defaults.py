"""The GPU decoder's default serving choice as a pure function of the model's dims and the GPU's memory, and int8 at
batch 1 on only where the version's ``causal_lm.json`` says the decoder gate passed on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miaohui.errors import ConfigError
from miaohui.generation.build.artifact import MARKER_NAME, CausalLMInfo, read_info
from miaohui.generation.build.static_artifact import META_NAME, StaticDecoderMeta
from miaohui.generation.executors.slot_defaults import choose_defaults, int8_gate_passed

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


def _version(folder: Path, validation: dict[str, Any] | None) -> CausalLMInfo:
    """An ``inductor`` version's two JSON files as a build and ``miaohui validate`` write them (no weights: the
    defaults read only these)."""
    folder.mkdir(parents=True)
    meta = StaticDecoderMeta(
        dims=QWEN2_1_5B, precision="bf16", eos_token_ids=[2], pad_token_id=2, check_max_abs_error=0.0, save_seconds=1.0
    )
    (folder / META_NAME).write_text(meta.model_dump_json())
    info = CausalLMInfo(
        name="qwen", version=1, backend="inductor", precision="bf16", source="qwen2", build_key="k", created=0,
        build_seconds=1.0, validation=validation,
    )  # fmt: skip
    (folder / MARKER_NAME).write_text(info.model_dump_json())
    return read_info(folder)


def test_the_int8_stamp_in_causal_lm_json_turns_int8_at_batch_1_on(tmp_path: Path) -> None:
    from miaohui.serving.chat import version_defaults

    figures = {"exact_match": 0.8, "teacher_forced": 0.99, "factual": 1.0}
    passed = {"failures": [], "int8_batch1": {"passed": True, "figures": figures, "failures": []}}
    got = version_defaults(tmp_path / "a" / "1", _version(tmp_path / "a" / "1", passed), 139 * GIB)
    assert got.engine.int8_batch1 is True
    assert got.reason.endswith("int8 at batch 1 on (the decoder gate passed on it)")
    failed = {"int8_batch1": {"passed": False, "figures": None, "failures": ["could not run"]}}
    others: tuple[dict[str, Any] | None, ...] = (None, {"failures": []}, {"int8_batch1": None}, failed)
    for i, validation in enumerate(others):  # never validated, validated before the int8 run existed, failed
        folder = tmp_path / f"b{i}" / "1"
        assert not int8_gate_passed(validation)
        assert version_defaults(folder, _version(folder, validation), 139 * GIB).engine.int8_batch1 is False
