"""implementation="cudnn" for ragged_attention_with_kvcache: the ragged cuDNN kernel over a contiguous cache.

A contiguous cache [B, L, Hkv, D] is a packed buffer [B * L, Hkv, D] of fixed-size slots: cu_seqlens_kv =
b * L, seqused_kv = cache_seqlens, and the queries [B, Sq, Hq, D] are [B * Sq, Hq, D] with cu_seqlens_q = b * Sq.
A bottom-right mask puts query i of sequence b on diagonal i + cache_seqlens[b] - Sq, the op's query
position. Both reshapes are free (no copy); the rows past cache_seqlens are never read (seqused).

    B = 2, Sq = 1, L = 4, cache_seqlens [3, 1] -> cu_seqlens_q [0, 1, 2], cu_seqlens_kv [0, 4, 8], seqused_kv [3, 1]

This is the training kernel with one query row per sequence: the issue measured it at a fifth of the H200's
bandwidth, and the ragged offsets' 2**31 bound (B * L * Hq * D) declines large caches. Paged caches are
declined: cuDNN's paged SDPA (page tables, cuDNN >= 9.5) through the extension is future work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.backends import cudnn
from jax_ragged_attn.backends.kvcache_config import KVCacheConfig
from jax_ragged_attn.config import AttentionConfig, AttentionOptions, make_config
from jax_ragged_attn.index import RaggedIndex

NAME = "cudnn"


def ragged_config(config: KVCacheConfig) -> AttentionConfig:
    """The ragged call a contiguous cache becomes (see the module docstring)."""
    dtype = np.dtype(config.dtype)
    window = None
    if config.window_left is not None or config.window_right is not None:
        window = (-1 if config.window_left is None else config.window_left,
                  -1 if config.window_right is None else config.window_right)
    options = AttentionOptions(scale=config.scale, is_causal=config.is_causal, diagonal_alignment="bottom_right",
                               local_window_size=window, stats_layout="head_major", return_stats=True,
                               softcap=config.softcap or None)
    rows_q, rows_kv = config.batch * config.seqlen_q, config.batch * config.capacity
    cu = jax.ShapeDtypeStruct((config.batch + 1,), jnp.int32)
    return make_config(jax.ShapeDtypeStruct((rows_q, config.num_heads_q, config.head_dim_qk), dtype),
                       jax.ShapeDtypeStruct((rows_kv, config.num_heads_kv, config.head_dim_qk), dtype),
                       jax.ShapeDtypeStruct((rows_kv, config.num_heads_kv, config.head_dim_v), dtype),
                       cu, cu, options, max_seqlen_q=config.seqlen_q, max_seqlen_kv=config.capacity)


def unsupported_reason(config: KVCacheConfig) -> str | None:
    if config.paged:
        return ("the cuDNN path serves contiguous caches only: cuDNN's paged SDPA (page tables, cuDNN >= 9.5) "
                "is not wired through the extension yet (future work); use implementation='fa3' or 'xla'")
    return cudnn.unsupported_reason(ragged_config(config))


def attend(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig):
    """(out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) from the ragged cuDNN kernel over the flattened cache."""
    batch, seqlen_q, capacity = config.batch, config.seqlen_q, config.capacity
    ragged = ragged_config(config)
    slots = jnp.arange(batch + 1, dtype=jnp.int32)
    index = RaggedIndex(slots * seqlen_q, slots * capacity, None, lengths)
    flat = (q.reshape(batch * seqlen_q, *q.shape[2:]), k_cache.reshape(batch * capacity, *k_cache.shape[2:]),
            v_cache.reshape(batch * capacity, *v_cache.shape[2:]))
    out, stats = cudnn.attend(flat, index, ragged, stats=True)  # stats head-major [Hq, B * Sq]
    out = out.reshape(batch, seqlen_q, config.num_heads_q, config.head_dim_v)
    return out, stats.reshape(config.num_heads_q, batch, seqlen_q).transpose(1, 0, 2)
