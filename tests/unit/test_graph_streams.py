"""``graph_streams``: which CUDA-graph buckets run their batch as parts on parallel streams (the GPU behaviour
itself is ``tests/gpu/test_inductor_gpu.py::test_split_over_streams_gives_the_same_outputs``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from miaohui.engines.inductor_engine import SPLIT_MIN_TOKENS, split_parts
from miaohui.serving.model_config import ModelConfig


@pytest.mark.parametrize(
    ("b", "s", "streams", "parts"),
    [
        (32, 128, 2, 2),  # 2 × 16 rows × 128 tokens
        (128, 128, 4, 4),
        (32, 128, 1, 1),  # off
        (8, 128, 2, 1),  # 4 × 128 = 512 tokens per part: too few
        (8, 256, 2, 2),  # 4 × 256 = 1,024
        (16, 64, 2, 1),  # 512 tokens per part
        (6, 512, 4, 1),  # the batch does not divide into 4
        (2, 1024, 2, 1),  # parts of 1 row: Dynamo would trace a batch of 1 as a graph of its own
    ],
)
def test_split_parts(b: int, s: int, streams: int, parts: int) -> None:
    assert split_parts(b, s, streams) == parts


def test_model_config_bounds_the_streams() -> None:
    assert ModelConfig().graph_streams == 1
    assert ModelConfig(graph_streams=2).graph_streams == 2
    with pytest.raises(ValidationError, match="graph_streams"):
        ModelConfig(graph_streams=0)


def test_the_threshold_is_per_part() -> None:
    assert split_parts(2 * 2, SPLIT_MIN_TOKENS // 2, 2) == 2
    assert split_parts(2 * 2, SPLIT_MIN_TOKENS // 2 - 1, 2) == 1
