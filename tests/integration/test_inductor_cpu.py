"""The ``inductor`` encoder backend on the CPU (fp32): build → AOTInductor package → load without compiling →
outputs of the PyTorch model; the fallback format when the package is refused; probe and corrupt-file errors.
The same backend on the H200 (fp16/bf16, CUDA graphs) is tests/gpu/test_inductor_gpu.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from miaohui.config import BuildConfig, parse_shapes
from miaohui.engines import inductor
from miaohui.engines.inductor_engine import InductorEngine
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact, read_manifest
from miaohui.errors import ArtifactError, BuildError, ConfigError, ShapeError
from miaohui.models.checkpoint import load_checkpoint
from miaohui.models.fast_bert import FAST_WEIGHTS, has_fast
from miaohui.nlp.tokenizer import pad_batch
from miaohui.serving.served import ServedVersion

pytestmark = pytest.mark.slow
CFG = BuildConfig(backend="inductor", precision="fp32", autotune=False, shapes=parse_shapes("input_ids:1x1,4x16,16x32"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inductor-repo")


@pytest.fixture(scope="module")
def packaged(tiny_model: Path, repo: Path) -> Path:
    return build_artifact(tiny_model, "intent-aoti", CFG, repo, log=print).path


def _feeds(b: int, s: int, seed: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(5, 1000, (b, s)).astype(np.int64)
    mask = np.ones_like(ids)
    if s > 2:
        mask[0, s // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _check_matches_pytorch(engine: InductorEngine, tiny_model: Path) -> None:
    model = load_checkpoint(tiny_model).module.eval()
    for i, (b, s) in enumerate([(1, 1), (1, 9), (3, 16), (16, 32)]):
        feeds = _feeds(b, s, seed=i)
        got = engine.infer(feeds)["logits"]
        with torch.inference_mode():
            want = model(torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])).numpy()
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert got.shape == want.shape and rel < 1e-4, (b, s, rel)


def test_package_is_built_and_loads_without_compiling(packaged: Path, tiny_model: Path) -> None:
    manifest = read_manifest(packaged)
    assert manifest.engine_file == "model.pt2" and manifest.extra["format"] == "aoti-package"
    assert manifest.extra["aoti"]["ok"] and manifest.extra["aoti"]["reason"] is None
    assert {"model.pt2", "tokenizer.json", "manifest.json"} <= {p.name for p in packaged.iterdir()}
    assert not (packaged / "program.pt2").exists()
    traced = counters["stats"]["unique_graphs"]
    engine = load_engine(packaged)
    assert isinstance(engine, InductorEngine) and engine.packaged
    _check_matches_pytorch(engine, tiny_model)
    assert counters["stats"]["unique_graphs"] == traced  # no Dynamo trace at load or at any shape


def test_refused_package_falls_back_to_the_exported_program(
    tiny_model: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stand-in for what happened on one H200 image (aoti_load_package segfaulted in a fresh process):
    # a crash there cannot be caused on this machine, so the probe's verdict is replaced; the probe's own handling
    # of a failing child process is tested with a real one below.
    monkeypatch.setattr(inductor, "probe_aoti_package", lambda *a: "a child process ended with signal 11")
    out = build_artifact(tiny_model, "intent-fallback", CFG, repo, log=print).path
    manifest = read_manifest(out)
    assert manifest.engine_file == "program.pt2" and manifest.extra["format"] == "exported-program"
    assert manifest.extra["aoti"] == {
        "ok": False,
        "reason": "a child process ended with signal 11",
        "compile_seconds": manifest.extra["aoti"]["compile_seconds"],
        "probe_seconds": manifest.extra["aoti"]["probe_seconds"],
    }
    assert not (out / "model.pt2").exists() and (out / "inductor-cache.bin").is_file()
    engine = load_engine(out)
    assert isinstance(engine, InductorEngine) and not engine.packaged
    _check_matches_pytorch(engine, tiny_model)


def test_format_aoti_package_fails_the_build_instead_of_falling_back(
    tiny_model: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inductor, "probe_aoti_package", lambda *a: "a child process ended with signal 11")
    cfg = CFG.model_copy(update={"inductor_format": "aoti-package"})
    with pytest.raises(BuildError, match="signal 11") as err:
        build_artifact(tiny_model, "intent-strict", cfg, repo, log=print)
    assert "--inductor-format auto" in str(err.value)
    assert not (repo / "intent-strict").exists() or not any((repo / "intent-strict").iterdir())  # no partial artifact


def test_format_exported_program_skips_the_package(
    tiny_model: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*a: object) -> None:
        raise AssertionError("the AOTInductor package was compiled")

    monkeypatch.setattr(inductor, "build_aoti_package", never)
    cfg = CFG.model_copy(update={"inductor_format": "exported-program"})
    out = build_artifact(tiny_model, "intent-ep", cfg, repo, log=print).path
    manifest = read_manifest(out)
    assert manifest.engine_file == "program.pt2" and manifest.extra["format"] == "exported-program"
    assert manifest.extra["aoti"]["reason"].startswith("not tried")


def _cache_entries(compiled: object) -> int:
    """How many graphs Dynamo holds for a ``torch.compile`` module's forward (its code object's cache)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(compiled._orig_mod.forward.__code__))  # type: ignore[attr-defined]


