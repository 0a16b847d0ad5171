"""Where each packed row belongs: sanitised cu_seqlens, per-row sequence index, position and validity.

Shared by the xla path (to gather rows into a padded batch and back) and the cuDNN path (to zero the rows
cuDNN never writes). Everything here is jit-traceable and cheap: O(B + T) integer work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def cu_seqlens_from_lengths(lengths) -> np.ndarray:
    """Host-side int32 [B + 1] offsets of sequences packed back to back: [3, 0, 2] -> [0, 3, 3, 5]."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int32)


def sanitize_cu_seqlens(cu_seqlens: jax.Array, capacity: int) -> jax.Array:
    """Clamps cu_seqlens monotone into [0, capacity], so no offset can address outside the buffer.

    Valid input passes through unchanged: [0, 3, 3, 7] -> [0, 3, 3, 7]. Garbage is made harmless:
    [5, 2, 9, 4] with capacity 6 -> [5, 5, 6, 6].

    The optimization barrier keeps XLA from constant-folding what derives from cu_seqlens a jitted function
    closes over: on the GPU (jax 0.11.2), XLA folded row_positions of the constant [0, 1] (capacity 2)
    through this cummax, a scatter-add and a cumsum to sequence [1, 1] instead of [0, 1], so the one real
    row read as padding and the op returned out 0 for it, silently (tests/test_packing.py has the case).
    """
    return jnp.clip(jax.lax.cummax(jax.lax.optimization_barrier(cu_seqlens), axis=0), 0, capacity)


def sanitize_both(cu_seqlens_q: jax.Array, cu_seqlens_kv: jax.Array, config) -> tuple[jax.Array, jax.Array]:
    """Both cu_seqlens clamped into their buffers, once per call: offsets, lengths and masks derive from these."""
    return (sanitize_cu_seqlens(cu_seqlens_q, config.capacity_q),
            sanitize_cu_seqlens(cu_seqlens_kv, config.capacity_kv))


def sequence_lengths(cu_seqlens: jax.Array, max_seqlen: int, seqused: jax.Array | None = None) -> jax.Array:
    """Rows of each sequence, capped at max_seqlen (the graph has room for no more) and, when given, at
    seqused (FlashAttention's: sequence b uses only the first seqused[b] rows of its slot
    cu_seqlens[b]:cu_seqlens[b+1]); a negative seqused counts as 0.

    cu_seqlens [0, 4, 4, 9], max_seqlen 8, seqused [2, 3, 9] -> [2, 0, 5]
    """
    lengths = jnp.minimum(jnp.diff(cu_seqlens), max_seqlen).astype(jnp.int32)
    if seqused is None:
        return lengths
    # Not folded as a constant either (see sanitize_cu_seqlens).
    return jnp.clip(jax.lax.optimization_barrier(seqused).astype(jnp.int32), 0, lengths)


def row_positions(cu_seqlens: jax.Array, capacity: int, max_seqlen: int, seqused: jax.Array | None = None):
    """For each of `capacity` rows: (sequence index, position within it, whether it is a real token).

    cu_seqlens = [0, 2, 2, 5], capacity 7, max_seqlen 8:
      sequence = [0, 0, 2, 2, 2, 3, 3]   (3 = past the last sequence)
      position = [0, 1, 0, 1, 2, 0, 1]
      valid    = [T, T, T, T, T, F, F]
    """
    rows = jnp.arange(capacity, dtype=jnp.int32)
    num_seqs = cu_seqlens.shape[0] - 1
    # A row's sequence is how many sequence ends lie at or before it (so zero-length sequences are skipped:
    # row 2 above lies in sequence 2, not the empty sequence 1). Counted with one scatter-add and a cumsum
    # rather than jnp.searchsorted, whose binary search is a loop of log2(B) small steps: on a GPU a
    # while loop costs a host round trip per iteration.
    ends = jnp.clip(cu_seqlens[1:], 0, capacity)
    sequence = jnp.cumsum(jnp.zeros(capacity + 1, jnp.int32).at[ends].add(1), dtype=jnp.int32)[:capacity]
    clamped = jnp.minimum(sequence, num_seqs - 1)
    position = rows - cu_seqlens[clamped]
    lengths = sequence_lengths(cu_seqlens, max_seqlen, seqused)  # rows past seqused: in the slot, not real
    valid = (sequence < num_seqs) & (position >= 0) & (position < lengths[clamped])
    return sequence, position, valid


def query_rows_with_keys(cu_seqlens_q, cu_seqlens_kv, config, seqused_q=None, seqused_kv=None) -> jax.Array:
    """[Tq] boolean: the row is a real token and attends to at least one key.

    Rows outside it must read out = 0 and stats = -inf whatever a kernel left there: padding rows are never
    written, and a row whose band is empty (causal bottom-right with sq > skv, a narrow window, skv = 0)
    has no softmax to take. Arguments are already sanitised cu_seqlens.
    """
    seq, pos, valid = row_positions(cu_seqlens_q, config.capacity_q, config.max_seqlen_q, seqused_q)
    seq = jnp.minimum(seq, config.num_seqs - 1)
    sq = sequence_lengths(cu_seqlens_q, config.max_seqlen_q, seqused_q)[seq]
    skv = sequence_lengths(cu_seqlens_kv, config.max_seqlen_kv, seqused_kv)[seq]
    diagonal = pos if config.diagonal_alignment == "top_left" else pos + skv - sq
    first, last = jnp.zeros_like(pos), skv - 1
    if config.left_bound is not None:
        first = jnp.maximum(first, diagonal - config.left_bound)
    if config.right_bound is not None:
        last = jnp.minimum(last, diagonal + config.right_bound)
    return valid & (first <= last)
