"""A KV-cache call split into each sequence's head, read by a kernel that loads whole key tiles, and its last
`tail` rows, read by the xla path, merged through their log-sum-exps.

Kernels that load whole key tiles (FlashAttention-3 with TMA, cuDNN's paged SDPA) mask the scores of rows
past a sequence's length but still multiply their values by the zero probability: a NaN in an unused row
(which the op allows, and the tests poison) reaches the result as 0 * NaN. Such a kernel is given each
sequence's head, rows [0, head) with head = max(length - tail, 0): a tile that starts inside the head ends
inside the sequence when `tail` is at least the kernel's widest key tile, so every row it loads is used.
The last `tail` rows are gathered into a small contiguous cache of their own (through the page table for a
paged cache, entries outside the cache read as page 0, as the kernels read them) and go to
cache_attention.attend, which zeroes unused rows. Cost: the gather and the tail's attention, B x tail rows.

    length 700, tail 256: the kernel reads rows 0..443 (its last tile ends by row 699), the xla path 444..699;
    length 100: the kernel reads nothing, the xla path rows 0..99.

Masks shift with the head: the kernel aligns bottom-right on `head` rows, so its diagonal is the query's
position minus `tail`, and the band [p - left, p + right] is the kernel's window (left - tail, right + tail).
A left bound shorter than `tail` that still reaches the head cannot be expressed that way (`window_reason`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_ragged_attn.backends.shared import cache_attention, options
from jax_ragged_attn.config import KVCacheConfig
from jax_ragged_attn.index.kvcache import band, key_band, packed_query_rows, safe_page_table

# head_call(q, k_cache, v_cache, head_lengths, page_table, config, left, right) -> (out [B, Sq, Hq, Dv],
# lse [B, Hq, Sq]): the kernel bottom-right over head_lengths rows with bounds left / right (None: no bound);
# rows of queries without keys may hold anything (they are replaced here).
HeadCall = Callable[..., tuple[jax.Array, jax.Array]]


def tail_rows(config: KVCacheConfig, kernel_tail: int) -> int:
    """The tail a backend splits at: its own `kernel_tail`, or the tests' smaller one (OPTIONS.tail_rows)."""
    return options.OPTIONS.tail_rows or kernel_tail


def window_reason(config: KVCacheConfig, tail: int, kernel: str) -> str | None:
    """Why a left window cannot be split at `tail` rows (see the module docstring), or None."""
    left = config.left_bound
    if left is not None and left < tail < left + config.seqlen_q:
        return (
            f"a left window of {left} rows with {config.seqlen_q} queries reaches into the rows {kernel} "
            f"reads but cannot be expressed there ({kernel} reads all but each sequence's last {tail} rows, "
            f"whose NaN-safety it cannot give); use implementation='xla'"
        )
    return None


def head_bounds(config: KVCacheConfig, tail: int) -> tuple | None:
    """(left, right) of the kernel's window over each sequence's head (None: no bound), or None where the
    band never reaches the head (a left bound below `tail`; window_reason declined the rest)."""
    left = None if config.left_bound is None else config.left_bound - tail
    right = None if config.right_bound is None else config.right_bound + tail
    return None if left is not None and left < 0 else (left, right)


