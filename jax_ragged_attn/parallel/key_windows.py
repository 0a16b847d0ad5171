"""Key windows: the static-size runs of gathered K/V rows a context-parallel device's queries can reach.

A device attends its chunk's queries to keys of the gathered, natural-order K/V (context_parallel.py). Only
rows within max_seqlen of the chunk can be keys of its pieces, so the calls read, zero and write dK/dV for a
window of rows + max_seqlen - 1 rows (causal; without a mask max_seqlen - 1 more after the chunk), not for
all T (with short documents those per-row costs are most of a device's call). `windows` cuts one or more such
windows side by side, with a backward of its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ragged_attn.backends.shared.forward_mode import forward_mode


def window_bounds(total: int, chunk_start, rows: int, *, max_seqlen: int, is_causal: bool):
    """(first row, static size): the rows of `total` gathered, natural-order key rows that the queries of the
    chunk [chunk_start, chunk_start + rows) can reach.

    A query row in the chunk belongs to a sequence whose real rows (at most max_seqlen of them) reach into the
    chunk, so the sequence starts after chunk_start - max_seqlen; causal keys end with the chunk, others at
    most max_seqlen - 1 rows past it. chunk_start may be traced; the size is static.
    """
    reach = max_seqlen - 1
    size = min(total, rows + reach + (0 if is_causal else reach))
    return jnp.clip(jnp.asarray(chunk_start, jnp.int32) - reach, 0, total - size), size


def windows(x, starts: tuple, size: int):
    """x's rows [s, s + size) for each s in starts (traced), side by side along axis 0.

    Its own backward writes the [T, ...] gradient in one pass, each row the sum of the windows' rows that cover
    it (windows may overlap). Autodiff of the slices would pad each window's gradient to T rows and add the
    padded arrays (on the H200, CP-c n = 8: 0.2 ms of pads, broadcasts and adds in a 3.5 ms device step).
    """
    return _windows(x, tuple(starts), size, x.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _windows(x, starts, size, total):
    return jnp.concatenate([lax.dynamic_slice_in_dim(x, s, size, axis=0) for s in starts])


def _windows_fwd(x, starts, size, total):
    # x's dtype and trailing shape on zero rows: what forward mode needs of x (the windows are linear in it).
    return _windows(x, starts, size, total), (starts, x[:0])


def _windows_bwd(size, total, saved, g):
    starts, _ = saved
    # One elementwise pass over the T rows: each row takes its rows of the windows that cover it (gathered
    # rows, clamped where a window does not), so XLA writes the gradient once and reads each window once,
    # where zeros + in-place updates compiled to a pad of all T rows and a second full pass per update.
    rows = jnp.arange(total, dtype=jnp.int32)
    grad = None
    for j, s in enumerate(starts):
        part = lax.slice_in_dim(g, j * size, (j + 1) * size, axis=0)
        local = rows - s
        inside = (local >= 0) & (local < size)
        taken = jnp.take(part, jnp.clip(local, 0, size - 1), axis=0, mode="clip")
        term = jnp.where(inside.reshape((-1,) + (1,) * (g.ndim - 1)), taken, jnp.zeros((), g.dtype))
        grad = term if grad is None else grad + term
    return grad, tuple(None for _ in starts)


_windows.defvjp(_windows_fwd, _windows_bwd)
# The windows are slices: forward mode slices the tangent the same way.
_windows = forward_mode(
    _windows,
    _windows.fun,
    second_order=False,
    primals_from=lambda size, total, saved: (jnp.zeros((total, *saved[1].shape[1:]), saved[1].dtype), saved[0]),
)
