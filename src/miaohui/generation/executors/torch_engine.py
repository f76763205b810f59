"""The PyTorch eager engine (the baseline of our own engines): the explicit-KV module of
:mod:`miaohui.generation.models.llama`, built from an HF model and sharing its weights, in fp32 eager mode.

Same API and KV layout as the ONNX Runtime engine; numpy in and out (``torch.from_numpy`` / ``.numpy()``
share memory, no copies). HF ``generate`` itself is the other baseline, measured in the benchmark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from miaohui.generation.executors.base import CausalLMEngine

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

    from miaohui.generation.models.llama import KVLlama


class TorchCausalLMEngine(CausalLMEngine):
    """PyTorch eager fp32 on the CPU; ``threads`` sets ``torch.set_num_threads`` when given."""

    name = "torch"

    def __init__(
        self, hf_model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, *, threads: int | None = None
    ) -> None:
        import torch

        from miaohui.generation.models.llama import KVLlama

        if threads is not None:
            torch.set_num_threads(threads)
        self.model: KVLlama = KVLlama(hf_model).eval()
        eos = hf_model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
            eos_ids = [*eos_ids, tokenizer.eos_token_id]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        super().__init__(self.model.dims, eos_ids, pad)

    def _forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: list[np.ndarray],
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        import torch

        with torch.inference_mode():
            outs = self.model(*(torch.from_numpy(a) for a in (input_ids, attention_mask, position_ids, *past)))
        return outs[0].numpy(), [t.numpy() for t in outs[1:]]
