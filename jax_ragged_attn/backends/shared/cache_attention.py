"""Attention of each sequence's newest queries over its KV cache: a blocked online softmax in jnp.

The xla family's KV-cache backend (xla/kvcache.py) is this; the kernels' head/tail split (head_tail.py) runs
its short tail through it. Portable (runs on CPU in CI) and the implementation the kernels are compared with
beside the float64 reference. The cache is read in blocks of rows (whole pages of a paged cache, gathered through the page
table); each step of a `lax.scan` scores every query of every sequence against one block in float32 and folds
it into a running (max, sum, weighted values) per query row: the flash-attention recurrence, so no [Sq, L]
score matrix is ever formed. A block is large (a budget of float32 scores, `SCORES_BUDGET_BYTES`), so one step
already runs in parallel over many rows of many sequences: on a GPU that is what split-KV (flash decoding) buys
a kernel. A block no query needs (past every sequence's end, or left of every window) is skipped with
`lax.cond`, so the cache rows read follow the lengths, not the capacity.

Rows a sequence does not use (past cache_seqlens, on pages outside [0, num_pages)) may hold NaN: their scores
are masked with `where` (never multiplied) and their values zeroed before P.V, so nothing leaks. A page-table
entry outside the cache is replaced by page 0 before the gather (no address outside the cache is formed) and
its rows are masked: absent keys.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_ragged_attn.backends.shared.kvcache_config import KVCacheConfig, key_band, safe_page_table, valid_pages

# float32 scores one step may hold ([B, Hq, Sq, rows]); the block's rows follow from it.
SCORES_BUDGET_BYTES = 256 << 20
# Rows per step instead of the budget's (tests set it small, so sequences straddle blocks).
BLOCK_ROWS: int | None = None


def block_rows(config: KVCacheConfig) -> int:
    """Rows of the cache one step reads: whole pages of a paged cache, at most the capacity."""
    rows = BLOCK_ROWS or SCORES_BUDGET_BYTES // (4 * config.batch * config.num_heads_q * config.seqlen_q)
    pages = min(max(rows // config.page_size, 1), config.max_pages)
    return pages * config.page_size if config.paged else min(max(rows, 1), config.capacity)


def _loader(k_cache, v_cache, lengths, page_table, config: KVCacheConfig):
    """(steps, load): load(t) -> (k [B, C, Hkv, D], v [B, C, Hkv, Dv], rows [C] int32, present [B, C] bool)
    for block t. The last block is shifted back to end at the capacity (dynamic_slice would clamp it so
    anyway); rows it shares with the block before are marked not present, so none counts twice."""
    batch, heads_kv = config.batch, config.num_heads_kv
    if config.paged:
        per_block = block_rows(config) // config.page_size
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
            rows = (pages[:, None] * config.page_size
                    + jnp.arange(config.page_size, dtype=jnp.int32)[None, :]).reshape(-1)
            present = jnp.repeat(ok, config.page_size, axis=1)
            k = k_cache[ids].reshape(batch, -1, heads_kv, k_cache.shape[-1])
            v = v_cache[ids].reshape(batch, -1, heads_kv, v_cache.shape[-1])
            return k, v, rows, present & (rows[None, :] < lengths[:, None])
    else:
        size = block_rows(config)
        steps = math.ceil(config.capacity / size)

        def load(t):
            start = t * size
            begin = jnp.minimum(start, config.capacity - size)
            rows = begin + jnp.arange(size, dtype=jnp.int32)
            present = (rows >= start)[None, :] & (rows[None, :] < lengths[:, None])
            return (jax.lax.dynamic_slice_in_dim(k_cache, begin, size, axis=1),
                    jax.lax.dynamic_slice_in_dim(v_cache, begin, size, axis=1), rows, present)
    return steps, load


def attend(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig):
    """(out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] float32, -inf where no key was attended)."""
    batch, seqlen_q, heads_kv, group = config.batch, config.seqlen_q, config.num_heads_kv, config.group_size
    dv = config.head_dim_v
    q = q.reshape(batch, seqlen_q, heads_kv, group, config.head_dim_qk)
    first, last = key_band(lengths, config)  # [B, Sq]
    steps, load = _loader(k_cache, v_cache, lengths, page_table, config)
    exact = q.dtype == jnp.float32
    precision = jax.lax.Precision.HIGHEST if exact else None
    # P.V with P in the values' dtype and a float32 accumulator, as the fused kernels do.
    p_dtype = jnp.float32 if exact else v_cache.dtype
    lowest_first, highest_last = jnp.min(first), jnp.max(last)

    def fold(carry, t):
        m, l, acc = carry
        k, v, rows, present = load(t)
        keep = (present[:, None, :] & (rows[None, None, :] >= first[:, :, None])
                & (rows[None, None, :] <= last[:, :, None]))  # [B, Sq, C]
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
        pv = jnp.einsum("bhgqc,bchd->bhgqd", p.astype(p_dtype), v, preferred_element_type=jnp.float32,
                        precision=precision)
        return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

    size = block_rows(config)

    def step(carry, t):
        needed = (t * size <= highest_last) & (t * size + size - 1 >= lowest_first)  # block t's new rows
        return jax.lax.cond(needed, fold, lambda carry, t: carry, carry, t), None

    shape = (batch, heads_kv, group, seqlen_q)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (dv,), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(steps, dtype=jnp.int32))
    some = l > 0
    out = acc / jnp.where(some, l, 1.0)[..., None]
    lse = jnp.where(some, m + jnp.log(jnp.where(some, l, 1.0)), -jnp.inf)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, seqlen_q, config.num_heads_q, dv).astype(q.dtype)
    return out, lse.reshape(batch, config.num_heads_q, seqlen_q)
