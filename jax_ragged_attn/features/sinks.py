"""Learnable sinks (gpt-oss) as an epilogue of the sink-free op, on every implementation.

A sink logit s_h joins a row's softmax without a value. From the sink-free output o and log-sum-exp L of the
row (the op's own results), the row with the sink is

    L' = logaddexp(L, s_h)          out = o * exp(L - L') = o * sigmoid(L - s_h)

because the sink only adds exp(s_h) to the softmax's denominator. A real query row without keys (L = -inf,
o = 0) has the sink as its whole softmax: L' = s_h and out stays 0. Padding rows and rows past seqused /
max_seqlen are not real tokens: they keep stats -inf.

Gradients are exact through the op's differentiable stats: dL reaches q and k as a stats cotangent, s_h
gets sum over rows of (dL'_i - <dO_i, out_i>) * p_sink,i, all by autodiff of the two lines above. The
elementwise epilogue fuses into one XLA pass; the price on cuDNN is the backward with a stats cotangent
(shared/stats_grad.py: 16 more value columns), so sinks there need Dv <= 240 like any stats gradient.
"""

from __future__ import annotations

import jax.numpy as jnp


def sink_terms(stats, s_rows, keys):
    """(L' = logaddexp(L, s), the weight sigmoid(L - s) the keys keep), both broadcast like `stats`; rows
    outside `keys` (stats may hold anything there) get L' = s and weight 0."""
    lse = jnp.where(keys, stats, 0.0)  # finite everywhere; the where stops any gradient into other rows
    with_sink = jnp.where(keys, jnp.logaddexp(lse, s_rows), s_rows)  # a keyless real row: the sink alone
    weight = jnp.where(keys, jnp.exp(lse - with_sink), 0.0)  # = sigmoid(L - s): the mass the keys keep
    return with_sink, weight


def apply_sinks(out, stats, sinks, real_rows, rows_with_keys, stats_layout: str, return_stats: bool):
    """(out with the sinks, stats with the sinks or None) from the sink-free op's out [..., T, Hq, Dv] and
    float32 stats in `stats_layout`, head-major [..., Hq, T] or token-major [..., T, Hq] (read only in
    rows_with_keys: elsewhere they may hold anything); sinks [Hq]; real_rows, rows_with_keys [..., T] bool.
    ragged_attention's rows are [Tq] (index.RaggedIndex's real_rows_q and rows_with_keys), a KV-cache call's
    [B, Sq].

    No inf is formed unless stats are returned (then only the documented -inf of rows that are not real
    tokens), so jax.debug_infs stays quiet as it does without sinks."""
    s = sinks.astype(jnp.float32)
    head_major = stats_layout == "head_major"
    as_stats = (lambda rows: rows[..., None, :]) if head_major else (lambda rows: rows[..., None])
    # The sinks at the stats' own rank ([..., Hq, 1] or [..., 1, Hq]): jax_numpy_rank_promotion="raise" refuses
    # an implicit broadcast, and a KV-cache call's stats carry a leading batch axis.
    lead = (1,) * (stats.ndim - 2)
    s_rows = s.reshape(lead + ((-1, 1) if head_major else (1, -1)))
    with_sink, weight = sink_terms(stats, s_rows, as_stats(rows_with_keys))
    weight = jnp.swapaxes(weight, -1, -2) if head_major else weight  # [..., T, Hq]
    out = (out.astype(jnp.float32) * weight[..., None]).astype(out.dtype)
    if not return_stats:
        return out, None
    return out, jnp.where(as_stats(real_rows), with_sink, -jnp.inf)
