"""A stats cotangent on the cuDNN path, carried through cuDNN's own backward pass on widened value columns.

stats_i = logsumexp_j s_ij with s_ij = scale * q_i.k_j over the attended keys, so d stats_i / d s_ij = p_ij:
a cotangent g_i on stats_i adds g_i * p_ij to the gradient of every logit of row i (per query head).

cuDNN's backward computes dS_ij = p_ij * (dP_ij - D_i) with dP = dO.V^T and D_i = rowsum(dO_i * O_i), and D
is the only use it makes of O. Lowering D_i by g_i therefore adds exactly g_i * p_ij to dS, and dQ = scale *
dS.K and dK = scale * dS^T.Q take the stats term from there like any other (with softcap, s_ij is the capped
score and the graph's score modifier carries all of dS through the cap's derivative alike). No handler takes
D as an input, so it is shifted through O and dO, by appending EXTRA_COLUMNS columns to the value head dim:

    V''  = [V, 0]   P.V'' and dP = dO''.V''^T read V'' only where it is V: dP is unchanged;
    O''  = [O, e]   D''_i = rowsum(dO_i * O_i) + sum(c_i * e_i) = D_i - g_i, since sum(c_i * e_i) = -g_i;
    dO'' = [dO, c]  dV'' = P^T.dO'': its first Dv columns are P^T.dO = dV; the others are dropped.

So one pass gives dQ, dK and dV for both cotangents; nothing is approximated but the rounding of g below,
which assumes that cuDNN sums D in float32 from products of dtype values (tests/test_cudnn.py checks).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.index import query_rows_with_keys, sanitize_both

# Two columns carry g and the rest are zero: cuDNN takes head dims in multiples of 8, and 16 keeps a Dv that
# is a multiple of 16 one. The widened Dv must stay within cuDNN's limit (cudnn/launch.py checks: Dv <= 240).
EXTRA_COLUMNS = 16


def widened_config(config):
    """The configuration of the backward a stats cotangent runs: Dv widened by EXTRA_COLUMNS."""
    return dataclasses.replace(config, head_dim_v=config.head_dim_v + EXTRA_COLUMNS)


def stats_columns(g: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(c, e), each [..., EXTRA_COLUMNS] in `dtype`, with sum(c * e) = -g (float32 g, any shape).

    c = [2^k, 2^k, 0, ...] and e = [-hi, -lo, 0, ...] with hi = g / 2^k rounded to the dtype and lo = the
    remainder rounded too: two terms hold about twice the dtype's mantissa bits (about 2^-17 relative in
    bfloat16, 2^-23 in float16), near float32. The power of two k puts g / 2^k in [0.5, 1), where float16's
    narrow range (largest 65504, smallest normal 2^-14) can neither overflow nor flush it, and scaling by a
    power of two is exact, so each product c * e is exactly 2^k times a dtype value.
    """
    info = jnp.finfo(dtype)
    _, exponent = jnp.frexp(g)  # g = mantissa * 2^exponent with |mantissa| in [0.5, 1)
    # 2^k must itself be a normal number of the dtype; outside that range g / 2^k leaves [0.5, 1) (only
    # for |g| beyond about 2e9 in float16, where hi overflows, or so small that its term is negligible).
    k = jnp.clip(exponent, info.minexp, info.maxexp - 1)
    scaled = jnp.ldexp(g, -k)
    hi = scaled.astype(dtype)
    lo = (scaled - hi.astype(jnp.float32)).astype(dtype)
    power = jnp.ldexp(jnp.ones_like(g), k).astype(dtype)
    zeros = jnp.zeros((*g.shape, EXTRA_COLUMNS - 2), dtype)
    c = jnp.concatenate([power[..., None], power[..., None], zeros], axis=-1)
    e = jnp.concatenate([-hi[..., None], -lo[..., None], zeros], axis=-1)
    return c, e


def widened_backward_inputs(
    v, out, d_out, d_stats, cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig, seqused=(None, None)
):
    """(config, v'', out'', d_out'') for the cuDNN backward; its dV comes back [Tkv, Hkv, Dv + EXTRA_COLUMNS]
    and only the first Dv columns are the gradient.

    d_out may be a SymbolicZero (a loss of stats alone): dO'' is then [0, c], which leaves only the stats term.
    d_stats is float32 in the configured layout.
    """
    dtype = v.dtype
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, dtype)
    g = d_stats.T if config.stats_layout == "head_major" else d_stats  # per query row: [Tq, Hq]
    # Rows the op does not own (padding, rows without any key) have no softmax: their cotangent is not ours to
    # read, and a NaN there must not reach D, where P = 0 would turn it into 0 * NaN. `where`, not a multiply.
    cu_q, cu_kv = sanitize_both(cu_seqlens_q, cu_seqlens_kv, config)
    owned = query_rows_with_keys(cu_q, cu_kv, config, *seqused)[:, None]
    g = jnp.where(owned, g.astype(jnp.float32), 0.0)
    c, e = stats_columns(g, dtype)
    widened = widened_config(config)
    v_zeros = jnp.zeros((*v.shape[:2], EXTRA_COLUMNS), dtype)
    return (
        widened,
        jnp.concatenate([v, v_zeros], axis=-1),
        jnp.concatenate([out.astype(dtype), e], axis=-1),
        jnp.concatenate([d_out.astype(dtype), c], axis=-1),
    )
