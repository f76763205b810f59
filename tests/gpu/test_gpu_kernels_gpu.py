"""``gpu_kernels tuned`` on a GPU with a tuning file (``models/tuning``, the H200's): the BERT-base-shaped intent
engine (random weights) built with the file's kernels against the same build with library kernels only — the manifest
says which file and what it ran, the file's shapes run miaohui's kernels (profiled kernel names), every shape gives the
library engine's logits, and a bucket outside the file falls back to cuBLAS / SDPA. At 32×128 the file's cuBLASLt
algorithms run where this cuBLASLt is the file's version."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from miaohui.config import BuildConfig, parse_shapes
from miaohui.engines.inductor_engine import InductorEngine
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact, read_manifest
from miaohui.models import skinny_gemm, tuning
from miaohui.models.checkpoint import load_checkpoint
from miaohui.models.tiny import save_bert_base_intent

pytestmark = pytest.mark.gpu
SEL = tuning.select(tuning.Runtime.detect(), (768, 3072, 12))
"""This GPU's tuning entries for BERT-base (none: no file for it, or other library versions)."""
TUNED = bool(SEL.skinny and SEL.attention)
NOT_TUNED = f"no tuning entries for BERT-base here: {SEL.reason}"


@pytest.fixture(scope="module")
def bert_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bert_base_intent(tmp_path_factory.mktemp("bert") / "bert-base-random")


@pytest.fixture(scope="module")
def engines(bert_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, InductorEngine]:
    repo = tmp_path_factory.mktemp("kernels-repo")
    skinny_gemm._LT_PLANS.clear()  # the process-wide plan cache: only this module's engines' plans are checked below
    out = {}
    for name, kernels, static in (("tuned", "tuned", ""), ("library", "library", ""), ("static", "tuned", "1x128")):
        cfg = BuildConfig(
            backend="inductor",
            precision="fp16",
            shapes=parse_shapes("input_ids:1x1,8x64,32x128"),
            inductor_format="exported-program",
            gpu_kernels=kernels,
            static_shapes=static,  # type: ignore[arg-type]
        )
        path = build_artifact(bert_base, f"bert-{name}", cfg, repo, log=print).path
        engine = load_engine(path)
        assert isinstance(engine, InductorEngine)
        out[name] = engine
    return out


