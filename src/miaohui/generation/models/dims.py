"""Shape facts of a Llama-style decoder (no torch: the engines and scheduler import it cheaply)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderDims:
    """Shape facts of a Llama-style decoder, read from its HF config."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float
    max_positions: int

    @classmethod
    def from_hf(cls, config: object) -> DecoderDims:
        get = config.__getattribute__
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        return cls(
            num_layers=int(get("num_hidden_layers")),
            hidden=hidden,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads")),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            intermediate=int(get("intermediate_size")),
            vocab=int(get("vocab_size")),
            rope_theta=theta,
            rms_eps=float(get("rms_norm_eps")),
            max_positions=_attended_positions(config),
        )


def _attended_positions(config: object) -> int:
    """``max_position_embeddings``, capped at the sliding window of its sliding layers (Mistral: all): within the window
    sliding attention equals the full attention these decoders compute, so longer sequences are refused instead."""
    limit = int(config.__getattribute__("max_position_embeddings"))
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window and (types is None or any(t == "sliding_attention" for t in types)):
        return min(limit, int(window))
    return limit
