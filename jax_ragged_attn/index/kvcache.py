"""The index arithmetic of a KV-cache call (config.KVCacheConfig), shared by the op and every backend.

A call attends B sequences' newest Sq queries to their cache. Sequence b uses rows 0 .. len[b] - 1 of its
cache (len = cache_seqlens clamped into [0, capacity]); query i sits at position len[b] - Sq + i, the
diagonal of a bottom-right mask. Row r of sequence b lives at

    contiguous  k_cache[b, r]                                         capacity = L
    paged       k_cache[page_table[b, r // page_size], r % page_size]  capacity = max_pages * page_size

A page-table entry outside [0, num_pages) is never read: its rows are absent keys (the xla path leaves them
out; a kernel that cannot mask single pages reads page 0 in their place, memory-safe but not the same
result). Either way a sequence whose used pages hold such an entry, or whose cache_seqlens lies outside
[0, capacity], is invalid: its query rows come out NaN (invalid_query_rows; check=True names the entry).

Worked example, page_size 4, cache_seqlens [6, 0], page_table [[3, 1], [7, -1]], Sq = 2:
    sequence 0: rows 0-3 on page 3, rows 4-5 on page 1; queries at positions 4 and 5
    sequence 1: no rows; queries at positions -2 and -1 (causal: no keys, out 0, stats -inf)

Packed queries (`total_q` > 0): q is [T, Hq, D] and cu_seqlens_q [B + 1] gives each sequence its rows, as in
ragged_attention: sequence b's queries are rows cu[b] .. cu[b + 1] - 1 (cu clamped monotone into [0, T]; at
most max_seqlen_q of them, the config's seqlen_q, count: a longer slot's later rows are not queries, and
its rows come out NaN), its
newest n_b positions: query i sits at len[b] - n_b + i. Rows outside every sequence's queries read out 0,
stats -inf. `packed_query_rows` gives each row its sequence, position and ownership:

    cu_seqlens_q [0, 3, 3, 4], T = 6, max_seqlen_q 3, cache_seqlens [10, 4, 0]
      sequence [0, 0, 0, 2, 2, 2]   (rows 4, 5: past the last sequence, clamped to B - 1 for gathers)
      position [7, 8, 9, -1, .., ..]   (sequence 0: 3 queries ending at row 9; sequence 2: 1 query, row -1)
      owned    [T, T, T, T, F, F]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_ragged_attn.config import KVCacheConfig
from jax_ragged_attn.index import (
    invalid_sequences,
    out_of_order,
    row_positions,
    rows_of_invalid,
    sanitize_cu_seqlens,
    sequence_lengths,
)


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


def used_pages(cache_seqlens: jax.Array, config: KVCacheConfig) -> jax.Array:
    """bool [B, max_pages]: the page holds rows the sequence uses (its length clamped into the cache):
    cache_seqlens [5, 0, 9], page_size 4, max_pages 2 -> [[T, T], [F, F], [T, T]]."""
    pages = (clamped_lengths(cache_seqlens, config) + config.page_size - 1) // config.page_size
    return jnp.arange(config.max_pages, dtype=jnp.int32)[None, :] < pages[:, None]


def lengths_outside(cache_seqlens: jax.Array, config: KVCacheConfig) -> jax.Array:
    """bool [B]: cache_seqlens[b] lies outside [0, capacity]."""
    return (cache_seqlens < 0) | (cache_seqlens > config.capacity)


def bad_used_entries(cache_seqlens: jax.Array, page_table: jax.Array, config: KVCacheConfig) -> jax.Array:
    """bool [B, max_pages]: the entry names no page of the cache and holds rows its sequence uses."""
    return used_pages(cache_seqlens, config) & ~valid_pages(page_table, config)


def invalid_cache_sequences(cache_seqlens: jax.Array, page_table: jax.Array | None, config: KVCacheConfig):
    """bool [B]: sequence b's cache index is invalid: cache_seqlens[b] outside [0, capacity], or an entry of a
    page it uses outside [0, num_pages). Its query rows come out NaN; overflow.cache_overflow counts the
    same entries."""
    invalid = lengths_outside(cache_seqlens, config)
    if page_table is not None:
        invalid = invalid | jnp.any(bad_used_entries(cache_seqlens, page_table, config), axis=1)
    return invalid


def invalid_query_rows(cache_seqlens, page_table, cu_seqlens_q, config: KVCacheConfig) -> jax.Array:
    """bool, the query rows ([B, Sq], packed [T]): the row comes out NaN. Its sequence's cache index is
    invalid (invalid_cache_sequences); packed, also its slot of cu_seqlens_q runs past T or holds more than
    max_seqlen_q queries, and every row when cu_seqlens_q is malformed (index.out_of_order)."""
    invalid = invalid_cache_sequences(cache_seqlens, page_table, config)
    if not config.packed:
        return jnp.broadcast_to(invalid[:, None], (config.batch, config.seqlen_q))
    malformed = jnp.any(out_of_order(cu_seqlens_q))
    invalid = invalid | invalid_sequences(cu_seqlens_q, config.total_q, config.seqlen_q)
    return rows_of_invalid(sanitize_cu_seqlens(cu_seqlens_q, config.total_q), config.total_q, malformed, invalid)


def query_positions(lengths: jax.Array, config: KVCacheConfig) -> jax.Array:
    """int32 [B, Sq]: lengths [5, 1] with Sq = 2 -> [[3, 4], [-1, 0]]."""
    return lengths[:, None] - config.seqlen_q + jnp.arange(config.seqlen_q, dtype=jnp.int32)[None, :]


def band(position: jax.Array, length: jax.Array, config: KVCacheConfig) -> tuple[jax.Array, jax.Array]:
    """(first, last) int32, broadcast: a query at `position` of a sequence with `length` rows attends rows
    first..last (empty when first > last), rows of pages outside the cache aside."""
    position, length = jnp.broadcast_arrays(position, length)
    first = jnp.zeros_like(position)
    last = length - 1
    if config.left_bound is not None:
        first = jnp.maximum(first, position - config.left_bound)
    if config.right_bound is not None:
        last = jnp.minimum(last, position + config.right_bound)
    return first, last


def key_band(lengths: jax.Array, config: KVCacheConfig) -> tuple[jax.Array, jax.Array]:
    """(first, last) int32 [B, Sq]: band() of each sequence's newest Sq queries."""
    return band(query_positions(lengths, config), lengths[:, None], config)


