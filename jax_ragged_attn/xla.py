"""The portable implementation: plain jnp, differentiable by JAX itself, runs on any backend.

The packed rows are gathered into a padded [B, S, H, D] batch, attended with an explicit mask in float32,
and gathered back. Memory is O(B * H * max_seqlen_q * max_seqlen_kv), like padded attention; it is the
reference semantics and the fallback, not the fast path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.packing import row_positions, sanitize_both, sequence_lengths


def _to_padded(x: jax.Array, starts: jax.Array, lengths: jax.Array, max_seqlen: int) -> jax.Array:
    """[T, H, D] packed rows -> [B, S, H, D], zero past each sequence's end (never reading padding rows)."""
    positions = jnp.arange(max_seqlen, dtype=jnp.int32)
    index = jnp.clip(starts[:, None] + positions[None, :], 0, x.shape[0] - 1)
    inside = positions[None, :] < lengths[:, None]
    # `where`, not a multiply: NaN in a padding row must not survive as NaN * 0, in values or in gradients.
    return jnp.where(inside[:, :, None, None], x[index], 0)


def _mask(config: AttentionConfig, lengths_q: jax.Array, lengths_kv: jax.Array) -> jax.Array:
    """[B, Sq, Skv] boolean: which key each query row attends to."""
    i = jnp.arange(config.max_seqlen_q, dtype=jnp.int32)[None, :, None]
    j = jnp.arange(config.max_seqlen_kv, dtype=jnp.int32)[None, None, :]
    sq = lengths_q[:, None, None]
    skv = lengths_kv[:, None, None]
    mask = (i < sq) & (j < skv)
    diagonal = i if config.diagonal_alignment == "top_left" else i + skv - sq
    if config.right_bound is not None:
        mask &= j <= diagonal + config.right_bound
    if config.left_bound is not None:
        mask &= j >= diagonal - config.left_bound
    return mask


def attention_xla(q, k, v, cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig, sinks=None):
    """Returns (out [Tq, Hq, Dv] in q's dtype, stats float32 in the configured layout).

    sinks: None or [Hq], one logit per query head that joins each row's softmax without a value.
    """
    cu_q, cu_kv = sanitize_both(cu_seqlens_q, cu_seqlens_kv, config)
    lengths_q = sequence_lengths(cu_q, config.max_seqlen_q)
    lengths_kv = sequence_lengths(cu_kv, config.max_seqlen_kv)

    b, sq, skv = config.num_seqs, config.max_seqlen_q, config.max_seqlen_kv
    hkv, g = config.num_heads_kv, config.group_size
    q_pad = _to_padded(q, cu_q[:-1], lengths_q, sq).astype(jnp.float32).reshape(b, sq, hkv, g, -1)
    k_pad = _to_padded(k, cu_kv[:-1], lengths_kv, skv).astype(jnp.float32)
    v_pad = _to_padded(v, cu_kv[:-1], lengths_kv, skv).astype(jnp.float32)

    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q_pad, k_pad, precision="highest") * config.scale
    mask = _mask(config, lengths_q, lengths_kv)[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    has_keys = jnp.any(mask, axis=-1, keepdims=True)  # from the mask: a large sink may underflow every weight
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, hkv, g, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    # Rows with no attended key have max -inf; shift them by 0 so exp gives exact zeros, not NaN.
    row_max = jax.lax.stop_gradient(jnp.where(has_keys, row_max, 0.0))
    weights = jnp.exp(logits - row_max)
    row_sum = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:  # the sink's share of the softmax, which multiplies no value
        # -inf inside the exp, not a where around it: exp(sink) overflows in rows without keys (shift 0),
        # and a where would send 0 * inf = NaN back to the sinks.
        row_sum = row_sum + jnp.exp(jnp.where(has_keys, sink - row_max, -jnp.inf))
    safe_sum = jnp.where(has_keys, row_sum, 1.0)
    out_pad = jnp.einsum("bhgqk,bkhd->bqhgd", weights / safe_sum, v_pad, precision="highest")
    lse_pad = jnp.where(has_keys, jnp.log(safe_sum) + row_max, -jnp.inf)[..., 0]  # [B, Hkv, G, Sq]

    seq, pos, valid = row_positions(cu_q, config.capacity_q, sq)
    seq = jnp.minimum(seq, b - 1)
    pos = jnp.clip(pos, 0, sq - 1)
    out = out_pad.reshape(b, sq, config.num_heads_q, -1)[seq, pos]
    out = jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
    stats = lse_pad.reshape(b, config.num_heads_q, sq).transpose(0, 2, 1)[seq, pos]  # [Tq, Hq]
    stats = jnp.where(valid[:, None], stats, -jnp.inf)
    if config.stats_layout == "head_major":
        stats = stats.T
    return out, stats