def tail_cache(k_cache, v_cache, head, page_table, config: KVCacheConfig, tail: int):
    """(k, v) [B, tail, Hkv, D]: rows head .. head + tail - 1 of each sequence (clamped into the capacity),
    and the config of that contiguous cache."""
    rows = jnp.minimum(head[:, None] + jnp.arange(tail, dtype=jnp.int32)[None, :], config.capacity - 1)
    if config.paged:
        pages = jnp.take_along_axis(safe_page_table(page_table, config), rows // config.page_size, axis=1)
        flat = pages * config.page_size + rows % config.page_size
        gather = lambda cache: cache.reshape((-1,) + cache.shape[2:])[flat]
    else:
        gather = lambda cache: jnp.take_along_axis(cache, rows[:, :, None, None], axis=1)
    small = dataclasses.replace(config, paged=False, page_size=tail, num_pages=config.batch, max_pages=1)
    return gather(k_cache), gather(v_cache), small


def attend(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig, head_call: HeadCall, tail: int):
    """(out [B, Sq, Hq, Dv], lse [B, Hq, Sq]): `head_call` over each sequence's head, the xla path over its
    last `tail` rows, merged. lengths: clamped int32 [B]."""
    head = jnp.maximum(lengths - tail, 0)
    first, last = key_band(lengths, config)  # [B, Sq], true positions
    has_head = (head[:, None] > 0) & (first < head[:, None]) & (first <= last)
    out_h, lse_h = _head_part(
        lambda *bounds: head_call(q, k_cache, v_cache, head, page_table, config, *bounds),
        has_head,
        config,
        tail,
        q.dtype,
    )
    k_t, v_t, config_t = tail_cache(k_cache, v_cache, head, page_table, config, tail)
    # Queries and keys both shift by `head`, so the tail's bottom-right masks and windows keep their meaning,
    # and the head's keys fall before its first row.
    out_t, lse_t = cache_attention.attend(q, k_t, v_t, lengths - head, None, config_t)
    return merge(out_h, lse_h, out_t, lse_t, q.dtype)


# head_call_packed(q, k_cache, v_cache, head_lengths, cu_seqlens_q, page_table, config, left, right) -> (out
# [T, Hq, Dv], lse [Hq, T]): HeadCall for packed queries, sequence b's n_b queries bottom-right on its head.
HeadCallPacked = Callable[..., tuple[jax.Array, jax.Array]]


def attend_packed(
    q, k_cache, v_cache, lengths, cu_seqlens_q, page_table, config: KVCacheConfig, head_call: HeadCallPacked, tail: int
):
    """(out [T, Hq, Dv], lse [Hq, T]) of packed queries q [T, Hq, D] (config.packed): `head_call` over each
    sequence's head, the xla path's packed form over its last `tail` rows, merged per row. A sequence's query i
    sits at len - n + i, the kernel's diagonal over the head (head - n + i) `tail` rows left of it, as above."""
    head = jnp.maximum(lengths - tail, 0)
    sequence, position, owned = packed_query_rows(cu_seqlens_q, lengths, config)  # [T]
    first, last = band(position, lengths[sequence], config)
    own_head = head[sequence]
    has_head = owned & (own_head > 0) & (first < own_head) & (first <= last)
    out_h, lse_h = _head_part(
        lambda *bounds: head_call(q, k_cache, v_cache, head, cu_seqlens_q, page_table, config, *bounds),
        has_head,
        config,
        tail,
        q.dtype,
    )
    k_t, v_t, config_t = tail_cache(k_cache, v_cache, head, page_table, config, tail)
    out_t, lse_t = cache_attention.attend_packed(q, k_t, v_t, lengths - head, cu_seqlens_q, None, config_t)
    return merge(out_h, lse_h, out_t, lse_t, q.dtype)


def _head_part(call, has_head, config: KVCacheConfig, tail: int, dtype):
    """(out rows + [Hq, Dv], lse with Hq before the rows' last axis) of the kernel over each sequence's head, for
    query rows `has_head` ([B, Sq], or packed [T]); a row without head keys gets out 0 and lse -inf, whatever
    the kernel left there. call(left, right) runs the kernel with the head's window bounds."""
    rows = has_head.shape
    bounds = head_bounds(config, tail)
    if bounds is None:  # the band never reaches a head
        return (
            jnp.zeros(rows + (config.num_heads_q, config.head_dim_v), dtype),
            jnp.full(rows[:-1] + (config.num_heads_q, rows[-1]), -jnp.inf, jnp.float32),
        )
    out_h, lse_h = call(*bounds)
    return (
        jnp.where(has_head[..., None, None], out_h, jnp.zeros((), out_h.dtype)),
        jnp.where(jnp.expand_dims(has_head, -2), lse_h, -jnp.inf),
    )


def merge(out_h, lse_h, out_t, lse_t, dtype):
    """The head's and the tail's attention as one softmax, through their log-sum-exps: out [..., Hq, Dv] with
    lse [..., Hq, rows] ([B, Sq, Hq, Dv] with [B, Hq, Sq], or packed [T, Hq, Dv] with [Hq, T])."""
    lse = jnp.logaddexp(lse_h, lse_t)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight = lambda part: jnp.swapaxes(jnp.exp(part - safe), -1, -2)[..., None]
    out = weight(lse_h) * out_h.astype(jnp.float32) + weight(lse_t) * out_t.astype(jnp.float32)
    return out.astype(dtype), lse
