"""Attention of each sequence's newest queries over its KV cache: a blocked online softmax in jnp.

The xla family's KV-cache backend (xla/kvcache.py) is this; the kernels' head/tail split (head_tail.py) runs
its short tail through it. Portable (runs on CPU in CI) and the implementation the kernels are compared with
beside the float64 reference. The cache is read in blocks of rows (whole pages of a paged cache, gathered through the
page table); each step of a `lax.scan` scores every query of every sequence against one block in float32 and folds it
into a running (max, sum, weighted values) per query row: the flash-attention recurrence, so no [Sq, L] score matrix is
ever formed. A block is large (a budget of float32 scores, `SCORES_BUDGET_BYTES`), so one step already runs in parallel
over many rows of many sequences: on a GPU that is what split-KV (flash decoding) buys a kernel. A block no query needs
(past every sequence's end, or left of every window) is skipped with `lax.cond`, so the cache rows read follow the
lengths, not the capacity.

Rows a sequence does not use (past cache_seqlens, on pages outside [0, num_pages)) may hold NaN: their scores
are masked with `where` (never multiplied) and their values zeroed before P.V, so nothing leaks. A page-table
entry outside the cache is replaced by page 0 before the gather (no address outside the cache is formed) and
its rows are masked: absent keys.

Packed queries (`attend_packed`, q [T, Hq, D] over cu_seqlens_q): the rows are cut into tiles of at most
QUERY_TILE consecutive queries of one sequence (index.kvcache.query_tiles), and the tiles run as the batch
of the same recurrence, each reading its own sequence's cache rows (its page-table row, or its slot of a
contiguous cache, gathered per block). A sequence of n queries reads its cache ceil(n / QUERY_TILE) times
per block, a decode row once; the rows a step holds stay within the budget, cache rows gathered included.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_ragged_attn.backends.shared import options
from jax_ragged_attn.config import KVCacheConfig
from jax_ragged_attn.index.kvcache import band, key_band, query_tiles, safe_page_table, valid_pages

# float32 scores one step may hold ([B, Hq, Sq, rows]); the block's rows follow from it.
SCORES_BUDGET_BYTES = 256 << 20
# Packed queries: consecutive queries of one sequence per tile (the module docstring); tests set a smaller one
# through OPTIONS.query_tile.
QUERY_TILE = 16


def block_rows(config: KVCacheConfig, row_bytes: int | None = None) -> int:
    """Rows of the cache one step reads: whole pages of a paged cache, at most the capacity. row_bytes: what
    one cache row of a step costs (default its float32 scores, [B, Hq, Sq])."""
    row_bytes = row_bytes or 4 * config.batch * config.num_heads_q * config.seqlen_q
    # OPTIONS.block_rows: tests set it small, so that sequences straddle blocks.
    rows = options.OPTIONS.block_rows or SCORES_BUDGET_BYTES // row_bytes
    pages = min(max(rows // config.page_size, 1), config.max_pages)
    return pages * config.page_size if config.paged else min(max(rows, 1), config.capacity)


def _loader(k_cache, v_cache, lengths, page_table, config: KVCacheConfig, size: int, sequence=None):
    """(steps, load): load(t) -> (k [N, C, Hkv, D], v [N, C, Hkv, Dv], rows [C] int32, present [N, C] bool)
    for block t of C = size rows, N = lengths.shape[0] query groups: the B sequences, or tiles each reading
    the cache of sequence[n] (a contiguous cache; a paged one comes with the tiles' page-table rows). The
    last block is shifted back to end at the capacity (dynamic_slice would clamp it so anyway); rows it
    shares with the block before are marked not present, so none counts twice."""
    batch, heads_kv = lengths.shape[0], config.num_heads_kv
    if config.paged:
        per_block = size // config.page_size
        steps = math.ceil(config.max_pages / per_block)
        ok_pages = valid_pages(page_table, config)
        safe = safe_page_table(page_table, config)

        def load(t):
            start = t * per_block
            begin = jnp.minimum(start, config.max_pages - per_block)
            ids = jax.lax.dynamic_slice_in_dim(safe, begin, per_block, axis=1)  # [B, pages]
            ok = jax.lax.dynamic_slice_in_dim(ok_pages, begin, per_block, axis=1)
            pages = begin + jnp.arange(per_block, dtype=jnp.int32)
            ok = ok & (pages >= start)[None, :]
            rows = (pages[:, None] * config.page_size + jnp.arange(config.page_size, dtype=jnp.int32)[None, :]).reshape(
                -1
            )
            present = jnp.repeat(ok, config.page_size, axis=1)
            k = k_cache[ids].reshape(batch, -1, heads_kv, k_cache.shape[-1])
            v = v_cache[ids].reshape(batch, -1, heads_kv, v_cache.shape[-1])
            return k, v, rows, present & (rows[None, :] < lengths[:, None])
    else:
        steps = math.ceil(config.capacity / size)
        pick = (lambda block: block) if sequence is None else (lambda block: block[sequence])

        def load(t):
            start = t * size
            begin = jnp.minimum(start, config.capacity - size)
            rows = begin + jnp.arange(size, dtype=jnp.int32)
            present = (rows >= start)[None, :] & (rows[None, :] < lengths[:, None])
            return (
                pick(jax.lax.dynamic_slice_in_dim(k_cache, begin, size, axis=1)),
                pick(jax.lax.dynamic_slice_in_dim(v_cache, begin, size, axis=1)),
                rows,
                present,
            )

    return steps, load


def attend(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig):
    """(out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] float32, -inf where no key was attended)."""
    first, last = key_band(lengths, config)  # [B, Sq]
    return _blocked(q, k_cache, v_cache, lengths, first, last, page_table, config, block_rows(config))


def attend_packed(q, k_cache, v_cache, lengths, cu_seqlens_q, page_table, config: KVCacheConfig):
    """(out [T, Hq, Dv] in q's dtype, lse [Hq, T] float32) of packed queries q [T, Hq, D] (config.packed):
    rows that are no query read out 0 and lse -inf. lengths: clamped cache_seqlens [B]."""
    tiles = query_tiles(cu_seqlens_q, lengths, config, min(options.OPTIONS.query_tile or QUERY_TILE, config.seqlen_q))
    used = tiles.slot_used()  # [N, M]
    first, last = band(tiles.positions(), lengths[tiles.sequence][:, None], config)
    first, last = jnp.where(used, first, 1), jnp.where(used, last, 0)  # no query: an empty band
    table = None if page_table is None else page_table[tiles.sequence]
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    # A step's float32 scores and the cache rows it gathers for every tile (and, contiguous, slices first).
    groups = tiles.count + (0 if config.paged else config.batch)
    row_bytes = (
        4 * tiles.count * tiles.size * config.num_heads_q
        + groups * config.num_heads_kv * (config.head_dim_qk + config.head_dim_v) * itemsize
    )
    out, lse = _blocked(
        tiles.gather(q),
        k_cache,
        v_cache,
        lengths[tiles.sequence],
        first,
        last,
        table,
        config,
        block_rows(config, row_bytes),
        sequence=None if config.paged else tiles.sequence,
    )
    return tiles.to_rows(out, 0), tiles.to_rows(lse.transpose(0, 2, 1), -jnp.inf).T  # lse [Hq, T]


def _blocked(q, k_cache, v_cache, lengths, first, last, page_table, config: KVCacheConfig, size: int, sequence=None):
    """(out [N, M, Hq, Dv] in q's dtype, lse [N, Hq, M] float32, -inf where no key was attended) of N groups
    of M queries q [N, M, Hq, D], query (n, i) attending rows first[n, i] .. last[n, i] of its group's cache
    (of lengths[n] rows; _loader says which). Blocks of `size` rows."""
    batch, seqlen_q = q.shape[:2]
    heads_kv, group, dv = config.num_heads_kv, config.group_size, config.head_dim_v
    q = q.reshape(batch, seqlen_q, heads_kv, group, config.head_dim_qk)
    steps, load = _loader(k_cache, v_cache, lengths, page_table, config, size, sequence)
    exact = q.dtype == jnp.float32
    precision = jax.lax.Precision.HIGHEST if exact else None
    # P.V with P in the values' dtype and a float32 accumulator, as the fused kernels do.
    p_dtype = jnp.float32 if exact else v_cache.dtype
    nonempty = first <= last  # the blocks worth reading are those some query's band reaches
    lowest_first = jnp.min(jnp.where(nonempty, first, config.capacity))
    highest_last = jnp.max(jnp.where(nonempty, last, -1))

    def fold(carry, t):
        m, l, acc = carry
        k, v, rows, present = load(t)
        keep = (
            present[:, None, :] & (rows[None, None, :] >= first[:, :, None]) & (rows[None, None, :] <= last[:, :, None])
        )  # [B, Sq, C]
        s = jnp.einsum("bqhgd,bchd->bhgqc", q, k, preferred_element_type=jnp.float32, precision=precision)
        s = s * config.scale
        if config.softcap:  # logit soft-capping before the mask, as ragged_attention does
            s = config.softcap * jnp.tanh(s / config.softcap)
        s = jnp.where(keep[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no key yet: exp(-inf - 0) = 0, never NaN
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        v = jnp.where(present[:, :, None, None], v, jnp.zeros((), v.dtype))  # NaN in unused rows: 0 * NaN
        pv = jnp.einsum(
            "bhgqc,bchd->bhgqd", p.astype(p_dtype), v, preferred_element_type=jnp.float32, precision=precision
        )
        return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

    def step(carry, t):
        needed = (t * size <= highest_last) & (t * size + size - 1 >= lowest_first)  # block t's new rows
        return jax.lax.cond(needed, fold, lambda carry, t: carry, carry, t), None

    shape = (batch, heads_kv, group, seqlen_q)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape + (dv,), jnp.float32),
    )
    (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(steps, dtype=jnp.int32))
    some = l > 0
    out = acc / jnp.where(some, l, 1.0)[..., None]
    lse = jnp.where(some, m + jnp.log(jnp.where(some, l, 1.0)), -jnp.inf)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, seqlen_q, config.num_heads_q, dv).astype(q.dtype)
    return out, lse.reshape(batch, config.num_heads_q, seqlen_q)
