"""Precompiled graphs (:mod:`miaohui.engines.precompiled`) on the CPU: what the build's engine compiled, saved, then
called by a fresh engine without Dynamo — the same logits bit for bit, no compile; a call no saved graph fits, or
a damaged file, goes back to ``torch.compile``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.tiny_llm import tiny_qwen

from miaohui.engines.precompiled import INDEX_FILE, Precompiled, Recorder, parse_source, read_index
from miaohui.generation.executors.compile_clock import CompileClock
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.static_kv import StaticKVDecoder

pytestmark = pytest.mark.slow

OPTIONS = SlotEngineOptions(num_slots=4, max_len=128, dtype="fp32", compile=True, cuda_graphs=False)
DECODES = ((2, 32), (3, 64), (1, 128), (4, 128), (1, 32))


def test_dynamo_source_names_are_read_from_the_bound_arguments() -> None:
    x = torch.zeros(3, 5)[:, 1:]
    args = {"args": (x, 7), "kwargs": {"kv_len": 64}, "w": x}
    assert parse_source("L['args'][0]")(args) is x
    assert parse_source("L['args'][1]")(args) == 7
    assert parse_source("L['kwargs']['kv_len']")(args) == 64
    assert parse_source("L['args'][0].size()[1]")(args) == 4
    assert parse_source("L['w'].stride()[0]")(args) == 5
    assert parse_source("L['w'].storage_offset()")(args) == 1
    for bad in ("G['table']", "L['x'].weight", "L['x'][0].foo()"):
        with pytest.raises(ValueError, match="unsupported graph input"):
            parse_source(bad)


def _engine(compile_fn: Callable[..., Any]) -> TorchSlotEngine:
    model = StaticKVDecoder.from_hf(tiny_qwen(), num_slots=4, max_len=128, dtype=torch.float32)
    return TorchSlotEngine(model, [999], 0, OPTIONS, compile_fn)


def _steps(engine: TorchSlotEngine) -> list[torch.Tensor]:
    """Two prefills (several prompts, one prompt) and decode steps of several batch sizes and attended lengths."""
    m, gen, out = engine.model, torch.Generator().manual_seed(0), []
    with torch.inference_mode():
        for c in (*m.k_cache, *m.v_cache):
            c.zero_()
        out.append(m.prefill(torch.randint(5, 900, (3, 40), generator=gen), torch.tensor([40, 20, 33]),
                             torch.tensor([0, 1, 2])))  # fmt: skip
        out.append(m.prefill(torch.randint(5, 900, (1, 17), generator=gen), torch.tensor([17]), torch.tensor([3])))
        for b, t in DECODES:
            tokens = torch.randint(5, 900, (b,), generator=gen)
            out.append(engine._decode_fn(tokens, torch.randint(0, 40, (b,), generator=gen), t))
    return out


def _refuse(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*_a: Any, **_k: Any) -> Any:
        raise AssertionError(f"{fn.__qualname__} was compiled at serve")

    return call


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    folder = tmp_path_factory.mktemp("precompiled")
    recorder = Recorder()
    want = _steps(_engine(recorder))
    index = recorder.save(folder)
    assert {p.name for p in index.pieces} == {
        "00-attn_in", "02-make_decode_layer.decode_layer", "03-attn_proj_mlp", "04-final_logits",
    }  # fmt: skip
    # the triton attention half and the mixed step are never called by these steps: not saved, serve compiles them
    assert index.skipped == {
        "01-attn_out_mlp_triton": "never called at build",
        "05-mixed_layer": "never called at build",
    }
    return folder, want


def test_a_fresh_engine_runs_the_saved_graphs_without_compiling(recorded: tuple[Path, list[torch.Tensor]]) -> None:
    folder, want = recorded
    index, why = read_index(folder)
    assert index is not None, why
    precompiled = Precompiled(folder, index, fallback=_refuse)
    engine = _engine(precompiled)
    assert len(precompiled.loaded) == 4
    assert precompiled.compiled_instead == ["01-attn_out_mlp_triton", "05-mixed_layer"]
    with CompileClock() as clock:
        got = _steps(engine)
    assert clock.compiles == 0
    assert all(p.fallbacks == 0 for p in precompiled.loaded)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {i}: {float((g - w).abs().max()):.2e}"


def test_each_artifact_loads_once_at_its_first_call_whichever_thread_asks(
    recorded: tuple[Path, list[torch.Tensor]],
) -> None:
    """Nothing loads when the engine is made; the after-ready capture thread (``load_all``) and a serving step may
    ask for the same artifact at once, and it is loaded once."""
    import threading

    folder, _ = recorded
    index, _ = read_index(folder)
    assert index is not None
    precompiled = Precompiled(folder, index, fallback=_refuse)
    _engine(precompiled)
    variants = precompiled.variants
    assert precompiled.artifacts_loaded == 0 and all(v.artifact is None for v in variants)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(precompiled.load(variants[0]))) for _ in range(4)]
    threads.append(threading.Thread(target=precompiled.load_all))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert precompiled.artifacts_loaded == len(variants) and all(v.artifact is not None for v in variants)
    assert all(g is variants[0].artifact for g in got)
    assert precompiled.summary().startswith(f"{len(variants)} of {len(variants)} precompiled graphs loaded in ")


def test_a_call_no_saved_graph_fits_is_compiled_and_said(
    recorded: tuple[Path, list[torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    folder, _ = recorded
    index, _ = read_index(folder)
    assert index is not None
    compiled: list[str] = []

    def fallback(fn: Callable[..., Any]) -> Callable[..., Any]:
        compiled.append(fn.__qualname__)
        return fn  # eager stands in for torch.compile

    precompiled = Precompiled(folder, index, fallback=fallback)
    engine = _engine(precompiled)
    final = next(p for p in precompiled.loaded if p.name == "04-final_logits")
    m = engine.model
    x = torch.randn(3, m.dims.hidden, dtype=torch.float64)  # no graph was compiled for fp64
    with caplog.at_level(logging.WARNING, logger="miaohui.engines.precompiled"):
        out = final(x, m.norm.double(), m.head.double(), m.dims.rms_eps)
    assert out.dtype == torch.float32 and out.shape == (3, m.dims.vocab)
    assert final.fallbacks == 1 and compiled[-1] == "final_logits"
    assert "precompiled 04-final_logits: no saved graph fits" in caplog.text


def test_a_damaged_graph_file_is_not_used(recorded: tuple[Path, list[torch.Tensor]], tmp_path: Path) -> None:
    import shutil

    folder, _ = recorded
    copy = tmp_path / "precompiled"
    shutil.copytree(folder, copy)
    first = sorted(copy.glob("*.bin"))[0]
    first.write_bytes(first.read_bytes()[:-10])
    index, why = read_index(copy)
    assert index is None and why.startswith(f"{first} has sha256 ")
    (copy / INDEX_FILE).write_text("{")
    assert read_index(copy)[1].startswith(f"cannot read {copy / INDEX_FILE}")


def test_build_saves_the_graphs_and_load_uses_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``build_compile_cache`` (what ``build-llm --backend inductor`` runs on a GPU) writes ``precompiled/`` and
    records it in ``static_decoder.json``; ``load_slot_engine`` warms up on it with no compile; under other library
    versions it is not used and the engine compiles."""
    from miaohui.generation.build.static_artifact import (
        META_NAME,
        build_compile_cache,
        load_slot_engine,
        read_static_meta,
        save_static_decoder,
    )

    save_static_decoder(tmp_path, tiny_qwen(), None, "fp32", [999], 0)
    build_compile_cache(tmp_path, OPTIONS)
    meta = read_static_meta(tmp_path)
    assert meta.precompiled is not None and meta.precompiled.graphs >= 4
    assert (tmp_path / "precompiled" / INDEX_FILE).is_file()
    with caplog.at_level(logging.INFO, logger="miaohui.generation.build.static_artifact"):
        engine = load_slot_engine(tmp_path, OPTIONS)
    assert f"precompiled graphs of {tmp_path}: {meta.precompiled.graphs} graphs" in caplog.text
    assert engine.precompiled is not None and engine.precompiled.artifacts_loaded == 0  # each at its first call
    with CompileClock() as clock:
        engine.warmup()
    assert clock.compiles == 0
    assert 0 < engine.precompiled.artifacts_loaded <= meta.precompiled.graphs
    engine.close()
    other = meta.model_copy(
        update={"precompiled": meta.precompiled.model_copy(update={"facts": {**meta.precompiled.facts, "torch": "0"}})}
    )
    (tmp_path / META_NAME).write_text(other.model_dump_json())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="miaohui.generation.build.static_artifact"):
        load_slot_engine(tmp_path, OPTIONS).close()
    assert "not used: made under other versions (torch '0' at build" in caplog.text


def test_a_graph_that_cannot_be_saved_still_compiles_at_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``standalone_compile`` refusing a graph (a fault no real graph of ours causes: simulated) leaves the build's
    warm-up to Inductor as ``torch.compile`` would, and the piece is listed as not saved, with why."""

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("no")

    monkeypatch.setattr(torch._inductor, "standalone_compile", refuse)

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    recorder = Recorder()
    out = recorder(scale)(torch.ones(4))
    assert torch.equal(out, torch.full((4,), 3.0))
    index = recorder.save(tmp_path)
    assert index.pieces == []
    assert index.skipped == {"00-test_a_graph_that_cannot_be_saved_still_compiles_at_build.scale":
                             "standalone_compile failed: RuntimeError: no"}  # fmt: skip