def _feeds(b: int, s: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(b * 1000 + s).integers(5, 20000, (b, s)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[0, s // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _kernel_names(engine: InductorEngine, feeds: dict[str, np.ndarray]) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    engine.infer(feeds)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.infer(feeds)
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


@pytest.mark.skipif(not TUNED, reason=NOT_TUNED)
def test_manifest_says_which_kernels(engines: dict[str, InductorEngine]) -> None:
    tuned = read_manifest(engines["tuned"].path).extra["gpu_kernels"]
    assert {k: v for k, v in tuned.items() if k != "reason"} == {
        "mode": "tuned",
        "dims": [768, 3072, 12],
        "tuning_file": SEL.file,
        "tuning_digest": SEL.digest,
        "skinny_gemm_shapes": len(SEL.skinny),
        "ln_split_shapes": len(SEL.ln_split),
        "attention_shapes": len(SEL.attention),
        "cublaslt_shapes": len(SEL.cublaslt),
        "pdl": True,
        "pdl_max_rows": SEL.pdl_max_rows,
    }
    assert read_manifest(engines["library"].path).extra["gpu_kernels"] == {"mode": "library"}


@pytest.mark.skipif(not TUNED, reason=NOT_TUNED)
@pytest.mark.parametrize(
    ("b", "s", "in_table"), [(1, 16, True), (1, 128, True), (8, 64, True), (32, 128, True), (4, 96, False)]
)
def test_tuned_engine_matches_the_library_engine(
    engines: dict[str, InductorEngine], bert_base: Path, b: int, s: int, in_table: bool
) -> None:
    feeds = _feeds(b, s)
    got = engines["tuned"].infer(feeds)["logits"]
    want = engines["library"].infer(feeds)["logits"]
    model = load_checkpoint(bert_base).module.cuda().eval()
    with torch.inference_mode():
        ref = model(torch.from_numpy(feeds["input_ids"]).cuda(), torch.from_numpy(feeds["attention_mask"]).cuda())
    ref_np = ref.float().cpu().numpy()
    rel = float(np.linalg.norm(got - ref_np) / np.linalg.norm(ref_np))
    rel_lib = float(np.linalg.norm(want - ref_np) / np.linalg.norm(ref_np))
    print(f"{b}x{s}: tuned engine vs fp32 {rel:.2e}, library engine vs fp32 {rel_lib:.2e}")
    assert rel < 2e-2 and rel < 3 * rel_lib + 1e-3
    names = _kernel_names(engines["tuned"], feeds)
    # the bucket's shape decides: the file's shapes run miaohui's kernels, the others cuBLAS / SDPA
    assert any("_encoder_kernel" in n for n in names) == in_table
    assert any("_skinny_kernel" in n for n in names) == any(key[0] == b * s for key in SEL.skinny)
    # the fused LayerNorm: where the file splits K of the product before a LayerNorm (or forces a split), its reduce
    # does the LayerNorm (BERT-base: both products at 16 and 128 rows); the add + LayerNorm kernel the others
    gemms = tuning.products(768, 3072)
    cfgs = {name: SEL.ln_split.get((b * s, *gemms[name])) or SEL.skinny.get((b * s, *gemms[name])) for name in gemms}
    splits = {name: cfg is not None and cfg[3] > 1 for name, cfg in cfgs.items()}
    assert any("_skinny_reduce_ln" in n for n in names) == splits["ffn_out"]
    assert any("_add_ln_kernel" in n for n in names) == (not splits["attn_out"])
    library = _kernel_names(engines["library"], feeds)
    assert not any("_encoder_kernel" in n or "_skinny_kernel" in n for n in library)
    # the file's cuBLASLt rows (BERT-base: 4,096 = 32×128) ran its algorithms (their plans exist: made at capture);
    # the library kernels that only this engine ran are printed (cuBLAS's Hopper kernels are "nvjet_…", not "gemm")
    ours = ("triton", "_encoder_kernel", "_skinny", "_add_ln", "Memcpy", "Memset")
    print(
        f"{b}x{s}: kernels only this engine ran: {sorted(n for n in names - library if not any(o in n for o in ours))}"
    )
    planned = {key[:4] for key in skinny_gemm._LT_PLANS}
    assert ((b * s, 3072, 768, True) in planned) == ((b * s, 3072, 768, True) in SEL.cublaslt)


@pytest.mark.skipif(not TUNED, reason=NOT_TUNED)
def test_static_shape_bucket_runs_its_own_program(engines: dict[str, InductorEngine]) -> None:
    """``static_shapes 1x128`` with the tuned kernels: a 1x100 batch is padded to the 1x128 bucket, whose graph was
    captured from the program compiled for exactly 1x128 (its Dynamo cache holds the graph); the logits match the
    dynamic-shape engine's, and the bucket still runs miaohui's kernels. Other buckets use the dynamic program."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    engine = engines["static"]
    assert read_manifest(engine.path).extra["static_shapes"] == ["1x128"] and set(engine._static) == {(1, 128)}
    code = engine._static[(1, 128)]._orig_mod.forward.__code__
    for b, s in ((1, 100), (8, 64), (1, 16)):
        feeds = _feeds(b, s)
        got, want = engine.infer(feeds)["logits"], engines["tuned"].infer(feeds)["logits"]
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        print(f"{b}x{s}: static-shape engine vs dynamic-shape engine {rel:.2e}")
        assert rel < 2e-3
    assert len(_debug_get_cache_entry_list(code)) == 1  # traced once, for the 1x128 bucket only
    names = _kernel_names(engine, _feeds(1, 128))
    assert any("_encoder_kernel" in n for n in names) and any("_skinny_kernel" in n for n in names)
