"""``gpu_kernels`` (``models/kernel_tables.py``, the ``inductor`` backend's choice of miaohui's Triton kernels): which
shapes each GPU's table covers, how the build switches the model and what it records, that a program holding the
custom ops survives ``torch.export`` save and load (the engine's format), and the config's checks. On the GPU:
``tests/gpu/test_gpu_kernels_gpu.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miaohui.config import BuildConfig, digest_json
from miaohui.engines import inductor
from miaohui.errors import ConfigError
from miaohui.models import encoder_attention, fast_bert, kernel_tables, skinny_gemm, skinny_ln
from miaohui.models.intent import IntentClassifier, random_bert


@pytest.fixture
def clean_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops' tables are process-wide: give each test its own and put them back after."""
    monkeypatch.setattr(skinny_gemm, "SKINNY_BEST", {})
    monkeypatch.setattr(skinny_gemm, "SKINNY_PDL", False)
    monkeypatch.setattr(encoder_attention, "ATTN_BEST", {})
    monkeypatch.setattr(encoder_attention, "ATTN_SHAPES_ONLY", False)
    monkeypatch.setattr(skinny_ln, "LN_SPLIT_BEST", {})
    monkeypatch.setattr(skinny_gemm, "LT_BEST", {})


def _model() -> torch.nn.Module:
    enc = random_bert(hidden=64, layers=2, heads=4, vocab=500, intermediate=128, seed=0)
    return fast_bert.from_module(IntentClassifier(enc, 24).eval())


BERT_BASE = (768, 3072, 12)
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _report(name: str) -> dict:
    """A committed probe's JSON from ``benchmarks/results``."""
    return json.loads((RESULTS / name).read_text())


def test_only_the_h200_has_tables_for_bert_base_and_e5_small() -> None:
    skinny, attn = kernel_tables.tables_for((9, 0), BERT_BASE)
    assert len(skinny) == 8 and len(attn) == 5
    assert skinny[(128, 2304, 768)] == kernel_tables.SKINNY_ROWS[128]["qkv"]
    assert skinny[(16, 768, 3072)] == kernel_tables.SKINNY_ROWS[16]["ffn_out"]
    assert attn[(1, 12, 128, 64)] == (16, 128, 4, 2)
    for other in [(8, 0), (8, 9), (10, 0), None]:
        assert kernel_tables.tables_for(other, BERT_BASE) == ({}, {})
    # e5-small (12 heads of 32): its own GEMM rows and attention shapes; the tiny test model: nothing measured
    skinny, attn = kernel_tables.tables_for((9, 0), (384, 1536, 12))
    assert len(skinny) == 8 and len(attn) == 48 and all(k[1:4:2] == (12, 32) for k in attn)
    assert skinny[(128, 1152, 384)] == (64, 32, 128, 1, 4) and skinny[(16, 384, 1536)] == (16, 32, 128, 4, 4)
    assert kernel_tables.tables_for((8, 9), (384, 1536, 12)) == ({}, {})
    assert kernel_tables.tables_for((9, 0), (64, 128, 4)) == ({}, {})
    assert kernel_tables.model_dims(_model()) == (64, 128, 4)


