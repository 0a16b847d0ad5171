"""Random document packings and their dense masks, shared by the context-parallel and ring tests."""

from __future__ import annotations

import numpy as np


def random_document_lengths(rng, total: int, *, slack: int, longest: tuple[int, int]) -> list[int]:
    """Documents filling total - slack rows: one of longest[0]..longest[1]-1 rows (longer than a shard, so it
    crosses devices), two zero-length ones, the rest short (so documents cross chunk edges), shuffled."""
    budget = total - slack
    lengths = [int(rng.integers(*longest)), 0, 0]
    while sum(lengths) < budget:
        lengths.append(int(min(rng.integers(1, 14), budget - sum(lengths))))
    rng.shuffle(lengths)
    return lengths


def dense_mask(cu, total: int, max_seqlen: int, is_causal: bool, window_left) -> np.ndarray:
    """[T, T] bool: the natural packing's segment-causal (windowed) mask."""
    mask = np.zeros((total, total), bool)
    for b in range(len(cu) - 1):
        start, length = int(cu[b]), min(int(cu[b + 1] - cu[b]), max_seqlen)
        i, j = np.arange(length)[:, None], np.arange(length)[None, :]
        keep = np.ones((length, length), bool)
        if is_causal:
            keep &= j <= i
        if window_left is not None:
            keep &= j >= i - window_left
        mask[start : start + length, start : start + length] = keep
    return mask
