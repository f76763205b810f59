"""Precompiled graphs on CUDA (:mod:`miaohui.engines.precompiled`): an engine with CUDA graphs, static prefill and
mixed steps records what it compiles; a second engine that loads the saved graphs captures every bucket without one
compile and gives the first engine's greedy tokens. Skipped without CUDA, like all of tests/gpu."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tests.tiny_llm import tiny_qwen

from miaohui.engines.precompiled import Precompiled, Recorder, read_index
from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.executors.compile_clock import CompileClock
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.static_kv import StaticKVDecoder

pytestmark = pytest.mark.gpu


def test_an_engine_on_saved_graphs_captures_without_compiling(tmp_path: Path) -> None:
    hf = tiny_qwen("cuda")
    opts = SlotEngineOptions(num_slots=8, max_len=256, dtype="fp32", static_prefill=True,
                             mixed_prefill_tokens=(32, 64), mixed_prefill_prompts=2)  # fmt: skip

    def engine(compile_fn: object) -> TorchSlotEngine:
        model = StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32)
        return TorchSlotEngine(model, [999], 0, opts, compile_fn)  # type: ignore[arg-type]

    recorder = Recorder()
    built = engine(recorder)
    started = time.perf_counter()
    built.warmup()
    build_seconds = time.perf_counter() - started
    index = recorder.save(tmp_path)
    print("not saved:", index.skipped)  # pieces the steps never call; serve would compile them if they were
    loaded_index, why = read_index(tmp_path)
    assert loaded_index is not None, why

    def refuse(fn: object) -> object:
        def call(*_a: object, **_k: object) -> None:
            raise AssertionError(f"{fn} compiled at serve")

        return call

    precompiled = Precompiled(tmp_path, loaded_index, fallback=refuse)  # type: ignore[arg-type]
    served = engine(precompiled)
    started = time.perf_counter()
    with CompileClock() as clock:
        served.warmup()
    serve_seconds = time.perf_counter() - started
    print(f"warm-up: build {build_seconds:.1f}s, from saved graphs {serve_seconds:.1f}s "
          f"(+ {precompiled.seconds:.2f}s loading them)")  # fmt: skip
    assert clock.compiles == 0
    assert served._mixed_graphs and served._prefill_graphs and served._graphs
    prompts = [[5 + i, 6, 7, 8 + i] * (1 + i % 4) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [g[0] for g in LLMEngine(built, None).generate(prompts, params)]
    got = [g[0] for g in LLMEngine(served, None).generate(prompts, params)]
    assert got == want


def test_graphs_captured_after_ready_leave_the_tokens_served_meanwhile(tmp_path: Path) -> None:
    """Serve's start (``warmup(defer=True)`` on the saved graphs): the small buckets before ready, the rest captured on
    the background thread while requests run, through buckets that have no graph yet and ones that just got one. The
    tokens are the recording engine's (whose graphs were all captured before it served)."""
    hf = tiny_qwen("cuda")
    opts = SlotEngineOptions(num_slots=8, max_len=256, dtype="fp32", static_prefill=True, ready_rows=2,
                             ready_tokens=128, mixed_prefill_tokens=(32, 64), mixed_prefill_prompts=2)  # fmt: skip

    def engine(compile_fn: object) -> TorchSlotEngine:
        model = StaticKVDecoder.from_hf(hf, num_slots=8, max_len=256, dtype=torch.float32)
        return TorchSlotEngine(model, [999], 0, opts, compile_fn)  # type: ignore[arg-type]

    recorder = Recorder()
    built = engine(recorder)
    built.warmup()
    recorder.save(tmp_path)
    loaded_index, why = read_index(tmp_path)
    assert loaded_index is not None, why
    precompiled = Precompiled(tmp_path, loaded_index, fallback=torch.compile)  # type: ignore[arg-type]
    served = engine(precompiled)
    served.precompiled = precompiled
    with CompileClock() as clock:
        served.warmup(defer=True)
    left = served.pending_graphs
    assert left > 0 and not served._mixed_graphs and (8, 256) not in served._graphs
    prompts = [[5 + i, 6, 7, 8 + i] * (1 + i % 4) for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [g[0] for g in LLMEngine(built, None).generate(prompts, params)]
    thread = served.capture_deferred()
    assert thread is not None
    got = [g[0] for g in LLMEngine(served, None).generate(prompts, params)]  # while the thread captures
    thread.join(120)
    print(f"{left} graphs after ready in {served.start_phases['capture_after_ready']:.2f}s")
    assert served.pending_graphs == 0 and served._mixed_graphs and (8, 256) in served._graphs
    assert clock.compiles == 0
    assert precompiled.artifacts_loaded == len(precompiled.variants)  # the rest loaded after ready
    assert got == want
    assert [g[0] for g in LLMEngine(served, None).generate(prompts, params)] == want  # every graph now
    served.close()
    built.close()
