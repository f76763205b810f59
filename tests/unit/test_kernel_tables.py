"""``gpu_kernels tuned``: the tuning files (``models/tuning``: one JSON per GPU, keyed by its name, compute capability
and the library versions it was measured with), how a build selects and loads their entries, what it records, that
the file's digest is part of the build key, and the rules that turn timings into entries. On the GPU:
``tests/gpu/test_gpu_kernels_gpu.py``."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from miaohui.config import BuildConfig, digest_json
from miaohui.engines import inductor
from miaohui.engines.base import Target
from miaohui.engines.store import build_key
from miaohui.errors import ConfigError
from miaohui.models import encoder_attention, fast_bert, kernel_tables, skinny_gemm, skinny_ln, tuning
from miaohui.models.intent import IntentClassifier, random_bert
from miaohui.models.tuning import rules

H200_FILE = tuning.TUNING_DIR / "nvidia-h200-sm90.json"
H200 = tuning.Runtime("NVIDIA H200", (9, 0), "2.11.0+cu130", "3.6.0", 130100)
"""The GPU and versions the committed H200 file was measured with."""
BERT_BASE = (768, 3072, 12)
E5_SMALL = (384, 1536, 12)


@pytest.fixture
def clean_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops' tables are process-wide: give each test its own and put them back after."""
    monkeypatch.setattr(skinny_gemm, "SKINNY_BEST", {})
    monkeypatch.setattr(skinny_gemm, "SKINNY_PDL", False)
    monkeypatch.setattr(encoder_attention, "ATTN_BEST", {})
    monkeypatch.setattr(encoder_attention, "ATTN_SHAPES_ONLY", False)
    monkeypatch.setattr(skinny_ln, "LN_SPLIT_BEST", {})
    monkeypatch.setattr(skinny_gemm, "LT_BEST", {})


@pytest.fixture
def search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tuning folder of the test's own holding a copy of the H200 file."""
    monkeypatch.setattr(tuning, "SEARCH_PATH", [tmp_path])
    shutil.copy(H200_FILE, tmp_path / H200_FILE.name)
    return tmp_path


def _model(hidden: int = 64, intermediate: int = 128, heads: int = 4) -> torch.nn.Module:
    enc = random_bert(hidden=hidden, layers=1, heads=heads, vocab=100, intermediate=intermediate, seed=0)
    return fast_bert.from_module(IntentClassifier(enc, 24).eval())


def _layers(model: torch.nn.Module) -> list[fast_bert.FastBertLayer]:
    return [m for m in model.modules() if isinstance(m, fast_bert.FastBertLayer)]


def test_the_h200_file_has_bert_base_and_e5_small() -> None:
    assert tuning.file_name("NVIDIA H200", (9, 0)) == H200_FILE.name and H200_FILE.is_file()
    assert tuning.find("NVIDIA H200", (9, 0)) == H200_FILE
    bert = tuning.select(H200, BERT_BASE)
    assert (len(bert.skinny), len(bert.attention), len(bert.ln_split), len(bert.cublaslt)) == (8, 5, 1, 3)
    assert bert.skinny[(128, 2304, 768)] == (64, 64, 128, 1, 4) and bert.attention[(1, 12, 128, 64)] == (16, 128, 4, 2)
    assert bert.cublaslt.keys() == {(4096, 768, 768, False), (4096, 3072, 768, True), (16384, 768, 768, False)}
    assert bert.pdl_max_rows == 128 and bert.file == H200_FILE.name and bert.reason is None
    assert bert.digest == tuning.digest(H200_FILE)
    e5 = tuning.select(H200, E5_SMALL)
    assert (len(e5.skinny), len(e5.attention), len(e5.ln_split), len(e5.cublaslt)) == (8, 48, 2, 5)
    assert all(k[1] == 12 and k[3] == 32 for k in e5.attention)
    assert tuning.select(H200, (64, 128, 4)).reason == (
        "nvidia-h200-sm90.json has no entries for a model of hidden 64, FFN 128, 4 heads"
    )
    assert not any(tuning.select(H200, (64, 128, 4)).__dict__[k] for k in ("skinny", "attention", "cublaslt"))