def rows_with_keys(lengths: jax.Array, config: KVCacheConfig) -> jax.Array:
    """bool [B, Sq]: the query's band holds at least one row of its sequence."""
    first, last = key_band(lengths, config)
    return first <= last


# ---- packed queries (config.packed) ------------------------------------------------------------------------


def query_counts(cu_seqlens_q: jax.Array, config: KVCacheConfig) -> jax.Array:
    """int32 [B]: n_b, the queries of each sequence (its slot of the sanitised cu_seqlens_q, at most
    max_seqlen_q)."""
    return sequence_lengths(sanitize_cu_seqlens(cu_seqlens_q, config.total_q), config.seqlen_q)


def packed_query_rows(cu_seqlens_q: jax.Array, lengths: jax.Array, config: KVCacheConfig):
    """(sequence, position, owned), int32 / int32 / bool [T]: each row's sequence (clamped into [0, B) for
    gathers), its query position len[b] - n_b + i, and whether it is a query at all (the module docstring's
    example). lengths: clamped cache_seqlens [B]."""
    cu = sanitize_cu_seqlens(cu_seqlens_q, config.total_q)
    sequence, offset, owned = row_positions(cu, config.total_q, config.seqlen_q)
    sequence = jnp.minimum(sequence, config.batch - 1)
    counts = sequence_lengths(cu, config.seqlen_q)
    return sequence, lengths[sequence] - counts[sequence] + offset, owned