def test_static_shapes_get_programs_of_their_own(tiny_model: Path, repo: Path) -> None:
    """``static_shapes``: the build compiles a program for exactly 4x16 next to the dynamic one (no AOTInductor
    package: it holds one program); the engine traces it at load at that shape only, answers inputs of that shape
    from it — the dynamic program's cache is not asked — and every other shape from the dynamic program (whose
    calls never reach the static one), all matching PyTorch."""
    cfg = BuildConfig.model_validate({**CFG.model_dump(), "static_shapes": "4x16"})
    assert cfg.static_shapes == ((4, 16),) and cfg.compute_hash() != CFG.compute_hash()
    out = build_artifact(tiny_model, "intent-static", cfg, repo, log=print).path
    manifest = read_manifest(out)
    assert manifest.engine_file == "program.pt2" and manifest.extra["static_shapes"] == ["4x16"]
    assert "static_shapes" in manifest.extra["aoti"]["reason"]
    engine = load_engine(out)
    assert isinstance(engine, InductorEngine) and set(engine._static) == {(4, 16)}
    static = engine._static[(4, 16)]
    assert _cache_entries(static) == 1  # traced at load, at its shape (as at build)
    _check_matches_pytorch(engine, tiny_model)  # 1x1, 1x9, 3x16, 16x32: the dynamic program
    assert _cache_entries(static) == 1
    model = load_checkpoint(tiny_model).module.eval()
    feeds = _feeds(4, 16, seed=5)
    dynamic_graphs = _cache_entries(engine._runner)
    got = engine.infer(feeds)["logits"]
    assert _cache_entries(static) == 1 and _cache_entries(engine._runner) == dynamic_graphs
    with torch.inference_mode():
        want = model(torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])).numpy()
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-4
    np.testing.assert_allclose(got, engine._runner(*map(torch.from_numpy, feeds.values())).detach().numpy(), atol=1e-5)


def test_a_static_shape_outside_the_buckets_is_refused(tiny_model: Path, repo: Path) -> None:
    cfg = BuildConfig.model_validate({**CFG.model_dump(), "static_shapes": "3x16"})
    with pytest.raises(ConfigError, match="static shape 3x16") as err:
        build_artifact(tiny_model, "intent-static-bad", cfg, repo, log=print)
    assert "[1, 2, 4, 8, 16]" in str(err.value) and "[8, 16, 32]" in str(err.value)
    package = BuildConfig.model_validate(
        {**cfg.model_dump(), "static_shapes": "4x16", "inductor_format": "aoti-package"}
    )
    with pytest.raises(BuildError, match="one program"):
        build_artifact(tiny_model, "intent-static-aoti", package, repo, log=print)


def test_probe_reports_a_package_that_does_not_load(tiny_model: Path, tmp_path: Path) -> None:
    """A real child process fails on a package that is not one; the probe says so instead of raising."""
    from miaohui.models.fast_bert import from_module

    model = inductor.FloatLogits(from_module(load_checkpoint(tiny_model, attn_implementation="sdpa").module)).eval()
    ids = torch.randint(5, 1000, (2, 8))
    with torch.no_grad():
        ep = torch.export.export(model, (ids, torch.ones_like(ids)))
    bad = tmp_path / "model.pt2"
    bad.write_bytes(b"not a zip" * 100)
    reason = inductor.probe_aoti_package(ep, bad, [(2, 8)], "fp32")
    assert reason is not None and reason.startswith("a child process loading the package ended with status"), reason


