"""``miaohui.bench.kernel_timeline``: each kernel's time alone when kernels overlap (programmatic dependent launch),
on intervals made up for the cases; the profiler's events come from the GPU benchmarks."""

from __future__ import annotations

import pytest
import torch

from miaohui.bench.kernel_timeline import Kernel, cuda_kernels, exclusive, summarize


def test_a_pdl_chain_counts_each_wait_once() -> None:
    # a GEMM 0–10, its dependent launched at 2 and done at 12 (waited 8), the next at 11 and done at 15, then a gap
    chain = [Kernel("gemm", 0, 10), Kernel("reduce", 2, 12), Kernel("ln", 11, 15), Kernel("gemm", 20, 30)]
    assert exclusive(chain) == [10, 2, 3, 10]
    table = summarize(chain, calls=1)
    assert table["busy_us_per_call"] == 25 and table["duration_us_per_call"] == 34 and table["span_us_per_call"] == 30
    assert [(k["kernel"], k["per_call"], k["us_per_call"], k["exclusive_us_per_call"]) for k in table["top"]] == [
        ("gemm", 2, 20, 20), ("ln", 1, 4, 3), ("reduce", 1, 10, 2)]  # by time alone  # fmt: skip


def test_nested_and_unordered_intervals() -> None:
    # given out of order; "memset" lies wholly inside the GEMM's interval: no time of its own
    kernels = [Kernel("memset", 3, 4), Kernel("gemm", 0, 10), Kernel("tail", 9, 11)]
    assert exclusive(kernels) == [10, 0, 1]  # start order: gemm, memset, tail
    table = summarize(kernels, calls=2, top=2)
    assert table["busy_us_per_call"] == 5.5 and table["kernels_per_call"] == 1.5
    assert [k["kernel"] for k in table["top"]] == ["gemm", "tail"]
    assert summarize([], calls=3)["busy_us_per_call"] == 0.0


def test_cuda_kernels_reads_a_profile() -> None:
    """On the CPU the profiler records no CUDA events: an empty timeline, not an error (the GPU benchmarks read
    real ones, ``bench_gpu_encoder.py --profile``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        torch.ones(8) @ torch.ones(8)
    kernels = cuda_kernels(prof)
    if not torch.cuda.is_available():
        assert kernels == []
    else:
        pytest.skip("the CPU case")
