"""A team's HF encoder as miaohui's fast encoder (``models/fast_hf.py``): BERT, RoBERTa, XLM-R, DistilBERT and ELECTRA
classifiers (their own heads) and embedding models (mean or CLS pooling) compute the HF model's outputs, survive
``save_fast`` / ``load_fast``; what does not map is refused by name. And the ``fast-graphs`` format's Triton cache
travels: packed at build, unpacked into another process's (empty) cache at load."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest
import torch

from miaohui.engines import fast_graphs
from miaohui.models import fast_bert
from miaohui.models.fast_hf import Unsupported, fast_from_hf
from miaohui.sources.hf_encoder import HFClassifier, HFEmbedder

COMMON = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 96, "max_position_embeddings": 80, "num_labels": 3}  # fmt: skip


def _config(model_type: str, **over: object) -> object:
    import transformers as T

    if model_type == "distilbert":
        return T.DistilBertConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, hidden_dim=96,
                                  max_position_embeddings=80, num_labels=3, **over)  # fmt: skip
    cls = {"bert": T.BertConfig, "roberta": T.RobertaConfig, "xlm-roberta": T.XLMRobertaConfig,
           "electra": T.ElectraConfig}[model_type]  # fmt: skip
    extra = {"embedding_size": 32} if model_type == "electra" else {}  # ELECTRA-small: projected embeddings
    return cls(**COMMON, **extra, **over)


def _hf(model_type: str, kind: str, **over: object) -> torch.nn.Module:
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg = _config(model_type, **over)
    factory = AutoModelForSequenceClassification if kind == "classifier" else AutoModel
    hf = factory.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in hf.parameters():  # not HF's init (zero biases, unit LayerNorms): every weight must be copied
            p.add_(torch.randn_like(p) * 0.02)
    if kind == "classifier":
        return HFClassifier(hf)
    return HFEmbedder(hf, "cls" if kind == "cls" else "mean", kind == "mean")


@pytest.mark.parametrize("kind", ["classifier", "mean", "cls"])
@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta", "distilbert", "electra"])
def test_fast_encoder_computes_the_hf_model(model_type: str, kind: str, tmp_path: Path) -> None:
    module = _hf(model_type, kind)
    ids = torch.randint(5, 300, (3, 12))  # above RoBERTa's pad id 1: HF counts positions of non-pad tokens
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    fast = fast_from_hf(module)
    with torch.no_grad():
        want = module(ids, mask)
        torch.testing.assert_close(fast(ids, mask), want, atol=2e-5, rtol=1e-4)
        fast_bert.save_fast(fast, tmp_path)
        again = fast_bert.load_fast(tmp_path, "cpu")
        torch.testing.assert_close(again(ids, mask), want, atol=2e-5, rtol=1e-4)
    expected = "cls-classifier" if kind == "classifier" else "encoder"
    assert fast_bert.spec_of(again).kind == expected


def test_an_activation_fastbert_lacks_is_refused() -> None:
    with pytest.raises(Unsupported, match="FastBert computes erf GELU, this bert model uses 'relu'"):
        fast_from_hf(_hf("bert", "classifier", hidden_act="relu"))


def test_triton_cache_travels_into_an_empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    built, fresh = tmp_path / "built", tmp_path / "fresh"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(built))
    with fast_graphs.private_triton_cache() as folder:
        assert os.environ["TRITON_CACHE_DIR"] == str(folder)
        (folder / "abc123").mkdir()
        (folder / "abc123" / "kernel.cubin").write_bytes(b"\x7fELF cubin")
        (folder / "abc123" / "lock").write_text("")
        group = {"child_paths": {"kernel.cubin": str(folder / "abc123" / "kernel.cubin")}}  # as Triton writes it
        (folder / "abc123" / "__grp__kernel.json").write_text(json.dumps(group))
        n = fast_graphs.pack(folder, tmp_path / fast_graphs.TRITON_FILE)
    assert n == 2 and os.environ["TRITON_CACHE_DIR"] == str(built)
    assert (built / "abc123" / "kernel.cubin").is_file()  # merged into the build machine's cache
    with tarfile.open(tmp_path / fast_graphs.TRITON_FILE) as tar:
        assert tar.getnames() == ["abc123/__grp__kernel.json", "abc123/kernel.cubin"]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    assert fast_graphs.restore_triton_cache(tmp_path / fast_graphs.TRITON_FILE)["triton_files_added"] == 2
    assert (fresh / "abc123" / "kernel.cubin").read_bytes() == b"\x7fELF cubin"
    for cache in (built, fresh):  # the group points at the files where they are now, or Triton compiles again
        moved = json.loads((cache / "abc123" / "__grp__kernel.json").read_text())
        assert moved == {"child_paths": {"kernel.cubin": str(cache / "abc123" / "kernel.cubin")}}
    assert fast_graphs.restore_triton_cache(tmp_path / fast_graphs.TRITON_FILE)["triton_files_added"] == 0


def test_buckets_are_the_engines() -> None:
    assert fast_graphs.buckets((1, 1), (4, 32)) == [(b, s) for b in (1, 2, 4) for s in (8, 16, 32)]
    assert fast_graphs.buckets((2, 16), (4, 32)) == [(2, 16), (2, 32), (4, 16), (4, 32)]


def test_direct_ops_compute_what_the_ops_do() -> None:
    """``fast-graphs`` calls the functions behind miaohui's ops (no op dispatch): the same outputs (CPU reference forms)."""
    fast = fast_from_hf(_hf("bert", "classifier"))
    fast_bert.use_kernels(fast, skinny=True, attention=True, cublaslt=True)
    ids = torch.randint(5, 300, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():
        via_ops = fast(ids, mask)
        fast_bert.use_direct_ops(fast)
        assert all(m.direct_ops for m in fast.modules() if isinstance(m, fast_bert.FastBertLayer))
        torch.testing.assert_close(fast(ids, mask), via_ops, atol=0, rtol=0)