def test_corrupt_package_is_a_clear_error(packaged: Path, tmp_path: Path) -> None:
    import shutil

    art = tmp_path / "art"
    shutil.copytree(packaged, art)
    size = (art / "model.pt2").stat().st_size
    (art / "model.pt2").write_bytes(b"\x00" * size)  # same size, other bytes: only the checksum sees it
    with pytest.raises(ArtifactError, match="checksum|sha256|rebuild"):
        load_engine(art)
    with pytest.raises(ArtifactError, match="cannot load inductor engine"):
        load_engine(art, verify_checksums=False)


async def test_served_by_the_model_manager(packaged: Path, repo: Path) -> None:
    """The package behind the serving stack (repository config, warm-up, batcher) answers /v1/intent."""
    import httpx

    from miaohui.server.http import create_app
    from miaohui.server.metrics import Metrics
    from miaohui.server.state import ServerState
    from miaohui.serving.model_config import ModelConfig, write_model_config
    from miaohui.serving.repository import ModelManager

    # config.yaml's engine options reach the engine (graph_copies: only CUDA graphs use it; here it is carried)
    write_model_config(repo / "intent-aoti" / "config.yaml", ModelConfig(graph_copies=False))
    metrics = Metrics()
    manager = ModelManager(repo, observer_factory=metrics.observer)
    await manager.load("intent-aoti")
    served = manager.get("intent-aoti", 1)
    assert served.ready and all(isinstance(e, InductorEngine) and e.packaged for e in served.engines)
    assert all(isinstance(e, InductorEngine) and not e.graph_copies for e in served.engines)
    app = create_app(ServerState(manager, metrics))
    texts = ["帮我订明天上午九点的会议室", "我的信用卡丢了", "hello"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cpu") as client:
        resp = await client.post("/v1/intent", json={"texts": texts, "model": "intent-aoti"})
        assert resp.status_code == 200, resp.text
        got = resp.json()
    labels = read_manifest(packaged).labels
    want = load_engine(packaged).infer(_encode(served, texts))["logits"].argmax(-1)
    assert [r["intent"] for r in got] == [labels[int(i)] for i in want]
    await manager.stop()


def _encode(served: ServedVersion, texts: list[str]) -> dict[str, np.ndarray]:
    ids, mask = pad_batch(served.tokenize(texts), served.pad_id)
    return {"input_ids": ids, "attention_mask": mask}


def test_validate_gate_runs_within_the_profile(packaged: Path, repo: Path) -> None:
    """`miaohui validate` on the package: its batches follow the profile's max batch (16 here, not 32)."""
    from miaohui.validate.run import run_validation

    report, _ = run_validation(str(packaged), repo, "dev", "torch", 1.0, 0.98, None)
    assert report.passed, report.failures
    assert report.agreement == 1.0 and report.max_logit_error < 1e-3


def test_fused_gelu_layer_exports_as_one_gemm_epilogue(tiny_model: Path) -> None:
    """The GPU engine's FFN (``use_fused_gelu``): one ``_addmm_activation`` per layer in the exported graph instead of
    addmm + gelu, same values (on the CPU the op computes erf GELU; on CUDA cuBLASLt's tanh form, checked by the GPU
    tests' validate gate)."""
    from miaohui.models.fast_bert import from_module, use_fused_gelu

    plain = inductor.FloatLogits(from_module(load_checkpoint(tiny_model, attn_implementation="sdpa").module)).eval()
    fused = use_fused_gelu(
        inductor.FloatLogits(from_module(load_checkpoint(tiny_model, attn_implementation="sdpa").module))
    )
    ids = torch.randint(5, 1000, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, mask), plain(ids, mask), rtol=1e-5, atol=1e-5)
        ep = torch.export.export(fused.eval(), (ids, mask))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    layers = sum(1 for _ in fused.module.encoder.layers)
    assert sum("_addmm_activation" in t for t in targets) == layers
    assert not any("gelu" in t for t in targets)


