"""A tiny random Qwen2 decoder (2 layers × 128, GQA 4/2, vocab 1000) for the generation-engine tests."""

from __future__ import annotations

import torch


def tiny_qwen(device: str = "cpu") -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        vocab_size=1000, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).eval()