def test_a_tuning_file_round_trips_and_a_bad_one_names_the_fix(tmp_path: Path) -> None:
    original = tuning.load(H200_FILE)
    tuning.dump(original, tmp_path / "again.json")
    assert tuning.load(tmp_path / "again.json") == original
    assert (tmp_path / "again.json").read_text() == H200_FILE.read_text()  # the committed file is dump's output
    assert '"qkv": [16, 32, 128, 1, 4]' in H200_FILE.read_text()  # one configuration a line
    (tmp_path / "bad.json").write_text('{"gpu": "X"}')
    with pytest.raises(ConfigError, match="bad.json is not valid") as err:
        tuning.load(tmp_path / "bad.json")
    assert "scripts/gpu/tune.py" in str(err.value.fix)
    assert tuning.file_name("NVIDIA GeForce RTX 4090", (8, 9)) == "nvidia-geforce-rtx-4090-sm89.json"


def test_other_versions_run_the_library_kernels_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Another torch or Triton: no entries at all. Another cuBLASLt: no cuBLASLt algorithms, the rest stays. Another
    GPU or compute capability: no file. Another precision: none."""
    with caplog.at_level(logging.WARNING, logger="miaohui.models.tuning"):
        other_torch = tuning.select(tuning.Runtime("NVIDIA H200", (9, 0), "2.12.0+cu130", "3.6.0", 130100), BERT_BASE)
    assert not other_torch.skinny and not other_torch.attention and not other_torch.cublaslt
    assert other_torch.reason == (
        "nvidia-h200-sm90.json was measured with torch 2.11.0+cu130 and Triton 3.6.0, this process has torch "
        "2.12.0+cu130 and Triton 3.6.0: library kernels (run scripts/gpu/tune.py here)"
    )
    assert other_torch.reason in caplog.text
    other_triton = tuning.select(tuning.Runtime("NVIDIA H200", (9, 0), "2.11.0+cu130", "3.5.1", 130100), BERT_BASE)
    assert not other_triton.skinny and "Triton 3.5.1" in str(other_triton.reason)
    other_lt = tuning.select(tuning.Runtime("NVIDIA H200", (9, 0), "2.11.0+cu130", "3.6.0", 130200), BERT_BASE)
    assert len(other_lt.skinny) == 8 and len(other_lt.attention) == 5 and not other_lt.cublaslt
    assert "for cuBLASLt 130100, this process has 130200" in str(other_lt.reason)
    assert tuning.select(tuning.Runtime("NVIDIA L4", (8, 9), "2.11.0+cu130", "3.6.0", 130100), BERT_BASE).reason == (
        f"no tuning file nvidia-l4-sm89.json for NVIDIA L4 in {tuning.TUNING_DIR}"
    )
    assert tuning.select(H200, BERT_BASE, "bf16").reason == "nvidia-h200-sm90.json was measured in fp16, not bf16"
    assert tuning.select(None, BERT_BASE).reason == "no CUDA GPU"


def test_build_switches_the_layers_and_records_the_file(clean_tables: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(768, 3072, 12)  # one BERT-base layer
    l4 = tuning.Runtime("NVIDIA L4", (8, 9), "2.11.0+cu130", "3.6.0", 130100)
    info = inductor.use_gpu_kernels(model, "tuned", runtime=l4)
    assert info == {
        "mode": "library",
        "reason": f"no tuning file nvidia-l4-sm89.json for NVIDIA L4 in {tuning.TUNING_DIR}",
    }
    assert not any(layer.skinny or layer.triton_attention for layer in _layers(model))
    assert inductor.use_gpu_kernels(model, "library") == {"mode": "library"}
    tiny = inductor.use_gpu_kernels(_model(), "tuned", runtime=H200)  # an H200, a model not measured
    assert tiny["mode"] == "library" and tiny["tuning_file"] == H200_FILE.name
    assert inductor.use_gpu_kernels(model, "tuned", "bf16", runtime=H200)["reason"] == (
        "nvidia-h200-sm90.json was measured in fp16, not bf16"
    )
    info = inductor.use_gpu_kernels(model, "tuned", runtime=H200)
    assert info == {
        "mode": "tuned",
        "dims": [768, 3072, 12],
        "tuning_file": H200_FILE.name,
        "tuning_digest": tuning.digest(H200_FILE),
        "skinny_gemm_shapes": 8,
        "ln_split_shapes": 1,
        "attention_shapes": 5,
        "cublaslt_shapes": 3,
        "pdl": True,
        "pdl_max_rows": 128,
    }
    assert all(layer.skinny and layer.triton_attention and layer.cublaslt for layer in _layers(model))
    assert skinny_gemm.SKINNY_PDL and encoder_attention.ATTN_SHAPES_ONLY
    assert (1, 12, 16, 64) in encoder_attention.ATTN_BEST and (16, 2304, 768) in skinny_gemm.SKINNY_BEST
    assert (4096, 3072, 768, True) in skinny_gemm.LT_BEST and (128, 768, 768) in skinny_ln.LN_SPLIT_BEST
    # another cuBLASLt: the rest of the tuned kernels, no cuBLASLt switch
    other_lt = tuning.Runtime("NVIDIA H200", (9, 0), "2.11.0+cu130", "3.6.0", 1)
    info_lt = inductor.use_gpu_kernels(model, "tuned", runtime=other_lt)
    assert info_lt["mode"] == "tuned" and info_lt["cublaslt_shapes"] == 0 and "cuBLASLt 130100" in info_lt["reason"]
    assert not any(layer.cublaslt for layer in _layers(model))
    # an artifact built so loads the same entries; one built with library kernels touches nothing
    monkeypatch.setattr(skinny_gemm, "SKINNY_BEST", {})
    monkeypatch.setattr(tuning.Runtime, "detect", classmethod(lambda cls: H200))
    assert inductor.gpu_kernels_at_load({"gpu_kernels": info}) == info
    assert len(skinny_gemm.SKINNY_BEST) == 8 and skinny_gemm.SKINNY_PDL
    assert inductor.program_pdl(info, None) and inductor.program_pdl(info, 128) and not inductor.program_pdl(info, 4096)
    assert inductor.gpu_kernels_at_load({"gpu_kernels": {"mode": "library"}}) == {"mode": "library"}
    assert inductor.gpu_kernels_at_load({}) == {}
    assert not inductor.program_pdl({}, None) and not inductor.program_pdl({"mode": "library"}, 16)


def test_a_load_warns_when_the_tuning_file_changed_since_the_build(
    clean_tables: None, search: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    info = inductor.use_gpu_kernels(_model(768, 3072, 12), "tuned", runtime=H200)
    monkeypatch.setattr(tuning.Runtime, "detect", classmethod(lambda cls: H200))
    with caplog.at_level(logging.WARNING, logger="miaohui.engines.inductor"):
        inductor.gpu_kernels_at_load({"gpu_kernels": info})
    assert "rebuild" not in caplog.text
    changed = tuning.load(search / H200_FILE.name).model_copy(update={"pdl_max_rows": 256})
    tuning.dump(changed, search / H200_FILE.name)
    with caplog.at_level(logging.WARNING, logger="miaohui.engines.inductor"):
        inductor.gpu_kernels_at_load({"gpu_kernels": info})
    assert f"built with tuning file {H200_FILE.name} (sha256 {info['tuning_digest'][:12]})" in caplog.text
    assert "rebuild the engine here" in caplog.text


def test_the_tuning_files_digest_is_part_of_a_tuned_gpu_build_key(search: Path) -> None:
    h200 = Target(device="cuda", gpu_name="NVIDIA H200", compute_capability="sm90")
    tuned, library = (
        BuildConfig(backend="inductor", precision="fp16"),
        BuildConfig(backend="inductor", precision="fp16", gpu_kernels="library"),
    )
    before = build_key("src", tuned, h200), build_key("src", library, h200)
    changed = tuning.load(search / H200_FILE.name).model_copy(update={"pdl_max_rows": 256})
    tuning.dump(changed, search / H200_FILE.name)
    after = build_key("src", tuned, h200), build_key("src", library, h200)
    assert before[0] != after[0]  # the tuned build is rebuilt when its file changes
    assert before[1] == after[1]  # the library build does not read it
    l4 = Target(device="cuda", gpu_name="NVIDIA L4", compute_capability="sm89")  # no file: as before files existed
    (search / H200_FILE.name).unlink()
    assert build_key("src", tuned, h200) == build_key("src", tuned, h200) != after[0]
    assert build_key("src", tuned, l4) != build_key("src", library, l4)  # the options differ, not a digest


def test_exported_program_with_the_custom_ops_saves_and_loads(clean_tables: None, tmp_path: Path) -> None:
    """The engine's format on the GPU: ``torch.export`` of FastBert with the ops, saved, loaded in the same process
    (the ops are registered by importing miaohui), run: on the CPU each op's library form."""
    enc = random_bert(hidden=64, layers=2, heads=4, vocab=500, intermediate=128, seed=0)
    model = fast_bert.from_module(IntentClassifier(enc, 24).eval())
    ids = torch.randint(5, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, 7:] = 0
    with torch.inference_mode():
        want = model(ids, mask)
    fast_bert.use_kernels(model, skinny=True, attention=True)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("sequence", min=2, max=64)
    ep = torch.export.export(model, (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    ops = {"miaohui.skinny_linear.default", "miaohui.encoder_attention.default", "miaohui.proj_ln_proj.default"}
    assert ops <= targets
    torch.export.save(ep, str(tmp_path / "program.pt2"))
    loaded = torch.export.load(str(tmp_path / "program.pt2")).module()
    with torch.inference_mode():
        got = loaded(ids, mask)
        longer = loaded(torch.cat([ids, ids], 1), torch.cat([mask, mask], 1))  # another sequence length
    # the skinny op's CPU form takes the FFN's GELU in its tanh form (the GPU kernel's), the model erf
    assert float((got - want).abs().max()) < 1e-2
    assert longer.shape == (2, 24)


def test_gpu_kernels_is_an_inductor_option() -> None:
    with pytest.raises(ConfigError, match="gpu_kernels library with backend onnxruntime"):
        BuildConfig(backend="onnxruntime", gpu_kernels="library")
    ort = BuildConfig(backend="onnxruntime")  # other backends' build keys do not hash it
    fields = ort.model_dump(mode="json")
    for name in ("calibration", "autotune", "inductor_format", "gpu_kernels", "static_shapes"):
        fields.pop(name)
    assert ort.compute_hash() == digest_json(fields)


def test_attention_entries_need_a_ten_percent_gain_over_sdpa() -> None:
    best = [
        {"batch": 1, "seq": 128, "config": [16, 128, 4, 2], "us": 3.0, "sdpa_us": 6.9},
        {"batch": 32, "seq": 128, "config": [64, 64, 4, 1], "us": 9.0, "sdpa_us": 10.0},
        {"batch": 128, "seq": 128, "config": [64, 64, 4, 1], "us": 44.7, "sdpa_us": 45.5},
    ]
    assert rules.attention_entries(best) == {(1, 128): (16, 128, 4, 2), (32, 128): (64, 64, 4, 1)}
    assert rules.MIN_ATTN_GAIN == 0.10


def test_skinny_rows_need_their_chain_faster_than_cublas() -> None:
    cfgs = {"qkv": [16, 32, 128, 1, 4], "attn_out": [16, 32, 128, 4, 4]}
    chains = {
        16: {"configs": cfgs, "us": 254.8, "cublas_us": 255.1},
        512: {"configs": cfgs, "us": 400, "cublas_us": 390},
    }
    assert rules.skinny_entries(chains) == {16: {"qkv": (16, 32, 128, 1, 4), "attn_out": (16, 32, 128, 4, 4)}}


def test_a_forced_split_needs_its_pair_five_percent_faster() -> None:
    def row(rows: int, gemm: str, piece: str, us: float, cfg: list[int] | None = None) -> dict:
        return {"rows": rows, "gemm": gemm, "piece": piece, "us": us} | ({"config": cfg} if cfg else {})

    pairs = [
        row(128, "attn_out", "unfused", 12.0),
        row(128, "attn_out", "split2_bk128", 11.5, [64, 32, 128, 2, 4]),  # 4 %: not alone
        row(128, "attn_out", "split4_bk64", 10.5, [64, 32, 64, 4, 4]),  # 12.5 %: the entry
        row(16, "attn_out", "unfused", 8.0),
        row(16, "attn_out", "split3_bk64", 7.8, [16, 32, 64, 3, 4]),  # 2.5 %: no entry
        row(16, "ffn_out", "unfused", 9.0),
        row(16, "ffn_out", "table", 7.0),  # the table's own split: not a forced one
    ]
    assert rules.ln_split_entries(pairs) == {128: {"attn_out": (64, 32, 64, 4, 4)}}
    assert rules.ln_split_entries([]) == {}


def test_a_cublaslt_algorithm_needs_a_three_percent_gain_over_torchs_faster_timing() -> None:
    def best(m: int, gemm: str, torch_us: float, again: float, us: float) -> dict:
        return {"m": m, "gemm": gemm, "torch_us": torch_us, "torch_again_us": again, "best_us": us,
                "hex": f"{m}-{gemm}"}  # fmt: skip

    timed = [
        best(4096, "ffn_in", 36.6, 36.9, 33.9),  # 7.4 %: an entry
        best(4096, "attn_out", 10.2, 10.3, 9.95),  # 2.5 %: no entry
        best(16384, "qkv", 102.4, 93.0, 92.7),  # 9.5 % against the first timing, 0.3 % against the faster: none
        best(16384, "attn_out", 33.8, 34.8, 31.8),  # 5.9 %
    ]
    assert rules.lt_entries(timed) == {4096: {"ffn_in": "4096-ffn_in"}, 16384: {"attn_out": "16384-attn_out"}}


def test_cublaslt_on_a_machine_without_a_gpu() -> None:
    """No GPU: the version is None and the library refuses with the fix; a file's algorithm must be 64 bytes; the
    op's ``lt`` changes nothing on the CPU (torch's call)."""
    from miaohui.models import cublaslt

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cublaslt.version_or_none() is None and tuning.Runtime.detect() is None
    with pytest.raises(cublaslt.LtError, match="needs a CUDA build of torch and a GPU"):
        cublaslt.library()
    with pytest.raises(ValueError, match="64 bytes, not 3"):
        cublaslt.Algo.from_hex("abcdef")
    text = tuning.load(H200_FILE).models[0].cublaslt[4096]["ffn_in"]
    algo = cublaslt.Algo.from_hex(text)
    assert len(algo.blob) == 64 and algo.hex() == text
    x, w, b = torch.randn(2, 8, 16), torch.randn(24, 16), torch.randn(24)
    assert torch.equal(skinny_gemm.skinny_op(x, w, b, False, True), torch.nn.functional.linear(x, w, b))
    assert kernel_tables.model_dims(_model()) == (64, 128, 4)


def test_tune_turns_the_probes_reports_into_the_committed_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scripts/gpu/tune.py`` fed the reports its probes wrote on the H200 for e5-small (trimmed to the fields it
    reads, ``tests/data``) gives exactly the committed file's e5-small entries: the rules and the file agree."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("tune_script", root / "scripts" / "gpu" / "tune.py")
    assert spec is not None and spec.loader is not None
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    reports = json.loads((root / "tests" / "data" / "tune_probes_e5_small_h200.json").read_text())
    ran: list[tuple[str, tuple[str, ...]]] = []

    def probe(name: str, out: Path, *args: str) -> dict:
        ran.append((name, args))
        return reports.get(name, {})

    monkeypatch.setattr(tune, "probe", probe)
    args = argparse.Namespace(rows="16,128", attn_shapes=tune.ATTN_SHAPES, lt_rows="512,4096,16384")
    got = tune.tune_model(384, 1536, 12, tmp_path, args)
    want = next(m for m in tuning.load(H200_FILE).models if m.hidden == 384)
    assert got.skinny == want.skinny and got.ln_split == want.ln_split and got.cublaslt == want.cublaslt
    assert sorted(got.attention, key=lambda a: (a.batch, a.seq)) == sorted(
        want.attention, key=lambda a: (a.batch, a.seq)
    )
    assert [name for name, _ in ran] == [
        "encoder_gemm_sweep",
        "pdl_probe",
        "ln_fusion_probe",
        "attn_probe",
        "cublaslt_probe",
    ]
    assert ran[2][1][-4:] == ("--rows", "16,128", "--skinny", str(tmp_path / "skinny.json"))
    assert ran[3][1][:4] == ("--heads", "12", "--head-size", "32")
