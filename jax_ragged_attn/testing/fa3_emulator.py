"""A dense jnp stand-in for the two FlashAttention-3 kernels backends/fa3/ragged.py calls, for testing its
wrapper on any backend (the CPU in CI): the semantics of FA3's varlen kernels as fa3/ragged.py relies on
them, nothing more.

- Sequence b's queries are rows cu_q[b] + [0, seqused_q[b]), its keys rows cu_kv[b] + [0, seqused_k[b]).
- Masks are aligned bottom-right: query i sees key j iff i + skv - sq - left <= j <= i + skv - sq + right
  (-1: unbounded; is_causal: right = 0), skv / sq the used lengths.
- Like FA3, whose tiles load rows past a sequence's end (the next sequence's, padding) and mask only their
  scores, the products read every row of the buffers: a NaN outside every sequence reaches the results
  (0 * NaN) unless the wrapper has cleared it, as fa3/ragged.py must.
- The forward writes out and the log-sum-exp (head-major, row r of head h at h * Tq + r of its buffer) in the
  rows it owns; everything else it leaves as it found it, here NaN, so a wrapper that reads them fails.
- The backward recomputes P from the given lse, takes D = rowsum(dO * O) from the given dO and O (so a
  wrapper may shift D through them, as fa3/ragged.py's stats term does), and writes dq (rows it owns), dk, dv
  (used key rows); elsewhere NaN.

`patched()` swaps them in for fa3/ragged.py's kernel calls and declares FA3 available; `patched_dew()` for
fa3/dew.py's, which take offsets alone (every sequence's rows used), as dew-flash-attn's kernels do.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp

from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.index import row_positions


def _rows(cu, used, capacity):
    """(sequence, position, owned) of each row, from offsets and used lengths."""
    seq, pos, _ = row_positions(cu, capacity, capacity)
    num_seqs = cu.shape[0] - 1
    clamped = jnp.minimum(seq, num_seqs - 1)
    owned = (seq < num_seqs) & (pos >= 0) & (pos < used[clamped])
    return clamped, pos, owned


def _probabilities(q, k, cu_q, cu_kv, used_q, used_kv, config, lse=None):
    """(P [Hq, Tq, Tkv] float32, lse [Hq, Tq], owned_q, owned_kv) with the bottom-right band mask."""
    is_causal, left, right = _fa3._window(config)
    right = 0 if is_causal else right
    seq_q, pos_q, owned_q = _rows(cu_q, used_q, q.shape[0])
    seq_kv, pos_kv, owned_kv = _rows(cu_kv, used_kv, k.shape[0])
    diagonal = pos_q + used_kv[seq_q] - used_q[seq_q]
    mask = (seq_q[:, None] == seq_kv[None, :]) & owned_q[:, None] & owned_kv[None, :]
    if left >= 0:
        mask &= pos_kv[None, :] >= (diagonal - left)[:, None]
    if right >= 0:
        mask &= pos_kv[None, :] <= (diagonal + right)[:, None]
    group = q.shape[1] // k.shape[1]
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    s = config.scale * jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf, precision="highest")
    s = jnp.where(mask[None], s, -jnp.inf)  # FA3 overwrites masked scores
    if lse is None:
        lse = jax.nn.logsumexp(s, axis=-1)
    finite = jnp.isfinite(lse)
    p = jnp.where(mask[None] & finite[:, :, None], jnp.exp(s - jnp.where(finite, lse, 0.0)[:, :, None]), 0.0)
    # A NaN log-sum-exp handed to the backward for a row it owns spreads over that row's band, as exp(s - NaN)
    # does in the kernel: into dQ of the row and dK, dV of every key it sees.
    p = jnp.where(mask[None] & jnp.isnan(lse)[:, :, None], jnp.nan, p)
    return p, lse, owned_q, owned_kv


def forward_call(q, k, v, cu_q, cu_kv, used_q, used_kv, config):
    p, lse, owned_q, _ = _probabilities(q, k, cu_q, cu_kv, used_q, used_kv, config)
    group = q.shape[1] // k.shape[1]
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=1)  # 0 * NaN where a row outside is NaN
    out = jnp.einsum("hqk,khd->qhd", p, vf, precision="highest")
    out = jnp.where(owned_q[:, None, None], out, jnp.nan).astype(q.dtype)
    lse_hm = jnp.where(owned_q[None, :], lse, jnp.nan)
    buffer = jnp.full(_fa3._lse_shape(config), jnp.nan, jnp.float32).reshape(-1)
    buffer = buffer.at[: lse_hm.size].set(lse_hm.reshape(-1)).reshape(_fa3._lse_shape(config))
    return out, buffer


def backward_call(d_out, q, k, v, out, lse, cu_q, cu_kv, used_q, used_kv, config):
    lse_hm = _fa3.lse_head_major(lse, config)
    p, _, owned_q, owned_kv = _probabilities(q, k, cu_q, cu_kv, used_q, used_kv, config, lse=lse_hm)
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    # dO and O of rows FA3 owns only (its preprocessing reads those), everything else as it lies.
    d_o = jnp.where(owned_q[:, None, None], d_out.astype(jnp.float32), 0.0)
    o = jnp.where(owned_q[:, None, None], out.astype(jnp.float32), 0.0)
    D = jnp.sum(d_o * o, axis=-1).T  # [Hq, Tq]
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=1)
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    qf = q.astype(jnp.float32)
    dp = jnp.einsum("qhd,khd->hqk", d_o, vf, precision="highest")
    ds = p * (dp - D[:, :, None])
    dq = config.scale * jnp.einsum("hqk,khd->qhd", ds, kf, precision="highest")
    dk = config.scale * jnp.einsum("hqk,qhd->khd", ds, qf, precision="highest")
    dv = jnp.einsum("hqk,qhd->khd", p, d_o, precision="highest")
    fold = lambda x: x.reshape(x.shape[0], hkv, group, x.shape[-1]).sum(axis=2)
    dk, dv = fold(dk), fold(dv)
    dq = jnp.where(owned_q[:, None, None], dq, jnp.nan).astype(q.dtype)
    dk = jnp.where(owned_kv[:, None, None], dk, jnp.nan).astype(k.dtype)
    dv = jnp.where(owned_kv[:, None, None], dv, jnp.nan).astype(v.dtype)
    return dq, dk, dv


def _without_seqused(call):
    """An emulated kernel of the dew binding's signature (offsets only, every sequence's rows all used)."""

    def kernel(*args):
        *arrays, offsets_q, offsets_kv, config = args
        return call(*arrays, offsets_q, offsets_kv, jnp.diff(offsets_q), jnp.diff(offsets_kv), config)

    return kernel


def _rows_within_max_seqlen(offsets_q, config):
    """[Tq]: the row lies within the first max_seqlen_q rows of its sequence (of the offsets)."""
    _, position, _ = row_positions(offsets_q, config.capacity_q, config.capacity_q)
    return position < config.max_seqlen_q


def _grid_cut_at_max_seqlen(forward):
    """The dew forward stand-in, leaving the rows of a sequence past max_seqlen_q unwritten (NaN out and
    log-sum-exp): what a kernel whose grid is sized by max_seqlen does. The wrapper must keep such rows out of
    every result (a gap sequence longer than max_seqlen, dew.py)."""

    def kernel(q, k, v, offsets_q, offsets_kv, config):
        out, lse = forward(q, k, v, offsets_q, offsets_kv, config)
        written = _rows_within_max_seqlen(offsets_q, config)
        out = jnp.where(written[:, None, None], out, jnp.nan)
        lse_hm = jnp.where(written[None, :], _fa3.lse_head_major(lse, config), jnp.nan)
        return out, lse_hm.reshape(lse.shape)

    return kernel


def _backward_grid_cut_at_max_seqlen(backward):
    """The dew backward stand-in reading the rows of a sequence past max_seqlen_q with a NaN log-sum-exp: FA3's
    backward preprocessing (its rows' log-sum-exp and rowsum(dO * O) scratch) runs over max_seqlen rows of each
    sequence, so the main loop reads those rows' scratch unwritten."""

    def kernel(d_out, q, k, v, out, lse, offsets_q, offsets_kv, config):
        written = _rows_within_max_seqlen(offsets_q, config)
        lse = jnp.where(written[None, :], _fa3.lse_head_major(lse, config), jnp.nan)
        return backward(d_out, q, k, v, out, lse, offsets_q, offsets_kv, config)

    return kernel


@contextlib.contextmanager
def patched_dew():
    """backends/fa3/dew.py with these kernels, taking offsets alone as dew-flash-attn's do, and it available."""
    from jax_ragged_attn.backends.fa3 import dew

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(dew, "_kernel_forward", _grid_cut_at_max_seqlen(_without_seqused(forward_call)))
        )
        stack.enter_context(
            mock.patch.object(
                dew, "_kernel_backward", _backward_grid_cut_at_max_seqlen(_without_seqused(backward_call))
            )
        )
        stack.enter_context(mock.patch.object(dew, "unavailable_reason", lambda: None))
        yield


