"""The encoder's Triton kernels on CUDA, where their programs really run at once: ``miaohui::proj_ln_proj``
(:mod:`miaohui.models.skinny_ln`: the LayerNorm in the split-K reduce where the table splits the first product, the
add + LayerNorm kernel elsewhere) at BERT-base's and e5-small's widths with the H200 tuning file's skinny entries, called many times
and replayed from a CUDA graph with PDL; the add + LayerNorm kernel at larger shapes; and the attention kernel
(:mod:`miaohui.models.encoder_attention`) against SDPA, all in fp16 against fp32 torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miaohui.models import skinny_gemm, skinny_ln, tuning
from miaohui.models.encoder_attention import sdpa_encoder_attention, triton_encoder_attention
from miaohui.models.fast_bert import MASK_BIAS
from miaohui.models.skinny_ln import add_layer_norm, fused_config, proj_ln_proj

pytestmark = pytest.mark.gpu
H200 = tuning.load(tuning.TUNING_DIR / "nvidia-h200-sm90.json")
AS_MEASURED = tuning.Runtime(H200.gpu, (9, 0), H200.versions.torch, H200.versions.triton, H200.versions.cublaslt)
"""The H200 file's entries whatever this process's versions (the kernels' arithmetic does not depend on them)."""


def _operands(m: int, k1: int, hid: int, n2: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(m + k1 + n2)

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale + shift).half().cuda()

    return [rnd(m, k1), rnd(hid, k1, scale=k1**-0.5), rnd(hid, scale=0.1), rnd(m, hid, shift=0.2),
            rnd(hid, scale=0.1, shift=1.0), rnd(hid, scale=0.1), rnd(n2, hid, scale=hid**-0.5), rnd(n2, scale=0.1)]  # fmt: skip


@pytest.mark.parametrize("widths", sorted((m.hidden, m.intermediate) for m in H200.models))
@pytest.mark.parametrize("rows", [16, 128])
@pytest.mark.parametrize("pair", ["attn_out→ffn_in", "ffn_out→qkv"])
def test_proj_ln_proj_matches_torch_over_many_calls_and_graph_replays(
    widths: tuple[int, int], rows: int, pair: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hidden, inter = widths
    entries = tuning.select(AS_MEASURED, (hidden, inter, 12))
    monkeypatch.setattr(skinny_gemm, "SKINNY_BEST", entries.skinny)
    monkeypatch.setattr(skinny_gemm, "SKINNY_PDL", True)
    monkeypatch.setattr(skinny_ln, "LN_SPLIT_BEST", entries.ln_split)
    k1, n2, gelu = (hidden, inter, True) if pair == "attn_out→ffn_in" else (inter, 3 * hidden, False)
    x, w1, b1, r, g, beta, w2, b2 = _operands(rows, k1, hidden, n2)
    print(f"{widths} {rows} rows {pair}: {'fused' if fused_config(rows, w1) else 'unfused'}")
    h_want = F.layer_norm(r.float() + F.linear(x.float(), w1.float(), b1.float()), (hidden,), g.float(), beta.float())
    y_want = F.linear(h_want, w2.float(), b2.float())
    y_want = F.gelu(y_want, approximate="tanh") if gelu else y_want

    def check(y: torch.Tensor, h: torch.Tensor) -> None:
        assert float((h.float() - h_want).abs().max()) < 2e-2
        assert float((y.float() - y_want).abs().max()) < 3e-2 * max(1.0, float(y_want.abs().max()))

    for _ in range(200):
        check(*proj_ln_proj(x, w1, b1, r, g, beta, 1e-5, w2, b2, gelu))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        proj_ln_proj(x, w1, b1, r, g, beta, 1e-5, w2, b2, gelu)  # warm-up (compile) off the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = [proj_ln_proj(x, w1, b1, r, g, beta, 1e-5, w2, b2, gelu) for _ in range(8)]
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        for y, h in outs:
            check(y, h)


@pytest.mark.parametrize(("m", "n"), [(512, 768), (4096, 768), (300, 384), (4096, 384)])
def test_add_layer_norm_matches_torch(m: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m)
    a, r = (torch.randn(m, n, generator=gen).half().cuda() for _ in range(2))
    g, b = (torch.rand(n, generator=gen) + 0.5).half().cuda(), torch.randn(n, generator=gen).half().cuda()
    want = F.layer_norm(a.float() + r.float(), (n,), g.float(), b.float(), 1e-12)
    assert float((add_layer_norm(a, r, g, b, 1e-12).float() - want).abs().max()) < 2e-2


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
