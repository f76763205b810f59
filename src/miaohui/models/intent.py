"""The intent classifier: an HF encoder (BERT, RoBERTa, DistilBERT ...), masked mean pooling, a linear head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # transformers is imported where a BERT is built: importing it costs the server ~2 s at start
    from transformers import BertModel, PreTrainedModel


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average the token states where ``attention_mask`` is 1 (padding excluded)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * mask).sum(dim=1)
    count = mask.sum(dim=1).clamp(min=1.0)
    return summed / count


class IntentClassifier(nn.Module):
    """``(input_ids, attention_mask) -> logits[batch, num_labels]``."""

    def __init__(self, encoder: PreTrainedModel, num_labels: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(encoder.config.hidden_size, num_labels)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return mean_pool(hidden, attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.embed(input_ids, attention_mask)))


class SentenceEncoder(nn.Module):
    """``(input_ids, attention_mask) -> L2-normalized embeddings[batch, hidden]`` (task ``encoder``)."""

    def __init__(self, encoder: PreTrainedModel) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return nn.functional.normalize(mean_pool(hidden, attention_mask), dim=-1)


def random_bert(
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    vocab: int = 1000,
    intermediate: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
) -> BertModel:
    """A BERT of the given shape with random weights (tests, and GPU benchmarks where shape matters)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate or 4 * hidden,
        max_position_embeddings=max_positions,
    )
    cfg._attn_implementation = "sdpa"
    return BertModel(cfg, add_pooling_layer=False).eval()