@contextlib.contextmanager
def patched():
    """backends/fa3/ragged.py with these kernels in place of the wheel's, and FA3 declared available."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_fa3, "_forward_call", forward_call))
        stack.enter_context(mock.patch.object(_fa3, "_backward_call", backward_call))
        stack.enter_context(mock.patch.object(_fa3, "unavailable_reason", lambda: None))
        yield


def kvcache_reads_unchecked(out, lse, lengths, page_table, config):
    """(out, lse) as FA3's kvcache kernel leaves them when it is handed an index it reads without bounds: it
    takes `lengths` as each sequence's rows and page_table[b, row // page_size] as their pages, unchecked, so a
    length outside [0, capacity] or an entry outside [0, num_pages) makes it read outside the cache. A stand-in
    cannot read there; it poisons every result with NaN instead, so a wrapper that hands FA3 such an index
    (backends/fa3/kvcache.py READS_TABLE_UNCHECKED: the op layer clamps both) fails whatever it compares."""
    bad = jnp.any((lengths < 0) | (lengths > config.capacity))
    if page_table is not None:
        table = jnp.asarray(page_table)
        bad = bad | jnp.any((table < 0) | (table >= config.num_pages))
    return jnp.where(bad, jnp.nan, out).astype(out.dtype), jnp.where(bad, jnp.nan, lse)
