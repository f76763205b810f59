"""Tiny random causal-LM directories as ``save_pretrained`` writes them (for ``build-llm PATH`` and the decoder gate).

Each gets SmolLM2's real tokenizer and chat template (read straight from the GGUF's metadata: no conversion), so the
prompts are real chat prompts; the weights are random (2 layers × 64), which is enough to check the export's math
against transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def smollm_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from miaohui.zoo.smollm import smollm_gguf_path

    gguf = smollm_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


def _config(kind: str, vocab: int, tok: Any) -> Any:
    import transformers

    shape = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=vocab, max_position_embeddings=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    if kind == "qwen2":
        return transformers.Qwen2Config(**shape, tie_word_embeddings=True)
    if kind == "llama":  # Llama 3.1's RoPE scaling: a static, non-default frequency table
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256, "rope_theta": 500000.0}  # fmt: skip
        return transformers.LlamaConfig(**shape, rope_parameters=rope, tie_word_embeddings=False)
    if kind == "mistral":
        return transformers.MistralConfig(**shape, sliding_window=256, tie_word_embeddings=False)
    if kind == "gemma3":
        shape |= {"num_attention_heads": 2, "num_key_value_heads": 1}
        return transformers.Gemma3TextConfig(
            **shape, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    raise ValueError(kind)


CLASSES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def save_tiny_decoder(kind: str, folder: Path, tokenizer: Any, seed: int = 0) -> Path:
    """A random ``kind`` model (2 layers × 64, the tokenizer's vocabulary) + tokenizer saved into ``folder``.
    Its generation config stops at the tokenizer's EOS and at token 0 (a list, as many models ship it)."""
    import transformers

    torch.manual_seed(seed)
    config = _config(kind, len(tokenizer), tokenizer)
    model = getattr(transformers, CLASSES[kind])(config).eval()
    with torch.no_grad():  # a wider spread than the 0.02 init, so greedy picks are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = [int(tokenizer.eos_token_id), 0]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' ``generate(do_sample=False)`` on the saved directory (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32").eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return [int(t) for t in out[0, len(prompt) :]]
