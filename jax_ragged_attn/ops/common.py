"""What both ops run around their backend call, each step once: arrays as jnp makes them, the backend the
registry picks, and the result from the backend's (out, stats) with sinks as an epilogue."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn import backends
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.features.sinks import apply_sinks


def as_array(x):
    """NumPy arrays as jnp.asarray makes them, the way jax.nn.dot_product_attention takes them: float64 becomes
    float32 unless jax_enable_x64 is on. Anything else as it is (the op's config names what it cannot take)."""
    return jnp.asarray(x) if isinstance(x, np.ndarray) else x


def choose(op: str, options: AttentionOptions, config, index, *, stats_gradient: bool = False):
    """The backend module that runs this call of `op` (backends.choose: the named implementation, or the
    registry's choice for implementation=None)."""
    return backends.choose(options.implementation, config, index, stats_gradient=stats_gradient, op=op)


def result(
    out,
    stats,
    sinks,
    real_rows,
    rows_with_keys,
    stats_layout: str,
    return_stats: bool,
    extra: tuple = (),
    *,
    invalid_rows=None,
):
    """out, or (out, stats), then `extra`: the op's result from the sink-free backend's out and stats (in
    `stats_layout`), with sinks (None: none, or already folded into the backend's call) as features/sinks.py's
    epilogue over the rows given, and the `invalid_rows` (bool, out's row axes) made NaN (`loud`)."""
    if sinks is not None:
        out, stats = apply_sinks(out, stats, sinks, real_rows, rows_with_keys, stats_layout, return_stats)
    if invalid_rows is not None:
        out, stats = loud(out, stats if return_stats else None, invalid_rows, stats_layout)
    values = ((out, stats) if return_stats else (out,)) + tuple(extra)
    return values if len(values) > 1 else out


# Jitted, so that the NaN fill is a constant inside one program: called eagerly under jax.debug_nans, a NaN
# made on its own would stop valid calls too; this way only a NaN that reaches the result does.
@functools.partial(jax.jit, static_argnames="stats_layout")
def loud(out, stats, invalid_rows, stats_layout: str):
    """(out, stats) with the rows `invalid_rows` marks NaN, in out ([..., rows, H, D]) and in stats
    (head_major [..., H, rows], token_major [..., rows, H]; None: not returned).

    Outside check mode the kernels run on index arrays clamped into the buffers, so a row whose inputs are
    invalid (index.invalid_sequences, index/kvcache.invalid_query_rows) would read finite, wrong numbers. This
    one select makes them NaN on the device, with no host round trip, so a NaN loss, a metric or
    jax.debug_nans notices; every other row passes through bit for bit. Its cotangent is 0 on those rows, so
    the backward sees no NaN from here."""
    out = jnp.where(invalid_rows[..., None, None], jnp.asarray(jnp.nan, out.dtype), out)
    if stats is not None:
        rows = invalid_rows[..., None, :] if stats_layout == "head_major" else invalid_rows[..., None]
        stats = jnp.where(rows, jnp.asarray(jnp.nan, stats.dtype), stats)
    return out, stats
