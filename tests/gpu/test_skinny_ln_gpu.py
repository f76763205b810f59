"""The encoder's fused kernels on CUDA, where their programs really run at once: ``skinny_linear_ln`` (the last
program of a row block normalizes what the others wrote, ``miaohui.models.skinny_ln``) and the Triton attention
(``miaohui.models.encoder_attention``), at BERT-base's sizes in fp16 against fp32 torch, called many times in a row
and replayed from a CUDA graph (a lost write or a counter left non-zero shows as a wrong row)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miaohui.models.encoder_attention import sdpa_encoder_attention, triton_encoder_attention
from miaohui.models.fast_bert import MASK_BIAS
from miaohui.models.skinny_ln import SKINNY_LN_BEST, skinny_linear_ln

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", sorted(SKINNY_LN_BEST))
def test_skinny_linear_ln_matches_torch_over_many_calls_and_graph_replays(shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen).half().cuda()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).half().cuda()
    b, res = (torch.randn(n, generator=gen) * 0.1).half().cuda(), torch.randn(m, n, generator=gen).half().cuda()
    g, beta = (
        (1 + 0.1 * torch.randn(n, generator=gen)).half().cuda(),
        (0.1 * torch.randn(n, generator=gen)).half().cuda(),
    )
    want = F.layer_norm(res.float() + F.linear(x.float(), w.float(), b.float()), (n,), g.float(), beta.float(), 1e-12)
    cfg = SKINNY_LN_BEST[shape]
    for _ in range(200):
        got = skinny_linear_ln(x, w, b, res, g, beta, 1e-12, cfg)
        assert float((got.float() - want).abs().max()) < 2e-2
    for pdl in (False, True):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            skinny_linear_ln(x, w, b, res, g, beta, 1e-12, cfg, pdl=pdl)  # warm-up (compile) off the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs = [skinny_linear_ln(x, w, b, res, g, beta, 1e-12, cfg, pdl=pdl) for _ in range(8)]
        for _ in range(50):
            graph.replay()
            torch.cuda.synchronize()
            worst = max(float((o.float() - want).abs().max()) for o in outs)
            assert worst < 2e-2, (pdl, worst)


@pytest.mark.parametrize(("b", "s", "d"), [(1, 128, 64), (32, 128, 64), (8, 64, 32)])
def test_triton_encoder_attention_matches_sdpa_in_fp16(b: int, s: int, d: int) -> None:
    heads = 12
    gen = torch.Generator().manual_seed(b * s)
    qkv = torch.randn(b, s, 3 * heads * d, generator=gen).half().cuda()
    mask = torch.ones(b, s)
    mask[0, s // 2 :] = 0
    bias = ((1.0 - mask[:, None, None, :]) * MASK_BIAS).half().cuda()
    want = sdpa_encoder_attention(qkv.float(), bias.float(), heads)
    got = triton_encoder_attention(qkv, bias, heads)
    assert float((got.float() - want).abs().max()) < 5e-3
