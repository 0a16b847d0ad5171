"""Attention over a KV cache (decoding), and appending to the cache.

    k_cache, v_cache, lengths = kvcache_append(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=page_table)
    out = ragged_attention_with_kvcache(q, k_cache, v_cache, lengths, page_table=page_table)

Packed (a serving step: prefill chunks and decode rows of any length in one call, FlashAttention's varlen form):

    k_cache, v_cache, lengths = kvcache_append(k_cache, v_cache, k_new, v_new, cache_seqlens, cu_seqlens_k_new=cu,
                                               page_table=page_table)    # k_new [T, Hkv, D]
    out = ragged_attention_with_kvcache(q, k_cache, v_cache, lengths, cu_seqlens_q=cu,
                                        max_seqlen_q=M, page_table=page_table)   # q, out [T, Hq, D]

The caches are contiguous [B, L, Hkv, D] or paged [num_pages, page_size, Hkv, D] with an integer page table
[B, max_pages]; index/kvcache.py spells out how rows map to memory. This module validates the arguments
with the checks ragged_attention runs (config.check_heads, AttentionOptions), runs check mode
(features/checks.py), picks the backend from the registry (FlashAttention-3, cuDNN, xla) and applies what every
backend shares once: rows without keys (out 0, stats -inf), sinks (ops/common.py) and the stats layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn import backends
from jax_ragged_attn.backends.shared.cache_index import safe_cache_index
from jax_ragged_attn.backends.shared.forward_mode import forward_mode
from jax_ragged_attn.config import AttentionOptions, KVCacheConfig, _static_int, check_array, check_heads, masked_fields
from jax_ragged_attn.features import keyword_hints
from jax_ragged_attn.features.checks import apply_append_check, apply_cache_check
from jax_ragged_attn.features.overflow import cache_overflow
from jax_ragged_attn.index import as_int32, row_positions, sanitize_cu_seqlens
from jax_ragged_attn.index.kvcache import (
    clamped_lengths,
    invalid_query_rows,
    packed_query_rows,
    packed_rows_with_keys,
    rows_with_keys,
)
from jax_ragged_attn.ops import common


@keyword_hints.hints_keywords
def ragged_attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    cu_seqlens_q=None,
    max_seqlen_q=None,
    page_table=None,
    scale=None,
    is_causal=True,
    local_window_size=None,
    sinks=None,
    return_stats=False,
    stats_layout="head_major",
    implementation=None,
    check=None,
    softcap=None,
    return_overflow=False,
    **unknown,
):
    """Each sequence's newest queries attending to its KV cache (decoding, speculative decoding, chunked
    prefill). Forward only: for inference. jax.grad with respect to q or the caches raises
    NotImplementedError (the sinks' gradient, through the epilogue, works); jit and vmap work.

    Args:
      q: [B, Sq, Hq, Dqk], each sequence's newest Sq queries (Sq = 1 to decode one token); with cu_seqlens_q,
        packed queries [T, Hq, Dqk] of any number per sequence (a serving step: prefill chunks, decode rows).
      k_cache, v_cache: contiguous [B, L, Hkv, Dqk] / [B, L, Hkv, Dv], or paged [num_pages, page_size, Hkv,
        Dqk] / [..., Dv] with page_table. Hq must be a multiple of Hkv (GQA, MQA): query head h reads kv head
        h // (Hq // Hkv). Same dtype as q: bfloat16, float16 or float32.
      cache_seqlens: integer [B]: the rows of the cache sequence b uses, its newest Sq tokens included (call
        kvcache_append first). Clamped into [0, capacity] (L, or max_pages * page_size); a sequence whose
        value lies outside reads NaN in its query rows.
      cu_seqlens_q: None, or integer [B + 1] with q [T, Hq, Dqk] (FlashAttention's flash_attn_with_kvcache
        varlen form): sequence b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]], its newest n_b
        positions (query i at cache_seqlens[b] - n_b + i, bottom-right as the fixed form). Clamped monotone into
        [0, T]; rows outside every sequence's read out 0 and stats -inf; a sequence may have none. The rows
        of a sequence running past T read NaN, and every row when cu_seqlens_q does not start at 0 or
        decreases.
      max_seqlen_q: a static int >= 1, required with cu_seqlens_q: the most queries a sequence has (a longer
        slot's rows read NaN, as in ragged_attention; check=True raises).
      page_table: None (contiguous), or integer [B, max_pages]: row r of sequence b is
        k_cache[page_table[b, r // page_size], r % page_size]. Entries of pages a sequence does not use may be
        anything (-1 for unallocated, say). An entry outside [0, num_pages) is never read; a sequence that
        uses such an entry reads NaN in its query rows (out and stats; check=True raises).
      scale: multiplies q.k; default 1/sqrt(Dqk).
      is_causal: query i of sequence b sits at position cache_seqlens[b] - Sq + i and sees the keys at
        positions <= it (bottom-right). False: every used row.
      local_window_size: (left, right) keeps keys at positions position - left .. position + right; an int w
        means (w, w); a negative side has no limit.
      sinks: None or [Hq] float: one logit per query head that joins every query's softmax without a value
        (gpt-oss); a query without keys then has stats sinks[h] and out 0.
      return_stats: also return the float32 natural-log log-sum-exp of the attended scores; -inf for a query
        with no keys (cache_seqlens[b] < Sq under a causal mask, an empty sequence, a narrow window).
      stats_layout: "head_major" [B, Hq, Sq] (FlashAttention's softmax_lse) or "token_major" [B, Sq, Hq];
        packed: [Hq, T] or [T, Hq].
      implementation: None picks the first that serves the call of "fa3" (flash-attn3-jax's kvcache kernels:
        Hopper, bf16/fp16, head dim 128), "cudnn" (its paged SDPA graph, or the ragged kernel over a contiguous
        cache; packed queries only when named, until they have run on a GPU) and "xla" (portable,
        everywhere); a named one that cannot serve it raises NotImplementedError with the reason.
      check: validate cache_seqlens (within [0, capacity]), the page-table entries of the pages each
        sequence uses (within [0, num_pages)) and cu_seqlens_q (from 0, never decreasing, within [0, T], no
        sequence over max_seqlen_q) at run time; a violation raises RaggedAttentionInputError naming the
        argument and the element (under jit XLA wraps it: see checks.input_errors). None reads
        JAX_RAGGED_ATTN_CHECK.
      softcap: None or 0 (no cap), or a positive float: scores s = scale * q.k become softcap * tanh(s /
        softcap) before the mask, sinks and softmax (Gemma 2); the stats are those of the capped scores.
      return_overflow: also return an overflow.Overflow of int32 scalars counting what this call clamped or
        cut: packed queries past max_seqlen_q (truncated_rows_q), and the entries of cu_seqlens_q,
        cache_seqlens and the used pages' page_table outside their ranges (invalid_cu_seqlens).

    Returns:
      out [B, Sq, Hq, Dv] (packed: [T, Hq, Dv]) in q's dtype, or (out, stats) with return_stats=True, with the
      Overflow appended last when return_overflow=True.
    """
    keyword_hints.reject_unknown_keywords(ragged_attention_with_kvcache, unknown)  # FlashAttention's names
    options = AttentionOptions.from_arguments(locals())
    if not isinstance(return_overflow, bool):
        raise ValueError(f"return_overflow must be a Python bool, got {type(return_overflow).__name__}")
    q, k_cache, v_cache = (common.as_array(x) for x in (q, k_cache, v_cache))
    cache_seqlens = as_int32(cache_seqlens, "cache_seqlens")
    page_table = None if page_table is None else as_int32(page_table, "page_table")
    cu_seqlens_q = None if cu_seqlens_q is None else as_int32(cu_seqlens_q, "cu_seqlens_q")
    config = kvcache_config(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        page_table,
        options,
        sinks,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
    )
    cache_seqlens, page_table, cu_seqlens_q = apply_cache_check(
        options.check, config, cache_seqlens, page_table, cu_seqlens_q
    )
    backend = common.choose("kvcache", options, config, None)
    cache_seqlens = jnp.asarray(cache_seqlens)
    page_table = None if page_table is None else jnp.asarray(page_table)
    cu_seqlens_q = None if cu_seqlens_q is None else jnp.asarray(cu_seqlens_q)
    # From the index arrays as the caller passed them (checked ones are the same values), as are the invalid rows.
    overflow = (cache_overflow(cache_seqlens, page_table, cu_seqlens_q, config),) if return_overflow else ()
    invalid = invalid_query_rows(cache_seqlens, page_table, cu_seqlens_q, config)  # their rows come out NaN
    if page_table is not None and getattr(backend, "READS_TABLE_UNCHECKED", False):
        # Its kernel reads both without bounds: lengths and entries clamped into the cache, one launch on a GPU.
        lengths, page_table = safe_cache_index(cache_seqlens, page_table, config)
    else:
        lengths = clamped_lengths(cache_seqlens, config)
    # lse head-major: [B, Hq, Sq], packed [Hq, T]
    out, lse = _attention(q, k_cache, v_cache, lengths, page_table, cu_seqlens_q, config, backend.NAME)
    if config.packed:  # rows [T]: the queries, and those with keys
        real = packed_query_rows(cu_seqlens_q, lengths, config)[2]
        keys = packed_rows_with_keys(cu_seqlens_q, lengths, config)
    else:  # rows [B, Sq]: every query is a real token
        keys = rows_with_keys(lengths, config)
        real = jnp.ones_like(keys)
    if not getattr(backend, "zeroes_rows_without_keys", lambda config: False)(config):
        out = jnp.where(keys[..., None, None], out, jnp.zeros((), out.dtype))
    if sinks is None and options.return_stats:
        lse = jnp.where(keys[..., None, :], lse, -jnp.inf)
    result = common.result(out, lse, sinks, real, keys, "head_major", options.return_stats, invalid_rows=invalid)
    if options.return_stats and options.stats_layout == "token_major":
        out, stats = result
        result = out, jnp.swapaxes(stats, -1, -2)
    if overflow:
        result = (result if options.return_stats else (result,)) + overflow
    return result


def _run(q, k_cache, v_cache, lengths, page_table, cu_seqlens_q, config: KVCacheConfig, name: str):
    backend = backends.get(name, "kvcache")
    if config.packed:
        return backend.attend_packed(q, k_cache, v_cache, lengths, cu_seqlens_q, page_table, config)
    return backend.attend(q, k_cache, v_cache, lengths, page_table, config)


_attention = jax.custom_vjp(_run, nondiff_argnums=(6, 7))


def _attention_fwd(q, k_cache, v_cache, lengths, page_table, cu_seqlens_q, config, name):
    return _run(q, k_cache, v_cache, lengths, page_table, cu_seqlens_q, config, name), None


def _attention_bwd(config, name, residuals, cotangents):
    raise NotImplementedError(
        "ragged_attention_with_kvcache is forward-only (inference): it has no gradient with respect to q, "
        "k_cache or v_cache. Train with ragged_attention (seqused_kv over the cache's slots gives the same "
        "attention, differentiable)"
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


def _portable(q, k_cache, v_cache, lengths, page_table, cu_seqlens_q, config: KVCacheConfig, name: str):
    """_attention on the portable backend: the derivatives forward mode takes (reverse mode still raises)."""
    return _run(q, k_cache, v_cache, lengths, page_table, cu_seqlens_q, config, backends.FALLBACK)


_attention = forward_mode(_attention, _portable)


def kvcache_append(
    k_cache, v_cache, k_new, v_new, cache_seqlens, *, cu_seqlens_k_new=None, page_table=None, check=None
):
    """Writes k_new[b, i] / v_new[b, i] ([B, Sn, Hkv, D]) at row cache_seqlens[b] + i of sequence b's cache and
    returns (k_cache, v_cache, cache_seqlens_after). With cu_seqlens_k_new (integer [B + 1]), k_new / v_new
    are packed [T, Hkv, D]: rows cu_seqlens_k_new[b] .. cu_seqlens_k_new[b + 1] - 1 are sequence b's, row i of
    them written at its cache row cache_seqlens[b] + i (cu_seqlens_k_new clamped monotone into [0, T]; rows
    past its last entry are written nowhere).

    cache_seqlens are the rows in use before the append (clamped into [0, capacity]); cache_seqlens_after
    (int32 [B]) are those rows plus each sequence's new ones (cache_seqlens + Sn), the lengths
    ragged_attention_with_kvcache takes:

        k_cache, v_cache, lengths = kvcache_append(k_cache, v_cache, k_new, v_new, lengths)
        out = ragged_attention_with_kvcache(q, k_cache, v_cache, lengths)

    Rows past a sequence's capacity are not written, nor are rows whose page-table entry lies outside
    [0, num_pages) (page_table as in ragged_attention_with_kvcache), and no other sequence's rows change
    (unless page tables share pages: a row written to a shared page is every sharer's). check=True names such
    rows (and an invalid cu_seqlens_k_new) at run time, RaggedAttentionInputError; None reads
    JAX_RAGGED_ATTN_CHECK. A scatter that drops those rows: under jax.jit with the caches donated
    (donate_argnums) XLA updates them in place, with no copy of the cache.
    """
    packed = cu_seqlens_k_new is not None
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        check_array(
            x,
            name,
            3 if packed and name.endswith("_new") else 4,
            _PACKED_LAYOUTS[name] if packed and name.endswith("_new") else _LAYOUTS[name],
        )
    cache_seqlens = as_int32(cache_seqlens, "cache_seqlens")
    batch = _cache_batch(k_cache, page_table) if packed else k_new.shape[0]
    layout = "[T, Hkv, D" if packed else "[B, Sn, Hkv, D"
    if v_new.shape[:-1] != k_new.shape[:-1]:
        raise ValueError(f"v_new must be {layout}v] like k_new {tuple(k_new.shape)}, got {tuple(v_new.shape)}")
    for cache, new, name in ((k_cache, k_new, "k"), (v_cache, v_new, "v")):
        if cache.shape[2:] != new.shape[-2:]:
            raise ValueError(
                f"{name}_new must be {layout.split(', Hkv')[0]}, {cache.shape[2]}, {cache.shape[3]}] to "
                f"match {name}_cache {tuple(cache.shape)}, got {tuple(new.shape)}"
            )
        if cache.dtype != new.dtype:
            raise ValueError(f"{name}_new must have {name}_cache's dtype {cache.dtype}, got {new.dtype}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must be [B={batch}], got shape {tuple(cache_seqlens.shape)}")
    if k_cache.shape[0] != v_cache.shape[0] or k_cache.shape[1] != v_cache.shape[1]:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in their first two dims"
        )
    if packed:
        cu_seqlens_k_new = as_int32(cu_seqlens_k_new, "cu_seqlens_k_new")
        if tuple(cu_seqlens_k_new.shape) != (batch + 1,):
            raise ValueError(
                f"cu_seqlens_k_new must be [B + 1 = {batch + 1}] (B sequences: "
                f"{_batch_source(page_table)}), got shape {tuple(cu_seqlens_k_new.shape)}"
            )
    if page_table is not None:
        page_table = as_int32(page_table, "page_table")
        _check_page_table(page_table, batch)
    elif k_cache.shape[0] != batch:
        raise ValueError(f"a contiguous k_cache must be [B={batch}, L, Hkv, D], got {tuple(k_cache.shape)}")
    capacity = k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])
    cache_seqlens, page_table, cu_seqlens_k_new = apply_append_check(
        check,
        cache_seqlens,
        page_table,
        cu_seqlens_k_new,
        new_rows=k_new.shape[0 if packed else 1],
        capacity=capacity,
        num_pages=k_cache.shape[0],
        page_size=k_cache.shape[1],
    )
    page_table = None if page_table is None else jnp.asarray(page_table)
    # Clamped first, so that no sum below can overflow int32 (a negative index would wrap around).
    start = jnp.clip(jnp.asarray(cache_seqlens), 0, capacity)
    if packed:  # row t: sequence b's row offset t - cu[b]; rows of no sequence are dropped below
        total = k_new.shape[0]
        cu = sanitize_cu_seqlens(jnp.asarray(cu_seqlens_k_new), total)
        sequence, offset, real = row_positions(cu, total, total)
        sequence = jnp.minimum(sequence, batch - 1)
        rows = jnp.where(real, start[sequence] + offset, capacity)  # [T]; capacity: dropped
        counts = cu[1:] - cu[:-1]
    else:
        counts = jnp.full(batch, k_new.shape[1], jnp.int32)
        sequence = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], k_new.shape[:2])
        rows = start[:, None] + jnp.arange(k_new.shape[1], dtype=jnp.int32)[None, :]  # [B, Sn]
    if page_table is None:
        first = sequence
        second = jnp.where(rows < capacity, rows, capacity)  # capacity: out of bounds, dropped
    else:
        num_pages, page_size = k_cache.shape[:2]
        slot = jnp.minimum(rows // page_size, page_table.shape[1] - 1)
        entry = page_table[sequence, slot]
        keep = (rows < capacity) & (entry >= 0) & (entry < num_pages)
        first = jnp.where(keep, entry, num_pages)  # num_pages: out of bounds, dropped
        second = rows % page_size
    return (
        k_cache.at[first, second].set(k_new, mode="drop"),
        v_cache.at[first, second].set(v_new, mode="drop"),
        start + counts,
    )


# ---- validation and check mode ------------------------------------------------------------------------------


def _cache_batch(k_cache, page_table) -> int:
    """B of a packed call, whose q has no batch axis: the page table's rows, or a contiguous cache's slots."""
    return page_table.shape[0] if page_table is not None and page_table.ndim == 2 else k_cache.shape[0]


def _batch_source(page_table) -> str:
    return "page_table.shape[0]" if page_table is not None else "k_cache.shape[0] of a contiguous cache"


def _check_page_table(page_table, batch: int) -> None:
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.shape[1] < 1:
        raise ValueError(f"page_table must be [B={batch}, max_pages >= 1], got shape {tuple(page_table.shape)}")


# The layouts the rank errors name.
_LAYOUTS = {
    "q": "[B, Sq, Hq, Dqk]",
    "k_cache": "[B, L, Hkv, Dqk] or [num_pages, page_size, Hkv, Dqk]",
    "v_cache": "[B, L, Hkv, Dv] or [num_pages, page_size, Hkv, Dv]",
    "k_new": "[B, Sn, Hkv, Dqk]",
    "v_new": "[B, Sn, Hkv, Dv]",
}
# ... and with cu_seqlens_q / cu_seqlens_k_new (packed rows).
_PACKED_LAYOUTS = {
    "q": "[T, Hq, Dqk] (with cu_seqlens_q)",
    "k_new": "[T, Hkv, Dqk] (with cu_seqlens_k_new)",
    "v_new": "[T, Hkv, Dv] (with cu_seqlens_k_new)",
}


def kvcache_config(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    page_table,
    options: AttentionOptions,
    sinks=None,
    *,
    cu_seqlens_q=None,
    max_seqlen_q=None,
) -> KVCacheConfig:
    """Checks every static property of the arguments (ValueError naming the argument) into a KVCacheConfig.
    What both ops share (dtypes, heads, head dims, sinks) is config.check_heads, and the options' fields
    config.masked_fields, as make_config does for ragged_attention; the cache's own layout is checked here.
    With cu_seqlens_q, q is packed [T, Hq, Dqk] (total_q = T, seqlen_q = max_seqlen_q)."""
    packed = cu_seqlens_q is not None
    if max_seqlen_q is not None and not packed:
        raise ValueError(
            "max_seqlen_q bounds packed queries' counts: pass it with cu_seqlens_q (q [T, Hq, Dqk]); "
            "q [B, Sq, Hq, Dqk] has Sq each"
        )
    check_array(q, "q", 3 if packed else 4, _PACKED_LAYOUTS["q"] if packed else _LAYOUTS["q"])
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_array(x, name, 4, _LAYOUTS[name])
    check_heads(q, k_cache, v_cache, sinks, k_name="k_cache", v_name="v_cache")
    if packed:
        if max_seqlen_q is None:
            raise ValueError(
                "max_seqlen_q (a static int >= 1: the most queries a sequence has) is required with "
                "cu_seqlens_q, as in FlashAttention's varlen calls"
            )
        total_q, heads_q, dqk = q.shape
        # No sequence has more than T queries: a larger bound only widens the tiles (as ragged_attention clamps).
        seqlen_q = min(_static_int(max_seqlen_q, "max_seqlen_q", 1), int(total_q))
        batch = _cache_batch(k_cache, page_table)
        if tuple(cu_seqlens_q.shape) != (batch + 1,):
            raise ValueError(
                f"cu_seqlens_q must be [B + 1 = {batch + 1}] (B sequences: {_batch_source(page_table)}), "
                f"got shape {tuple(cu_seqlens_q.shape)}"
            )
    else:
        batch, seqlen_q, heads_q, dqk = q.shape
        total_q = 0
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"v_cache must match k_cache {tuple(k_cache.shape)} but in its last dim, got {tuple(v_cache.shape)}"
        )
    if min(batch, q.shape[0], q.shape[1], *k_cache.shape[:2]) < 1:
        raise ValueError(f"every dim must be >= 1, got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must be [B={batch}], got shape {tuple(cache_seqlens.shape)}")
    if page_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"a contiguous k_cache must be [B={batch}, L, Hkv, D] (or pass page_table), got {tuple(k_cache.shape)}"
            )
        paged, page_size, num_pages, max_pages = False, k_cache.shape[1], batch, 1
    else:
        _check_page_table(page_table, batch)
        paged, page_size, num_pages, max_pages = True, k_cache.shape[1], k_cache.shape[0], page_table.shape[1]
    return KVCacheConfig(
        batch=int(batch),
        seqlen_q=int(seqlen_q),
        num_heads_q=int(heads_q),
        num_heads_kv=int(k_cache.shape[2]),
        head_dim_qk=int(dqk),
        head_dim_v=int(v_cache.shape[3]),
        dtype=np.dtype(q.dtype).name,
        paged=paged,
        page_size=int(page_size),
        num_pages=int(num_pages),
        max_pages=int(max_pages),
        has_sinks=sinks is not None,
        total_q=int(total_q),
        **masked_fields(options, dqk),
    )
