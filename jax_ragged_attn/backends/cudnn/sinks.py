"""Sinks on the cuDNN path when the caller takes no stats: the sink folded into the backward's O and dO.

With the sink-free row (o, L) and sigma = sigmoid(L - s_h), the op returns out = sigma * o (sinks.py). Its
exact backward gives the sink-free op the cotangents dO = sigma * dOut and dL = sigma (1 - sigma) <dOut, o>;
cuDNN's backward would then need a stats cotangent (16 more value columns, stats_grad.py: 6.4 against 3.0
ms fwd+bwd on W1). But cuDNN reads O only for D = rowsum(dO * O), which the stats cotangent lowers:

    D = <sigma dOut, o> - dL = sigma <dOut, o> - sigma (1 - sigma) <dOut, o> = sigma^2 <dOut, o>
      = <sigma dOut, sigma o>

so the plain backward handed dO' = sigma * dOut and O' = sigma * o = out (the forward's own result) computes
exactly the gradient of q, k and v. The sink's own gradient is d s_h = -sum_i sigma_i (1 - sigma_i) <dOut_i,
o_i> over rows with keys. Used when stats are not returned (no stats cotangent can arrive); with
return_stats the epilogue of sinks.py runs on the op's differentiable stats instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ragged_attn.backends.cudnn import launch
from jax_ragged_attn.backends.shared.forward_mode import forward_mode
from jax_ragged_attn.backends.shared.remat_names import named_residuals
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.features.sinks import apply_sinks, sink_terms
from jax_ragged_attn.index import RaggedIndex, query_rows_with_keys, sanitize_both


def _sigma(raw_stats, sinks, rows_with_keys, config: AttentionConfig):
    """[Tq, Hq] float32: sigmoid(L - s_h) in rows with keys (the mass the keys keep), 0 elsewhere."""
    lse = raw_stats.T if config.stats_layout == "head_major" else raw_stats
    return sink_terms(lse, sinks.astype(jnp.float32)[None, :], rows_with_keys[:, None])[1]


def _forward(buffers, cu_seqlens_q, cu_seqlens_kv, sinks, config, seqused):
    out, _, raw_stats = launch._run(launch._forward, 3, buffers, cu_seqlens_q, cu_seqlens_kv, config, seqused)
    cu_q, cu_kv = sanitize_both(cu_seqlens_q, cu_seqlens_kv, config)
    keys = query_rows_with_keys(cu_q, cu_kv, config, *seqused)
    sigma = _sigma(raw_stats, sinks, keys, config)
    with_sinks = (out.astype(jnp.float32) * sigma[:, :, None]).astype(out.dtype)
    return with_sinks, (out, raw_stats, keys, sigma)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention_with_sinks(
    buffers: tuple, cu_seqlens_q, cu_seqlens_kv, sinks, config: AttentionConfig, seqused=(None, None)
):
    """out [Tq, Hq, Dv] with sinks [Hq] of the buffers laid out as config.packing says (launch.attention's),
    without stats; differentiable in the buffers and the sinks."""
    return _forward(buffers, cu_seqlens_q, cu_seqlens_kv, sinks, config, seqused)[0]


def _fwd(buffers, cu_seqlens_q, cu_seqlens_kv, sinks, config, seqused=(None, None)):
    out, (o, raw_stats, keys, sigma) = _forward(buffers, cu_seqlens_q, cu_seqlens_kv, sinks, config, seqused)
    o, raw_stats = named_residuals(o, raw_stats)
    return out, (buffers, cu_seqlens_q, cu_seqlens_kv, sinks, seqused, o, out, raw_stats, keys, sigma)


def _bwd(config, residuals, d_out):
    buffers, cu_seqlens_q, cu_seqlens_kv, sinks, seqused, o, out, raw_stats, keys, sigma = residuals
    # Cotangents of rows without keys are never read (they may hold NaN): those rows' out is a constant 0.
    d_out = jnp.where(keys[:, None, None], d_out.astype(jnp.float32), 0.0)
    # <dOut, o> per row and head, in the precision the epilogue's own autodiff would use.
    dot = jnp.sum(d_out * o.astype(jnp.float32), axis=-1)
    d_sinks = -jnp.sum(sigma * (1.0 - sigma) * dot, axis=0).astype(sinks.dtype)
    d_out_folded = (d_out * sigma[:, :, None]).astype(config.dtype)
    grads = launch._run(
        launch._backward, 6, buffers, cu_seqlens_q, cu_seqlens_kv, out, raw_stats, d_out_folded, config, seqused
    )
    return grads, None, None, d_sinks, jax.tree.map(lambda _: None, seqused)


attention_with_sinks.defvjp(_fwd, _bwd)


def _portable(buffers, cu_seqlens_q, cu_seqlens_kv, sinks, config: AttentionConfig, seqused=(None, None)):
    """attention_with_sinks on the portable path: its raw stats and the sink epilogue (the op's own for a
    backend without folded sinks), the derivatives forward mode takes."""
    index = RaggedIndex(cu_seqlens_q, cu_seqlens_kv, *seqused)
    out, stats = launch.portable_attention(buffers, cu_seqlens_q, cu_seqlens_kv, config, seqused)
    real, keys = index.real_rows_q(config), index.rows_with_keys(config)
    return apply_sinks(out, stats, sinks, real, keys, config.stats_layout, False)[0]


# The residuals begin with the arguments themselves.
attention_with_sinks = forward_mode(attention_with_sinks, _portable, primals_from=lambda config, saved: saved[:5])