def test_build_switches_the_layers_where_a_table_exists(clean_tables: None, monkeypatch: pytest.MonkeyPatch) -> None:
    enc = random_bert(hidden=768, layers=1, heads=12, vocab=100, intermediate=3072, seed=0)
    model = fast_bert.from_module(IntentClassifier(enc, 24).eval())  # one BERT-base layer
    monkeypatch.setattr(kernel_tables, "device_capability", lambda: (8, 9))  # an L4: no table
    info = inductor.use_gpu_kernels(model, "triton")
    assert info == {
        "mode": "library",
        "reason": "no measured kernel for this model (768, 3072, 12) on compute capability (8, 9)",
    }
    layers = [m for m in model.modules() if isinstance(m, fast_bert.FastBertLayer)]
    assert not any(layer.skinny or layer.triton_attention for layer in layers)
    assert inductor.use_gpu_kernels(model, "library") == {"mode": "library"}

    monkeypatch.setattr(kernel_tables, "device_capability", lambda: (9, 0))
    assert inductor.use_gpu_kernels(_model(), "triton")["mode"] == "library"  # an H200, but a model not measured
    assert inductor.use_gpu_kernels(model, "triton", "bf16") == {
        "mode": "library",
        "reason": "the kernel tables were measured in fp16, not bf16",
    }
    info = inductor.use_gpu_kernels(model, "triton")
    assert info == {
        "mode": "triton",
        "capability": "9.0",
        "dims": [768, 3072, 12],
        "skinny_gemm_shapes": 8,
        "ln_split_shapes": len(kernel_tables.ln_split_table(768, 3072)),
        "attention_shapes": 5,
        "pdl": True,
        "cublaslt_shapes": 0,  # no GPU here, so no cuBLASLt whose version could match the table's
        "pdl_max_rows": 128,
        "ln_fusion": True,
        "cublaslt": False,
    }
    assert all(layer.skinny and layer.triton_attention and layer.ln_fusion for layer in layers)
    assert not any(layer.cublaslt for layer in layers) and not skinny_gemm.LT_BEST
    assert skinny_gemm.SKINNY_PDL and encoder_attention.ATTN_SHAPES_ONLY
    assert (1, 12, 16, 64) in encoder_attention.ATTN_BEST and (16, 2304, 768) in skinny_gemm.SKINNY_BEST
    assert kernel_tables.ln_split_table(768, 3072) == skinny_ln.LN_SPLIT_BEST and skinny_ln.LN_SPLIT_BEST
    # an artifact built so loads the same tables; one built with library kernels touches nothing
    monkeypatch.setattr(skinny_gemm, "SKINNY_BEST", {})
    assert inductor.gpu_kernels_at_load({"gpu_kernels": info}) == info
    assert len(skinny_gemm.SKINNY_BEST) == 8 and skinny_gemm.SKINNY_PDL
    assert inductor.program_pdl(info, None) and inductor.program_pdl(info, 128) and not inductor.program_pdl(info, 4096)
    assert inductor.gpu_kernels_at_load({"gpu_kernels": {"mode": "library"}}) == {"mode": "library"}
    assert inductor.gpu_kernels_at_load({}) == {}  # artifacts built before the option
    assert not inductor.program_pdl({}, None) and not inductor.program_pdl({"mode": "library"}, 16)


