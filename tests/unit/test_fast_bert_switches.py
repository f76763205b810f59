"""FastBert's switches for GPU kernels (``fast_bert.use_*``) that have a CPU fallback: on the CPU each op runs the
form the layer ran without it, so the switch changes nothing there, eager or compiled (the op opaque to Inductor).
What each kernel computes on the GPU is checked by its own tests (interpreter, sm_90 compile, ``tests/gpu``).
(``use_skinny`` is not one of them: its CPU form computes the FFN's GELU in the tanh form, as its kernel does; so
``use_ln_fusion``, whose op runs the GEMMs through ``skinny_linear``, is compared with ``use_skinny`` on both sides.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from miaohui.models import fast_bert
from miaohui.models.intent import IntentClassifier, random_bert


@pytest.mark.parametrize(
    ("base", "switch"),
    [(None, fast_bert.use_triton_attention), (fast_bert.use_skinny, fast_bert.use_ln_fusion)],
)
def test_switch_gives_the_same_logits_on_the_cpu(
    base: Callable[[nn.Module], nn.Module] | None, switch: Callable[[nn.Module], nn.Module]
) -> None:
    enc = random_bert(hidden=64, layers=3, heads=4, vocab=500, intermediate=128, seed=0)
    model = fast_bert.from_module(IntentClassifier(enc, 24).eval())
    if base is not None:
        base(model)
    ids = torch.randint(5, 500, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 20, dtype=torch.int64)
    mask[1, 12:] = 0
    with torch.inference_mode():
        want = model(ids, mask)
        switch(model)
        got = model(ids, mask)
        compiled = torch.compile(model, fullgraph=True)(ids, mask)
    assert torch.equal(got, want)
    assert float((compiled - want).abs().max()) < 1e-4
