"""GPU tests run only where torch sees a CUDA device (the H200 via the device tool); CPU CI skips them."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