def test_pdl_off_and_the_row_limit(clean_tables: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``BuildConfig.pdl off``: every program without PDL. ``auto`` with the GPU's row limit: the dynamic-shape
    program and static programs up to the limit with it, larger static programs without; a load follows the
    manifest's record, not today's table. The skinny GEMMs' own PDL is process-wide and never turned off by a later
    build or load (another engine's buckets may still be captured)."""
    assert kernel_tables.pdl_max_rows((9, 0)) == 128  # the H200's, as committed
    enc = random_bert(hidden=768, layers=1, heads=12, vocab=100, intermediate=3072, seed=0)
    model = fast_bert.from_module(IntentClassifier(enc, 24).eval())
    monkeypatch.setattr(kernel_tables, "device_capability", lambda: (9, 0))
    no_ln = inductor.use_gpu_kernels(model, "triton", "fp16", ln_fusion=False)  # BuildConfig.ln_fusion off
    assert no_ln["ln_fusion"] is False and not any(m.ln_fusion for m in model.modules() if hasattr(m, "ln_fusion"))
    off = inductor.use_gpu_kernels(model, "triton", "fp16", pdl=False)
    assert off["mode"] == "triton" and off["pdl"] is False and "pdl_max_rows" not in off
    assert skinny_gemm.SKINNY_PDL and not inductor.program_pdl(off, None) and not inductor.program_pdl(off, 16)

    monkeypatch.setattr(kernel_tables, "PDL_MAX_ROWS_H200", 128)
    auto = inductor.use_gpu_kernels(model, "triton", "fp16")
    assert auto["pdl"] is True and auto["pdl_max_rows"] == 128 and skinny_gemm.SKINNY_PDL
    assert inductor.program_pdl(auto, None) and inductor.program_pdl(auto, 128)
    assert not inductor.program_pdl(auto, 129) and not inductor.program_pdl(auto, 4096)

    monkeypatch.setattr(kernel_tables, "PDL_MAX_ROWS_H200", None)  # the table changed since the build
    assert inductor.gpu_kernels_at_load({"gpu_kernels": auto}) == auto
    assert not inductor.program_pdl(auto, 4096)
    inductor.gpu_kernels_at_load({"gpu_kernels": off})
    assert inductor.use_gpu_kernels(_model(), "triton")["mode"] == "library"  # a model without entries
    assert skinny_gemm.SKINNY_PDL  # neither turned the skinny GEMMs' PDL off
    assert kernel_tables.pdl_max_rows((8, 9)) is None


def test_exported_program_with_the_custom_ops_saves_and_loads(clean_tables: None, tmp_path: Path) -> None:
    """The engine's format on the GPU: ``torch.export`` of FastBert with both ops, saved, loaded in the same
    process (the ops are registered by importing miaohui), run: on the CPU each op's library form."""
    model = _model()
    ids = torch.randint(5, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, 7:] = 0
    with torch.inference_mode():
        want = model(ids, mask)
    fast_bert.use_skinny(model)
    fast_bert.use_triton_attention(model)
    fast_bert.use_ln_fusion(model)
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
    # other backends' build keys do not change with the option's arrival: it is not hashed for them
    ort = BuildConfig(backend="onnxruntime")
    fields = ort.model_dump(mode="json")
    for name in (
        "calibration",
        "autotune",
        "inductor_format",
        "gpu_kernels",
        "static_shapes",
        "pdl",
        "ln_fusion",
        "cublaslt",
    ):
        fields.pop(name)
    assert ort.compute_hash() == digest_json(fields)
    a = BuildConfig(backend="inductor", precision="fp16")
    b = BuildConfig(backend="inductor", precision="fp16", gpu_kernels="library")
    assert a.compute_hash() != b.compute_hash()


def test_probe_entries_need_a_ten_percent_gain_over_sdpa() -> None:
    """``attention_entries``: the rule the H200's table was chosen by, now code (the benchmark's ``--attn-probe``)."""
    report = {
        "head_size": 32,
        "best": [
            {"batch": 1, "heads": 12, "seq": 128, "config": [16, 128, 4, 2], "us": 3.0, "sdpa_us": 6.9},
            {"batch": 32, "heads": 12, "seq": 128, "config": [64, 64, 4, 1], "us": 9.0, "sdpa_us": 10.0},
            {"batch": 128, "heads": 12, "seq": 128, "config": [64, 64, 4, 1], "us": 44.7, "sdpa_us": 45.5},
        ],
    }
    assert kernel_tables.attention_entries(report) == {
        (1, 12, 128, 32): (16, 128, 4, 2),
        (32, 12, 128, 32): (64, 64, 4, 1),
    }
    assert kernel_tables.MIN_ATTN_GAIN == 0.10


@pytest.mark.parametrize(
    ("probes", "head_size"),
    [
        (["attn_probe_h200_s27a.json"], 64),
        (["attn_probe_e5_grid_h200_s28f.json", "attn_probe_e5_h200_s28e.json"], 32),  # the full sweep's win
    ],
)
def test_the_committed_attention_table_is_its_probes_under_the_rule(probes: list[str], head_size: int) -> None:
    entries = {}
    for probe in probes:
        report = _report(probe)
        assert report["head_size"] == head_size
        entries |= kernel_tables.attention_entries(report)
    assert {k: v for k, v in kernel_tables.ATTN_H200.items() if k[3] == head_size} == entries


@pytest.mark.parametrize(("probe", "dims"), [("pdl_probe_h200_s26b.json", (768, 3072)),
                                              ("pdl_probe_e5_h200_s29a.json", (384, 1536))])  # fmt: skip
def test_the_committed_gemm_rows_are_their_probes_configurations_and_beat_cublas(
    probe: str, dims: tuple[int, int]
) -> None:
    """Each width's skinny rows are the configurations ``pdl_probe.py`` timed, and at every row count the chain of
    12 layers' GEMMs launched as programmatic dependents was faster than cuBLAS's (the rule the table was made by)."""
    report = _report(probe)
    assert (report.get("hidden", 768), report.get("intermediate", 3072)) == dims  # s26b's predates the fields
    table = kernel_tables.SKINNY_H200[dims]
    if "configs" in report:  # s26b's timed the table itself
        assert {int(m): {g: tuple(c) for g, c in cfgs.items()} for m, cfgs in report["configs"].items()} == table
    chain = {(r["rows"], r["variant"]): r["us_per_chain"] for r in report["rows"]}
    for rows in table:
        assert chain[(rows, "skinny_pdl")] < chain[(rows, "cublas")], (probe, rows)


def test_a_forced_split_needs_its_pair_five_percent_faster() -> None:
    """``ln_split_entries``: per rows and first product, the fastest forced split of the probe's pairs with PDL, kept
    only where it beats the unfused pair by MIN_LN_SPLIT_GAIN; runs without PDL and plain pieces are not candidates."""

    def row(rows: int, pair: str, piece: str, us: float, pdl: bool = True, cfg: list[int] | None = None) -> dict:
        return {"rows": rows, "pair": pair, "pdl": pdl, "piece": piece, "us": us} | ({"config": cfg} if cfg else {})

    report = {"rows": [
        row(128, "attn_out->ffn_in", "unfused", 12.0),
        row(128, "attn_out->ffn_in", "fused_split2_bk128", 11.5, cfg=[64, 32, 128, 2, 4]),  # 4 %: not alone
        row(128, "attn_out->ffn_in", "fused_split4_bk64", 10.5, cfg=[64, 32, 64, 4, 4]),  # 12.5 %: the entry
        row(128, "attn_out->ffn_in", "fused_split6_bk64", 9.0, pdl=False, cfg=[64, 32, 64, 6, 4]),  # without PDL
        row(16, "attn_out->ffn_in", "unfused", 8.0),
        row(16, "attn_out->ffn_in", "fused_split3_bk64", 7.8, cfg=[16, 32, 64, 3, 4]),  # 2.5 %: no entry
        row(16, "ffn_out->qkv", "unfused", 9.0),
        row(16, "ffn_out->qkv", "fused", 7.0),  # the table's own split: not a forced one
    ]}  # fmt: skip
    assert kernel_tables.ln_split_entries(report) == {128: {"attn_out": (64, 32, 64, 4, 4)}}
    assert kernel_tables.ln_split_entries({"rows": []}) == {}


@pytest.mark.parametrize("model", ["bert", "e5"])
def test_the_committed_forced_splits_are_their_probes_winners(model: str) -> None:
    report = _report(f"ln_fusion_probe_{model}_h200_s31a.json")
    widths = (report["hidden"], report["intermediate"])
    assert kernel_tables.LN_SPLIT_H200[widths] == kernel_tables.ln_split_entries(report)
    for rows, products in kernel_tables.LN_SPLIT_H200[widths].items():  # only products the plain table does not split
        assert all(kernel_tables.SKINNY_H200[widths][rows][name][3] == 1 for name in products)


@pytest.mark.parametrize("model", ["bert", "e5"])
def test_add_ln_launch_is_within_five_percent_of_the_probes_fastest(model: str) -> None:
    """``skinny_ln.add_ln_launch``'s rule against ``ln_fusion_probe.py --add-ln-rows``'s sweep, at every probed
    shape."""
    sweep = _report(f"ln_fusion_probe_{model}_h200_s31a.json")["add_ln"]
    shapes = {(r["rows"], r["width"]) for r in sweep}
    assert len(shapes) == 2
    for m, n in shapes:
        times = {r["launch"]: r["us"] for r in sweep if (r["rows"], r["width"]) == (m, n) and r["launch"] != "inductor"}
        rows, warps = skinny_ln.add_ln_launch(m, n)
        assert times[f"rows{rows}_w{warps}"] <= 1.05 * min(times.values()), (m, n, rows, warps)


def test_bench_ln_split_override_none_and_a_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench_gpu_encoder.py --ln-split``: ``none`` empties the forced splits for the run (the A/B), a probe's JSON
    puts its winners in for its widths."""
    import sys

    bench_dir = RESULTS.parent
    sys.path.insert(0, str(bench_dir))
    try:
        import bench_gpu_encoder
    finally:
        sys.path.remove(str(bench_dir))
    monkeypatch.setattr(kernel_tables, "LN_SPLIT_H200", {k: dict(v) for k, v in kernel_tables.LN_SPLIT_H200.items()})
    probe = RESULTS / "ln_fusion_probe_e5_h200_s31a.json"
    kernel_tables.LN_SPLIT_H200[(384, 1536)] = {}
    used = bench_gpu_encoder.ln_split_override(str(probe))
    assert used["384x1536"] == {16: {"attn_out": (16, 32, 64, 3, 4)}, 128: {"attn_out": (64, 32, 64, 2, 4)}}
    assert bench_gpu_encoder.ln_split_override("none") == {} and kernel_tables.ln_split_table(768, 3072) == {}


def test_a_cublaslt_algorithm_needs_a_three_percent_gain_over_torchs_faster_timing() -> None:
    """``lt_entries``: per rows and product, the probe's fastest candidate is kept only where it beats torch's call by
    MIN_LT_GAIN, torch's call taken as the faster of its two timings (before and after the candidates)."""

    def best(m: int, gemm: str, torch_us: float, again: float, us: float) -> dict:
        return {"m": m, "gemm": gemm, "torch_us": torch_us, "torch_again_us": again, "best_us": us,
                "best": {"hex": f"{m}-{gemm}"}}  # fmt: skip

    report = {"best": [
        best(4096, "ffn_in", 36.6, 36.9, 33.9),  # 7.4 %: an entry
        best(4096, "attn_out", 10.2, 10.3, 9.95),  # 2.5 %: no entry
        best(16384, "qkv", 102.4, 93.0, 92.7),  # 9.5 % against the first timing, 0.3 % against the faster: none
        best(16384, "attn_out", 33.8, 34.8, 31.8),  # 5.9 %
    ]}  # fmt: skip
    assert kernel_tables.lt_entries(report) == {4096: {"ffn_in": "4096-ffn_in"}, 16384: {"attn_out": "16384-attn_out"}}
    del report["best"][0]["torch_again_us"]  # s34a's probe timed torch once
    assert kernel_tables.lt_entries(report)[4096] == {"ffn_in": "4096-ffn_in"}


@pytest.mark.parametrize("model", ["bert", "e5"])
def test_the_committed_cublaslt_table_is_its_probes_winners(model: str) -> None:
    report = _report(f"cublaslt_probe_{model}_h200_s34c.json")
    widths = (report["hidden"], report["intermediate"])
    assert kernel_tables.LT_H200[widths] == kernel_tables.lt_entries(report) and kernel_tables.LT_H200[widths]
    assert report["cublaslt"] == kernel_tables.LT_H200_CUBLASLT and report["pool"]
    for entry in report["best"]:  # every winner was checked against fp32 on the GPU
        assert entry["best"]["rel_err"] < 5e-3


def test_the_cublaslt_table_loads_only_for_its_version(clean_tables: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An H200 whose cuBLASLt is the table's version gets its entries (keyed by rows, N, K and the GELU epilogue) and
    the build switches the layers' ``cublaslt`` on; another version, another GPU or ``cublaslt off``: none of it."""
    from miaohui.models import cublaslt

    enc = random_bert(hidden=768, layers=1, heads=12, vocab=100, intermediate=3072, seed=0)
    model = fast_bert.from_module(IntentClassifier(enc, 24).eval())
    monkeypatch.setattr(kernel_tables, "device_capability", lambda: (9, 0))
    monkeypatch.setattr(cublaslt, "version_or_none", lambda: kernel_tables.LT_H200_CUBLASLT)
    table = kernel_tables.lt_table((9, 0), 768, 3072)
    assert (4096, 3072, 768, True) in table and (4096, 768, 768, False) in table
    off = inductor.use_gpu_kernels(model, "triton", "fp16", cublaslt=False)  # BuildConfig.cublaslt off
    assert off["cublaslt_shapes"] == len(table) and off["cublaslt"] is False
    assert not any(m.cublaslt for m in model.modules() if isinstance(m, fast_bert.FastBertLayer))
    info = inductor.use_gpu_kernels(model, "triton", "fp16")
    assert info["cublaslt"] is True and table == skinny_gemm.LT_BEST
    assert all(m.cublaslt for m in model.modules() if isinstance(m, fast_bert.FastBertLayer))
    assert kernel_tables.lt_table((8, 9), 768, 3072) == {}
    monkeypatch.setattr(cublaslt, "version_or_none", lambda: kernel_tables.LT_H200_CUBLASLT + 1)
    assert kernel_tables.lt_table((9, 0), 768, 3072) == {}
    assert inductor.use_gpu_kernels(model, "triton", "fp16")["cublaslt"] is False


def test_cublaslt_on_a_machine_without_a_gpu() -> None:
    """No GPU: the version is None and the library refuses with the fix; a table's algorithm must be 64 bytes; the
    op's ``lt`` changes nothing on the CPU (torch's call)."""
    from miaohui.models import cublaslt

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cublaslt.version_or_none() is None
    with pytest.raises(cublaslt.LtError, match="needs a CUDA build of torch and a GPU"):
        cublaslt.library()
    with pytest.raises(ValueError, match="64 bytes, not 3"):
        cublaslt.Algo.from_hex("abcdef")
    algo = cublaslt.Algo.from_hex(kernel_tables.LT_H200[(768, 3072)][4096]["ffn_in"])
    assert len(algo.blob) == 64 and algo.hex() == kernel_tables.LT_H200[(768, 3072)][4096]["ffn_in"]
    x, w, b = torch.randn(2, 8, 16), torch.randn(24, 16), torch.randn(24)
    assert torch.equal(skinny_gemm.skinny_op(x, w, b, False, True), torch.nn.functional.linear(x, w, b))


def test_bench_lt_override_none_and_a_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench_gpu_encoder.py --lt``: ``none`` empties the cuBLASLt table for the run, a probe's JSON puts its winners
    in for its widths (and its cuBLASLt version)."""
    import sys

    bench_dir = RESULTS.parent
    sys.path.insert(0, str(bench_dir))
    try:
        import bench_gpu_encoder
    finally:
        sys.path.remove(str(bench_dir))
    monkeypatch.setattr(kernel_tables, "LT_H200", {})
    monkeypatch.setattr(kernel_tables, "LT_H200_CUBLASLT", 0)
    used = bench_gpu_encoder.lt_override(str(RESULTS / "cublaslt_probe_e5_h200_s34c.json"))
    assert used == {"384x1536": {4096: ["attn_out", "qkv"], 16384: ["attn_out", "ffn_in", "qkv"]}}
    assert kernel_tables.LT_H200_CUBLASLT == 130100
    assert bench_gpu_encoder.lt_override("none") == {}
