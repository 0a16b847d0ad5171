"""What every KV-cache backend shares: the static description of one decode call, and its index arithmetic.

A call attends B sequences' newest Sq queries to their cache. Sequence b uses rows 0 .. len[b] - 1 of its
cache (len = cache_seqlens clamped into [0, capacity]); query i sits at position len[b] - Sq + i, the
diagonal of a bottom-right mask. Row r of sequence b lives at

    contiguous  k_cache[b, r]                                         capacity = L
    paged       k_cache[page_table[b, r // page_size], r % page_size]  capacity = max_pages * page_size

A page-table entry outside [0, num_pages) is never read: its rows are absent keys (the xla path leaves them
out; a kernel that cannot mask single pages reads page 0 in their place, memory-safe but not the same
result: check=True names such an entry).

Worked example, page_size 4, cache_seqlens [6, 0], page_table [[3, 1], [7, -1]], Sq = 2:
    sequence 0: rows 0-3 on page 3, rows 4-5 on page 1; queries at positions 4 and 5
    sequence 1: no rows; queries at positions -2 and -1 (causal: no keys, out 0, stats -inf)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_ragged_attn.config import MaskedConfig


@dataclasses.dataclass(frozen=True)
class KVCacheConfig(MaskedConfig):
    """Shapes and options of one ragged_attention_with_kvcache call (hashable: a nondiff argument)."""

    batch: int  # B
    seqlen_q: int  # Sq: each sequence's newest queries
    num_heads_q: int
    num_heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str  # numpy name
    paged: bool
    page_size: int  # paged: rows per page; contiguous: L (one "page" per sequence)
    num_pages: int  # paged: pages in the cache; contiguous: B
    max_pages: int  # paged: page_table.shape[1]; contiguous: 1
    scale: float
    is_causal: bool
    window_left: int | None  # keys at most this far left of the query's position; None: no limit
    window_right: int | None  # at most this far right; None: no limit
    has_sinks: bool = False  # sinks are an epilogue of the op layer: backends never see them
    softcap: float = 0.0  # scores become softcap * tanh(score / softcap) before the softmax; 0: no cap

    @property
    def capacity(self) -> int:
        """Rows a sequence can hold: L, or max_pages * page_size."""
        return self.max_pages * self.page_size



def clamped_lengths(cache_seqlens: jax.Array, config: KVCacheConfig) -> jax.Array:
    """int32 [B]: cache_seqlens clamped into [0, capacity], so no row outside the cache is addressed."""
    return jnp.clip(cache_seqlens.astype(jnp.int32), 0, config.capacity)


def valid_pages(page_table: jax.Array, config: KVCacheConfig) -> jax.Array:
    """bool like page_table: the entry names a page of the cache."""
    return (page_table >= 0) & (page_table < config.num_pages)


def safe_page_table(page_table: jax.Array, config: KVCacheConfig) -> jax.Array:
    """page_table with every entry outside [0, num_pages) replaced by page 0: what a kernel that reads the
    table itself is given, so that it cannot address memory outside the cache."""
    return jnp.where(valid_pages(page_table, config), page_table, 0)


def query_positions(lengths: jax.Array, config: KVCacheConfig) -> jax.Array:
    """int32 [B, Sq]: lengths [5, 1] with Sq = 2 -> [[3, 4], [-1, 0]]."""
    return lengths[:, None] - config.seqlen_q + jnp.arange(config.seqlen_q, dtype=jnp.int32)[None, :]


def key_band(lengths: jax.Array, config: KVCacheConfig) -> tuple[jax.Array, jax.Array]:
    """(first, last) int32 [B, Sq]: the rows each query attends lie in first..last (empty when first > last),
    rows of pages outside the cache aside."""
    position = query_positions(lengths, config)
    first = jnp.zeros_like(position)
    last = jnp.broadcast_to(lengths[:, None] - 1, position.shape)
    if config.left_bound is not None:
        first = jnp.maximum(first, position - config.left_bound)
    if config.right_bound is not None:
        last = jnp.minimum(last, position + config.right_bound)
    return first, last


def rows_with_keys(lengths: jax.Array, config: KVCacheConfig) -> jax.Array:
    """bool [B, Sq]: the query's band holds at least one row of its sequence."""
    first, last = key_band(lengths, config)
    return first <= last
