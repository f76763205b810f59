"""FastBert's switch for miaohui's GPU ops (``fast_bert.use_kernels``): on the CPU each op runs its reference form,
so the attention switch changes nothing there, eager or compiled (the op opaque to Inductor), and the GEMM switch only
the FFN's GELU (its CPU form computes the tanh GELU, as its kernel does). What each kernel computes on the GPU is
checked by its own tests (interpreter, sm_90 compile, ``tests/gpu``)."""

from __future__ import annotations

import pytest
import torch

from miaohui.models import fast_bert
from miaohui.models.intent import IntentClassifier, random_bert


@pytest.mark.parametrize(("skinny", "attention", "tol"), [(False, True, 0.0), (True, False, 5e-3), (True, True, 5e-3)])
def test_switch_gives_the_same_logits_on_the_cpu(skinny: bool, attention: bool, tol: float) -> None:
    enc = random_bert(hidden=64, layers=3, heads=4, vocab=500, intermediate=128, seed=0)
    model = fast_bert.from_module(IntentClassifier(enc, 24).eval())
    ids = torch.randint(5, 500, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 20, dtype=torch.int64)
    mask[1, 12:] = 0
    with torch.inference_mode():
        want = model(ids, mask)
        fast_bert.use_kernels(model, skinny=skinny, attention=attention, cublaslt=True)
        got = model(ids, mask)
        compiled = torch.compile(model, fullgraph=True)(ids, mask)
    layer = model.encoder.layers[0]
    assert (layer.skinny, layer.triton_attention, layer.cublaslt) == (skinny, attention, skinny)
    assert float((got - want).abs().max()) <= tol
    assert float((compiled - got).abs().max()) < 1e-4