@pytest.fixture(scope="module")
def exported(tiny_model: Path, repo: Path) -> Path:
    cfg = CFG.model_copy(update={"inductor_format": "exported-program"})
    return build_artifact(tiny_model, "intent-fast", cfg, repo, log=print).path


def test_exported_program_loads_from_its_saved_cache(
    exported: Path, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the exported program into an empty Inductor cache (a fresh machine) compiles no graph again: Dynamo
    traces it, and every Inductor graph comes from the compile cache saved in the artifact (on the CPU their C++ is
    still compiled there: the saved cache carries the graphs, not the compiled kernels)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    engine = load_engine(exported)
    _check_matches_pytorch(engine, tiny_model)
    assert counters["inductor"]["fxgraph_cache_miss"] == misses, "the load recompiled a graph"
    assert counters["inductor"]["fxgraph_cache_hit"] > hits  # the program was compiled, from the saved cache


def test_a_program_failing_its_first_calls_is_refused_at_load(exported: Path, tmp_path: Path) -> None:
    """A program that cannot run its first calls — here a manifest whose profile reaches past the exported range — is
    refused at load with the calls and the fix, not left to fail a request."""
    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    for spec in manifest["inputs"]:
        spec["profile"]["opt"] = spec["profile"]["max"] = [64, 64]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"failed its first calls \[\(1, 64\), \(64, 64\)\]: .* — rebuild it"):
        load_engine(bad)


def test_fast_start_answers_eagerly_then_swaps_in_the_compiled_program(exported: Path, tiny_model: Path) -> None:
    """``fast_start``: answers come from the fast model rebuilt from ``eager.safetensors`` (the program is not even
    loaded, nothing traced) until ``upgrade`` loads and compiles the program; then from the compiled program, with
    the same numbers as an engine loaded the usual way."""
    manifest = read_manifest(exported)
    assert has_fast(exported)
    traced = counters["stats"]["unique_graphs"]
    engine = InductorEngine(manifest, exported, fast_start=True)
    assert not engine.upgraded.is_set() and engine._runner is None
    _check_matches_pytorch(engine, tiny_model)
    assert counters["stats"]["unique_graphs"] == traced  # eager: nothing traced yet
    engine.upgrade()
    assert engine.upgraded.is_set() and engine.upgrade_seconds > 0
    assert counters["stats"]["unique_graphs"] > traced  # the compiled program now answers
    _check_matches_pytorch(engine, tiny_model)
    feeds = _feeds(3, 16, seed=9)
    plain = InductorEngine(manifest, exported).infer(feeds)["logits"]
    np.testing.assert_allclose(engine.infer(feeds)["logits"], plain, rtol=1e-5, atol=1e-6)


def test_fast_start_without_eager_weights_runs_the_program_as_is(
    exported: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """An artifact without ``eager.safetensors`` (built before it existed) starts fast from its exported program
    run as is; corrupt eager weights are refused with the rebuild message, not served."""
    old = tmp_path / "old"
    shutil.copytree(exported, old)
    (old / FAST_WEIGHTS).unlink()
    engine = InductorEngine(read_manifest(old), old, fast_start=True)
    assert engine._runner is not None and not engine.upgraded.is_set()
    _check_matches_pytorch(engine, tiny_model)
    engine.upgrade()
    _check_matches_pytorch(engine, tiny_model)

    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    weights = bad / FAST_WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ArtifactError, match="cannot load inductor engine"):
        InductorEngine(read_manifest(bad), bad, fast_start=True)
    InductorEngine(read_manifest(bad), bad)  # without fast_start the eager weights are not read


