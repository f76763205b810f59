"""Fixtures shared by the integration tests that use the real SmolLM2-135M-Instruct."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOLLM_CACHE = ROOT / "var" / "test-cache" / "smollm2-135m"
"""The converted fp32 SmolLM2, cached between runs (keyed by the GGUF's digest)."""


@pytest.fixture(scope="session")
def smollm() -> tuple[Any, Any]:
    """(fp32 HF LlamaForCausalLM in eval mode, its fast tokenizer)."""
    from miaohui.zoo.smollm import load_smollm2

    model, tokenizer, _ = load_smollm2(SMOLLM_CACHE)
    return model, tokenizer


def hf_greedy_tokens(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """HF ``generate(do_sample=False)`` continuations of each prompt alone: the reference for our engines."""
    import torch

    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([list(p)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
            out.append(gen[0, len(p) :].tolist())
    return out
