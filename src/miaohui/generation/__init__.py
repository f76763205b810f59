"""Causal-LM generation: explicit-KV export, CPU engines, sampling, continuous batching, async streaming."""
