"""cuBLASLt through ``ctypes`` (:mod:`miaohui.models.cublaslt`) on CUDA: every candidate algorithm the heuristic
offers computes ``linear`` (with its bias or GELU-bias epilogue) as torch does; the encoder's op runs a tuning file's
algorithm only where asked (``lt``), the same inside a replayed CUDA graph; and the committed H200 file's algorithms
run at their shapes and match fp32, where this process has the cuBLASLt they were timed with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miaohui.models import cublaslt, skinny_gemm, tuning

pytestmark = pytest.mark.gpu


def _operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).half().cuda()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).half().cuda()
    b = (torch.randn(n, generator=gen) * 0.1).half().cuda()
    return x, w, b


def _want(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, gelu: bool) -> torch.Tensor:
    y = F.linear(x.float(), w.float(), b.float())
    return F.gelu(y, approximate="tanh") if gelu else y


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("m", "n", "k"), [(512, 2304, 768), (4096, 768, 3072), (300, 384, 1536)])
@pytest.mark.parametrize("epilogue", ["bias", "gelu_bias"])
def test_every_candidate_algorithm_computes_the_linear(m: int, n: int, k: int, epilogue: str) -> None:
    x, w, b = _operands(m, n, k)
    want = _want(x, w, b, epilogue == "gelu_bias")
    plan = cublaslt.LtLinear(m, n, k, torch.float16, epilogue)
    algos = plan.algos(8)
    assert algos and all(a.config["id"] >= 0 and len(a.blob) == 64 for a in algos)
    for algo in algos:
        assert _rel(plan(x, w, b, algo), want) < 5e-3, algo.config
    # a table's algorithm from its hex (no configuration read) runs the same
    again = plan(x, w, b, cublaslt.Algo.from_hex(algos[0].hex()))
    assert torch.equal(again, plan(x, w, b, algos[0]))
    pooled = plan.candidates(8, pool_rows=(16, 8192))
    assert len(pooled) >= len(algos) and [a.blob for a in pooled[: len(algos)]] == [a.blob for a in algos]


def test_bad_operands_are_refused_with_the_shapes_named() -> None:
    m, n, k = 256, 768, 768
    x, w, b = _operands(m, n, k, seed=1)
    plan = cublaslt.LtLinear(m, n, k, torch.float16, "bias")
    algo = plan.algos(1)[0]
    with pytest.raises(ValueError, match=r"got x \(256, 384\)"):
        plan(x[:, :384].contiguous(), w, b, algo)
    with pytest.raises(ValueError, match="must be contiguous"):
        plan(x.t().contiguous().t(), w, b, algo)


def test_the_op_runs_a_table_algorithm_only_when_asked_and_in_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    m, n, k = 512, 3072, 768
    x, w, b = _operands(m, n, k, seed=2)
    plan = cublaslt.LtLinear(m, n, k, torch.float16, "gelu_bias")
    algo = plan.algos(8)[-1]  # not the heuristic's first: the one torch would not run
    monkeypatch.setattr(skinny_gemm, "SKINNY_BEST", {})
    monkeypatch.setattr(skinny_gemm, "LT_BEST", {(m, n, k, True): algo.hex()})
    x3 = x.view(4, 128, k)
    want = _want(x, w, b, True).view(4, 128, n)
    lt = skinny_gemm.skinny_op(x3, w, b, True, True)
    assert torch.equal(lt, plan(x, w, b, algo).view(4, 128, n)) and _rel(lt, want) < 5e-3
    plain = skinny_gemm.skinny_op(x3, w, b, True)  # lt False: torch's call
    assert torch.equal(plain.view(m, n), torch._addmm_activation(b, x, w.t(), use_gelu=True))
    # captured into a CUDA graph, replayed on new inputs written into the same buffer
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny_gemm.skinny_op(x3, w, b, True, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gemm.skinny_op(x3, w, b, True, True)
    fresh, _, _ = _operands(m, n, k, seed=3)
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, _want(fresh, w, b, True).view(4, 128, n)) < 5e-3


def test_the_committed_tuning_files_algorithms_run_at_their_shapes() -> None:
    h200 = tuning.load(tuning.TUNING_DIR / "nvidia-h200-sm90.json")
    if cublaslt.version() != h200.versions.cublaslt or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the file's algorithms are for cuBLASLt {h200.versions.cublaslt} on compute capability 9.0")
    checked = 0
    for model in h200.models:
        gemms = tuning.products(model.hidden, model.intermediate)
        for m, row in model.cublaslt.items():
            for name, text in row.items():
                n, k = gemms[name]
                x, w, b = _operands(m, n, k, seed=m + n)
                got = skinny_gemm.lt_linear(x, w, b, name == "ffn_in", text)
                assert _rel(got, _want(x, w, b, name == "ffn_in")) < 5e-3, (m, name)
                checked += 1
    assert checked == sum(len(row) for model in h200.models for row in model.cublaslt.values()) > 0


def test_each_stream_has_its_own_workspace() -> None:
    """Two engine instances run on their own streams: their cuBLASLt calls (and the graphs that capture them) must not
    share a workspace, as torch keeps one per stream for its own."""
    m, n, k = 256, 768, 768
    x, w, b = _operands(m, n, k, seed=4)
    plan = cublaslt.LtLinear(m, n, k, torch.float16, "bias")
    algo = plan.algos(1)[0]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(plan(x, w, b, algo))
    torch.cuda.synchronize()
    spaces = {cublaslt._WORKSPACE[(x.device.index or 0, s.cuda_stream)].data_ptr() for s in streams}
    assert len(spaces) == 2 and torch.equal(outs[0], outs[1])