def packed_rows_with_keys(cu_seqlens_q: jax.Array, lengths: jax.Array, config: KVCacheConfig) -> jax.Array:
    """bool [T]: the row is a query and its band holds at least one row of its sequence."""
    sequence, position, owned = packed_query_rows(cu_seqlens_q, lengths, config)
    first, last = band(position, lengths[sequence], config)
    return owned & (first <= last)


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """The packed queries cut into `count` tiles of `size` rows, each inside one sequence: the shape both the
    xla path and FA3 run packed queries in (a batch of tiles, each a sequence's consecutive queries).

    count is static, an upper bound: sum_b ceil(n_b / size) <= (T + B (size - 1)) / size, and <= B
    ceil(max_seqlen_q / size). Tiles past the real ones have no rows (used 0).

        T = 7, cu_seqlens_q [0, 5, 5, 6], size 2, cache_seqlens [9, 4, 3]: count (7 + 3) // 2 = 5, 4 real
          sequence [0, 0, 0, 2, 2]   first row [0, 2, 4, 5, 7]   used [2, 2, 1, 1, 0]
          positions [[4, 5], [6, 7], [8, ..], [2, ..], ..]
    """

    size: int
    count: int
    sequence: jax.Array  # int32 [count]: the tile's sequence (clamped into [0, B))
    first_row: jax.Array  # int32 [count]: its first row of q (may be T or past: then used is 0)
    used: jax.Array  # int32 [count]: its query rows, 0 .. size
    first_position: jax.Array  # int32 [count]: the position of its first query
    row_tile: jax.Array  # int32 [T]: the tile holding row t of q (any tile where row_owned is False) ...
    row_slot: jax.Array  # int32 [T]: ... and its slot there
    row_owned: jax.Array  # bool [T]: row t is a query

    def rows(self) -> jax.Array:
        """int32 [count, size]: the rows of q each tile holds (unused slots may point anywhere in [0, T])."""
        return self.first_row[:, None] + jnp.arange(self.size, dtype=jnp.int32)[None, :]

    def positions(self) -> jax.Array:
        """int32 [count, size]: each tile slot's query position."""
        return self.first_position[:, None] + jnp.arange(self.size, dtype=jnp.int32)[None, :]

    def slot_used(self) -> jax.Array:
        """bool [count, size]: the slot holds a query."""
        return jnp.arange(self.size, dtype=jnp.int32)[None, :] < self.used[:, None]

    def gather(self, x: jax.Array) -> jax.Array:
        """x [T, ...] -> [count, size, ...]: each slot's row of x (an unused slot holds any row)."""
        return x[jnp.clip(self.rows(), 0, x.shape[0] - 1)]

    def to_rows(self, values: jax.Array, fill) -> jax.Array:
        """values [count, size, ...] -> [T, ...]: row t reads its tile slot's value, a row that is no query
        `fill` (a gather, not a scatter: each row knows its slot)."""
        picked = values[self.row_tile, self.row_slot]
        owned = self.row_owned.reshape(self.row_owned.shape + (1,) * (picked.ndim - 1))
        return jnp.where(owned, picked, jnp.asarray(fill, values.dtype))


def tile_count(config: KVCacheConfig, size: int) -> int:
    """QueryTiles.count: how many tiles of `size` rows the packed queries can need at most."""
    bound = (config.total_q + config.batch * (size - 1)) // size
    return max(1, min(bound, config.batch * -(-config.seqlen_q // size)))


def query_tiles(cu_seqlens_q: jax.Array, lengths: jax.Array, config: KVCacheConfig, size: int) -> QueryTiles:
    """The packed queries as tiles of `size` rows (QueryTiles). lengths: clamped cache_seqlens [B]."""
    cu = sanitize_cu_seqlens(cu_seqlens_q, config.total_q)
    counts = sequence_lengths(cu, config.seqlen_q)  # [B]
    per_sequence = (counts + size - 1) // size
    ends = jnp.cumsum(per_sequence, dtype=jnp.int32)  # tile index past sequence b's last
    count = tile_count(config, size)
    tile = jnp.arange(count, dtype=jnp.int32)
    # A tile's sequence is how many sequences end at or before it (empty sequences own no tile).
    sequence = jnp.minimum(jnp.sum(ends[None, :] <= tile[:, None], axis=1, dtype=jnp.int32), config.batch - 1)
    local = tile - (ends - per_sequence)[sequence]  # the tile's index within its sequence
    offset = local * size
    used = jnp.where(tile < ends[-1], jnp.clip(counts[sequence] - offset, 0, size), 0)
    row_sequence, row_offset, row_owned = row_positions(cu, config.total_q, config.seqlen_q)
    row_sequence = jnp.minimum(row_sequence, config.batch - 1)
    row_tile = jnp.clip((ends - per_sequence)[row_sequence] + row_offset // size, 0, count - 1)
    return QueryTiles(
        size=size,
        count=count,
        sequence=sequence,
        first_row=cu[sequence] + offset,
        used=used,
        first_position=lengths[sequence] - counts[sequence] + offset,
        row_tile=row_tile,
        row_slot=jnp.clip(row_offset, 0, None) % size,
        row_owned=row_owned,
    )
