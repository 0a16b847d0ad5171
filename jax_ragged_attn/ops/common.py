"""What both ops run around their backend call, each step once: arrays as jnp makes them, the backend the
registry picks, and the result from the backend's (out, stats) with sinks as an epilogue."""

from __future__ import annotations

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


def result(out, stats, sinks, real_rows, rows_with_keys, stats_layout: str, return_stats: bool, extra: tuple = ()):
    """out, or (out, stats), then `extra`: the op's result from the sink-free backend's out and stats (in
    `stats_layout`), with sinks (None: none, or already folded into the backend's call) as features/sinks.py's
    epilogue over the rows given."""
    if sinks is not None:
        out, stats = apply_sinks(out, stats, sinks, real_rows, rows_with_keys, stats_layout, return_stats)
    values = ((out, stats) if return_stats else (out,)) + tuple(extra)
    return values if len(values) > 1 else out
