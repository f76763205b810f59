"""The (batch, sequence) buckets of a CUDA-graph encoder engine (``inductor``): requests are padded up to the
nearest bucket, and each bucket is one captured graph. Batches are powers of two up to the profile's largest;
sequences are :data:`SEQ_BUCKETS` up to the profile's longest."""

from __future__ import annotations

from miaohui.errors import ConfigError

SEQ_BUCKETS = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def seq_buckets(max_seq: int) -> list[int]:
    return [s for s in SEQ_BUCKETS if s < max_seq] + [max_seq]


def check_static_shapes(static: tuple[tuple[int, int], ...], min_seq: int, max_batch: int, max_seq: int) -> None:
    """Every static shape must be a bucket of the profile (a program compiled for a shape no batch is padded to
    would never run)."""
    batches = batch_buckets(max_batch)
    seqs = [s for s in seq_buckets(max_seq) if s >= min_seq]
    for b, s in static:
        if b not in batches or s not in seqs:
            raise ConfigError(
                f"static shape {b}x{s} is not one of this profile's buckets (requests are padded to a bucket)",
                f"pick batch from {batches} and sequence from {seqs}, or widen --shapes",
            )