def test_fast_start_checks_the_program_before_its_upgrade_reads_it(
    exported: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """``fast_start`` defers the program's sha256 to the background upgrade (the first answer does not wait for
    it): a corrupt program still fails a normal load at once, and fails a fast-started engine's upgrade — with the
    rebuild message — while its eager answers are unaffected."""
    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    program = bad / "program.pt2"
    data = bytearray(program.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    program.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        load_engine(bad)
    engine = load_engine(bad, fast_start=True)
    assert isinstance(engine, InductorEngine)
    _check_matches_pytorch(engine, tiny_model)
    with pytest.raises(ArtifactError, match="sha256"):
        engine.upgrade()
    assert not engine.upgraded.is_set()
    _check_matches_pytorch(engine, tiny_model)  # still the eager model


async def test_fast_start_version_serves_while_it_compiles(
    exported: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A served ``fast_start`` version is ready after its eager warm-up, compiles in the background after it,
    answers throughout, and asks the GC policy to refreeze the heap once compiled (recorded here: freezing the test
    process's heap would leak into the other tests)."""
    from miaohui import gcpolicy
    from miaohui.serving.model_config import ModelConfig, WarmupShape

    refrozen: list[str] = []
    monkeypatch.setattr(gcpolicy, "refreeze", refrozen.append)

    served = ServedVersion(exported, ModelConfig(fast_start=True, warmup=[WarmupShape(batch=2, sequence=8)]))
    await served.start()
    try:
        engine = served.engines[0]
        assert isinstance(engine, InductorEngine) and served.ready
        rng = np.random.default_rng(2)
        rows = [rng.integers(5, 200, int(n)).tolist() for n in rng.integers(2, 30, 20)]
        before = await asyncio.gather(*(served.run_rows([r], None) for r in rows))
        assert await asyncio.to_thread(engine.upgraded.wait, 300), "the background compile did not finish"
        await asyncio.to_thread(engine._upgrader.join, 60)  # type: ignore[union-attr]
        assert refrozen == ["intent-fast compiled"]
        timings = served.start_timings()  # what /metrics exports as miaohui_model_start_seconds{phase}
        assert (
            set(timings) == {"load", "warmup", "compile", "engine_load"}
            and timings["compile"] == engine.upgrade_seconds > 0
        )
        after = await asyncio.gather(*(served.run_rows([r], None) for r in rows))
        for a, b in zip(before, after, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    finally:
        await served.stop()


def test_a_batch_one_profile_exports_a_static_batch(tiny_model: Path, repo: Path) -> None:
    """``input_ids:1x1,1x16,1x32`` (a one-conversation service): torch.export refuses a ``Dim`` whose min equals
    its max, so the batch dim is exported static; the engine answers batch 1 at any sequence of the profile."""
    cfg = CFG.model_copy(
        update={"shapes": parse_shapes("input_ids:1x1,1x16,1x32"), "inductor_format": "exported-program"}
    )
    engine = load_engine(build_artifact(tiny_model, "intent-batch1", cfg, repo, log=print).path)
    assert isinstance(engine, InductorEngine) and engine.batches == [1]
    model = load_checkpoint(tiny_model).module.eval()
    for s in (1, 9, 32):
        feeds = _feeds(1, s, seed=s)
        with torch.inference_mode():
            want = model(torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])).numpy()
        got = engine.infer(feeds)["logits"]
        assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-4, s


def test_a_profile_whose_batch_starts_above_one(tiny_model: Path, repo: Path) -> None:
    """``input_ids:4x1,4x16,8x32``: the program refuses batches below 4, so the engine's buckets, and the batches it
    traces, start at 4; a smaller request is refused with the profile's range, not passed to the program."""
    cfg = CFG.model_copy(
        update={"shapes": parse_shapes("input_ids:4x1,4x16,8x32"), "inductor_format": "exported-program"}
    )
    engine = load_engine(build_artifact(tiny_model, "intent-batch4", cfg, repo, log=print).path)
    assert isinstance(engine, InductorEngine)
    assert engine.bucket(1, 9) == (4, 16) and engine.bucket(5, 9) == (8, 16)
    assert {b for b, _ in engine.all_buckets()} == {4, 8}
    engine.upgrade()  # traces the smallest bucket's batch (the first program call of a load)
    model = load_checkpoint(tiny_model).module.eval()
    for b, s in [(4, 9), (6, 32)]:
        feeds = _feeds(b, s, seed=b)
        with torch.inference_mode():
            want = model(torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])).numpy()
        got = engine.infer(feeds)["logits"]
        assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-4, (b, s)
    with pytest.raises(ShapeError, match="outside the profile min 4x1"):
        engine.infer(_feeds(1, 9, seed=0))
