"""The trainer's epochs: batches of similar lengths, every example once, a random draw each epoch."""

from __future__ import annotations

import random

from miaohui.models.train import GROUP_POOL, length_grouped_batches


def test_every_example_once_in_batches_of_similar_length() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(3, 60) for _ in range(1000)]
    batches = length_grouped_batches(lengths, 32, random.Random(1))
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert len(batches) == -(-1000 // 32) and all(len(b) <= 32 for b in batches)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    rows = list(range(1000))
    random.Random(1).shuffle(rows)
    unsorted = sum(len(c) * max(lengths[i] for i in c) for c in (rows[k : k + 32] for k in range(0, 1000, 32)))
    assert padded < 0.75 * unsorted  # less padding than batches of random rows


def test_epochs_differ_and_a_seed_repeats_them() -> None:
    lengths = list(range(5, 5 + 32 * GROUP_POOL * 2))
    rng = random.Random(0)
    first, second = length_grouped_batches(lengths, 32, rng), length_grouped_batches(lengths, 32, rng)
    assert first != second
    assert length_grouped_batches(lengths, 32, random.Random(0)) == first
