"""The GPU decoder's default serving choice as a pure function of the model's dims and the GPU's memory, and int8 at
batch 1 on only where the version's ``causal_lm.json`` says the decoder gate passed on it; on a CPU, the scheduler's
sequences and length within a share of the machine's memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miaohui.errors import ConfigError
from miaohui.generation.build.artifact import MARKER_NAME, CausalLMInfo, read_info
from miaohui.generation.build.static_artifact import META_NAME, StaticDecoderMeta
from miaohui.generation.executors.slot_defaults import (
    choose_cpu_defaults,
    choose_defaults,
    int8_gate_passed,
    kv_bytes_per_slot,
)

QWEN2_1_5B = {
    "num_layers": 28, "hidden": 1536, "num_heads": 12, "num_kv_heads": 2, "head_dim": 128, "intermediate": 8960,
    "vocab": 151936, "max_positions": 32768,
}  # fmt: skip
SMOLLM2_135M = {
    "num_layers": 30, "hidden": 576, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "intermediate": 1536,
    "vocab": 49152, "max_positions": 8192,
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


def test_a_cpu_decoder_gets_the_schedulers_slots_not_a_gpu_servers() -> None:
    """SmolLM2-135M in fp32 holds 46 KB of KV a token: the engine's own 64 x 2048 slots were 6 GB of RAM."""
    assert kv_bytes_per_slot(SMOLLM2_135M, 1, "fp32") == 46080
    got = choose_cpu_defaults(SMOLLM2_135M, 24 * GIB, "fp32", max_running_seqs=16, max_model_len=2048)
    assert (got.engine.num_slots, got.engine.max_len, got.engine.dtype) == (16, 2048, "fp32")
    assert (got.engine.static_prefill, got.engine.mixed_prefill_tokens) == (False, (128, 256, 512))
    assert got.scheduler == {"max_running_seqs": 16}
    assert got.reason.startswith("on the CPU: 16 slots x 2048 tokens (1.49 GiB fp32 KV, at most 25% of 24 GiB)")
    small = choose_cpu_defaults(SMOLLM2_135M, 24 * GIB, "fp32", max_running_seqs=4, max_model_len=256)
    assert (small.engine.num_slots, small.engine.max_len) == (4, 256)
    longer = choose_cpu_defaults(SMOLLM2_135M, 24 * GIB, "fp32", 4, 100_000)
    assert longer.engine.max_len == 8192  # the model's positions


def test_cpu_slots_halve_until_the_kv_cache_fits_a_quarter_of_the_memory() -> None:
    # a 2048-token slot of SmolLM2 in fp32 is 90 MiB: 2 GiB x 0.25 holds 5 (4 slots and the scratch row), not 17
    got = choose_cpu_defaults(SMOLLM2_135M, 2 * GIB, "fp32", max_running_seqs=16, max_model_len=2048)
    assert got.engine.num_slots == 4 and got.scheduler == {"max_running_seqs": 4}
    assert got.reason.endswith("the scheduler's 16 sequences of 2048 tokens (fewer slots: the memory)")
    with pytest.raises(ConfigError, match=r"do not fit 25% of this machine's 0.2 GiB of memory") as err:
        choose_cpu_defaults(QWEN2_1_5B, GIB // 4, "fp32", max_running_seqs=16, max_model_len=32768)
    assert "engine.max_len" in err.value.fix


def test_a_cpu_serve_without_generation_yaml_sizes_the_engine_from_the_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from miaohui.generation.engine.scheduler import SchedulerConfig
    from miaohui.serving.chat import _default_options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    folder = tmp_path / "qwen" / "1"
    sched = SchedulerConfig(max_running_seqs=4, max_model_len=256, async_scheduling=True)
    options, chosen = _default_options(folder, _version(folder, None), sched)
    assert (options.num_slots, options.max_len, options.dtype) == (4, 256, "bf16")
    assert chosen == sched  # the scheduler's own figures fit: unchanged, async scheduling included


def test_the_defaults_log_says_whether_a_generation_yaml_has_no_engine_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A generation.yaml with only ``scheduler:`` (a prefix cache turned off, say) leaves the engine to the defaults;
    the log names that file rather than saying there is none."""
    import torch

    from miaohui.generation.engine.scheduler import SchedulerConfig
    from miaohui.serving.chat import _default_options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    folder = tmp_path / "qwen" / "1"
    info = _version(folder, None)
    sched = SchedulerConfig(max_running_seqs=4, max_model_len=256)
    with caplog.at_level("INFO", logger="miaohui"):
        _default_options(folder, info, sched)
        (folder.parent / "generation.yaml").write_text("scheduler:\n  prefix_cache_mb: 0\n")
        _default_options(folder, info, sched)
    said = [r.getMessage() for r in caplog.records if "v1" in r.getMessage()]
    assert said[0].startswith("qwen v1 has no generation.yaml: on the CPU")
    assert said[1].startswith("qwen v1's generation.yaml has no engine section: on the CPU")
