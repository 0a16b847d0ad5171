"""How much input data a call dropped, cut or clamped: device-side counts, no host round trip.

Outside check mode the op never fails on data: cu_seqlens are clamped into the buffers, the query rows of a
sequence whose index data is invalid read NaN (index.invalid_sequences: the same conditions these counts
count), segments past max_segments are treated as padding (docs/API.md, "What can be dropped").
`return_overflow=True` on every entry point returns an `Overflow` of int32 scalars that say how much, so a
training loop can log them (or sum them over steps) with the loss, at the cost of a few O(B) integer ops:

    out, overflow = ragged_attention(q, k, v, cu_q, cu_kv, max_seqlen_q=512, max_seqlen_kv=512,
                                     return_overflow=True)
    metrics["truncated_rows"] = overflow.truncated_rows_q + overflow.truncated_rows_kv

All zeros means nothing was lost. The counts are integers computed from cu_seqlens / segment_ids alone, so
they carry no gradient and leave jax.grad of a loss over `out` unchanged (take them as has_aux). Under vmap
each field gains the mapped axes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ragged_attn.index import out_of_order, sanitize_cu_seqlens
from jax_ragged_attn.index.kvcache import bad_used_entries, lengths_outside


class Overflow(NamedTuple):
    """int32 scalars; all zero when the call used every input token it was given."""

    truncated_rows_q: jax.Array  # query rows past max_seqlen_q in their sequence: they read out = 0
    truncated_rows_kv: jax.Array  # key rows past max_seqlen_kv in their sequence: no query attends to them
    invalid_cu_seqlens: jax.Array  # entries of cu_seqlens_q and cu_seqlens_kv that broke the contract (entry 0
    #                               not 0, below an earlier entry, outside [0, capacity]) and were clamped; over
    #                               a KV cache also cache_seqlens outside [0, capacity] and the page_table
    #                               entries a sequence uses outside [0, num_pages)
    dropped_segments: jax.Array  # ragged_attention_segments: segments past max_segments, read as padding


def invalid_entries(cu_seqlens: jax.Array, capacity: int) -> jax.Array:
    """Entries that start elsewhere than 0, fall below an earlier entry, or leave [0, capacity]:
    [2, 5, 3, 12] with capacity 10 -> 3 (entry 0 is not 0, 3 < 5, 12 > 10)."""
    outside = (cu_seqlens < 0) | (cu_seqlens > capacity)
    return jnp.sum(out_of_order(cu_seqlens) | outside, dtype=jnp.int32)


def truncated_rows(cu_seqlens: jax.Array, capacity: int, max_seqlen: int, seqused=None) -> jax.Array:
    """Rows past max_seqlen in their sequence, after the clamping the op applies: [0, 7, 9] with
    max_seqlen 4 -> 3. With seqused only the used rows of a slot count (the rest are not data)."""
    lengths = jnp.diff(sanitize_cu_seqlens(cu_seqlens, capacity))
    if seqused is not None:
        lengths = jnp.clip(seqused, 0, lengths)
    return jnp.sum(jnp.maximum(lengths - max_seqlen, 0), dtype=jnp.int32)


def cu_seqlens_overflow(cu_seqlens_q, cu_seqlens_kv, config, *, same: bool = False, seqused=(None, None)) -> Overflow:
    """The Overflow of one call (dropped_segments 0); `same`: one cu_seqlens serves q and kv (qkv-packed,
    segments), so its invalid entries count once."""
    invalid = invalid_entries(cu_seqlens_q, config.capacity_q)
    if not same:
        invalid = invalid + invalid_entries(cu_seqlens_kv, config.capacity_kv)
    counts = Overflow(
        truncated_rows_q=truncated_rows(cu_seqlens_q, config.capacity_q, config.max_seqlen_q, seqused[0]),
        truncated_rows_kv=truncated_rows(cu_seqlens_kv, config.capacity_kv, config.max_seqlen_kv, seqused[1]),
        invalid_cu_seqlens=invalid,
        dropped_segments=jnp.zeros((), jnp.int32),
    )
    return jax.tree.map(jax.lax.stop_gradient, counts)


def cache_overflow(cache_seqlens, page_table, cu_seqlens_q, config) -> Overflow:
    """The Overflow of one ragged_attention_with_kvcache call (config its KVCacheConfig) from the index arrays
    as the caller passed them: packed queries past max_seqlen_q (truncated_rows_q), and the invalid entries
    of cu_seqlens_q, cache_seqlens and the page table (invalid_cu_seqlens). A cache has no max_seqlen_kv, so
    truncated_rows_kv is 0: a length past the capacity is an invalid entry. cache_seqlens [5, -1, 9] with
    capacity 8 -> 2 invalid entries (-1 and 9)."""
    zero = jnp.zeros((), jnp.int32)
    invalid = jnp.sum(lengths_outside(cache_seqlens, config), dtype=jnp.int32)
    if page_table is not None:  # entries of the pages each sequence uses, its length clamped as the op does
        invalid = invalid + jnp.sum(bad_used_entries(cache_seqlens, page_table, config), dtype=jnp.int32)
    truncated_q = zero
    if cu_seqlens_q is not None:
        invalid = invalid + invalid_entries(cu_seqlens_q, config.total_q)
        truncated_q = truncated_rows(cu_seqlens_q, config.total_q, config.seqlen_q)
    counts = Overflow(
        truncated_rows_q=truncated_q, truncated_rows_kv=zero, invalid_cu_seqlens=invalid, dropped_segments=zero
    )
    return jax.tree.map(jax.lax.stop_gradient, counts)
