"""Shipped encoder backbones by name (all offline, from registry packages)."""

from __future__ import annotations

from typing import Literal

from tokenizers import Tokenizer
from transformers import BertModel

from miaohui.errors import ConfigError

BackboneName = Literal["e5-small", "minilm"]
BACKBONES: tuple[str, ...] = ("e5-small", "minilm")


def load_backbone(name: str) -> tuple[BertModel, Tokenizer]:
    """A fresh fp32 encoder and its tokenizer. ``e5-small`` is multilingual (Chinese-capable)."""
    if name == "e5-small":
        from miaohui.zoo.e5 import load_e5

        return load_e5()
    if name == "minilm":
        from miaohui.zoo.minilm import load_minilm

        return load_minilm()
    raise ConfigError(f"unknown backbone {name!r}", f"choose one of {', '.join(BACKBONES)}")
