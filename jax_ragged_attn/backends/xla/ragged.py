"""The portable implementation: blocked attention in plain jnp with an online softmax, on any backend.

Memory-efficient attention (Rabe & Staats, "Self-attention does not need O(n^2) memory"; FlashAttention's
recurrence) over the packed token axis. Query rows are cut into blocks of block_q rows; every block walks
through the key rows it may attend, block_kv at a time, keeping a running max, sum and weighted value sum
per row in float32. The backward is FlashAttention's: the forward saves each row's log-sum-exp, and the
backward recomputes each tile's probabilities from it. Key blocks walk the query rows that attend them (a
contiguous range too, so a tile's rows are slices, not gathers), accumulating dK and dV; dQ comes either
from the same tiles, each tile's dS.K added into its query rows with a scatter-add (the fused form, five
matmuls a tile: the CPU's default, where XLA adds in order), or from a second pass in which query blocks
walk their key ranges (seven matmuls a tile, no scatter-add: the default elsewhere, since a GPU's
scatter-add of overlapping rows is atomic and its order varies; xla_memory.fused_backward).

The tiles' matmuls take bfloat16 / float16 inputs in their own dtype, the probabilities and dS cast down,
with float32 accumulation (as jax.nn's xla attention and the fused kernels), and float32 inputs at HIGHEST
precision (no TF32); xla_memory.matmul_dtype. The softmax state is float32 either way.

The keys a query row attends are one interval [first, last] of the packed key rows: its own sequence's
keys, cut by the causal / window band. A tile's mask is therefore two comparisons, whatever the sequences,
and a query block needs only the key rows from its rows' smallest `first` to their largest `last`:

    cu_seqlens = [0, 3, 5], causal, block_q = block_kv = 2     query rows  0 1 | 2 3 | 4 .
    first = [0, 0, 0, 3, 3, .], last = [0, 1, 2, 3, 4, .]     key range   0:2 | 0:4 | 3:5
    tiles per block: 1, 2, 1                                   tiles       [0:2] | [0:2, 2:4] | [3:5]

Every pass is balanced (_walk): the blocks' tiles, listed block after block (1 + 2 + 1 = 4 above), are
shared out in equal runs among one lane per block, ceil(4/3) = 2 each: lane 0 does block 0's tile and
block 1's first, lane 1 block 1's second and block 2's, lane 2 idles. A pass therefore costs the tiles the
blocks really need (a causal block needs from one tile to its whole sequence's worth), not blocks x the
widest range, in a while loop whose trip count is computed on the device. A lane's run of one block is a
segment; its state goes to a slot of its own, and each block combines its slots in a fixed order after the
loop (_walk_fold): sums in the backward, online-softmax states merged in the forward (block 1 above merges
lane 0's segment with lane 1's). Everything is deterministic except dQ of the fused form on a GPU.

Memory: a step holds Tq * Hq * block_kv float32 scores (two such tensors forward, four backward) plus
O(T * H * D) float32 lane states, slots and merged states and the inputs: independent of max_seqlen and of
the number of sequences (xla_memory.estimate_bytes, checked against a bound before anything is compiled).
Compute: the tiles each block needs (causal self-attention: about sum of seqlen^2 / 2 per head plus a tile
per block) plus one tile per lane, in each pass.

softcap caps each tile's scores where they are made (_logits), before the mask; the backward recomputes the
capped scores and multiplies dS by the cap's derivative 1 - tanh^2, read back from them.

Masked logits are a finite large negative (as in jax.nn), never -inf, and every exp is of a value that
cannot overflow, so jax.debug_infs / jax.debug_nans stay quiet unless the inputs hold inf or NaN; the only
-inf ever produced is the documented stats of rows without keys, and only when stats are returned.

NaN or Inf in a row that is not a real token of some sequence (capacity padding, rows cut by max_seqlen)
is never read. A non-finite value in a real token reaches its own sequence only, as in a fused kernel whose
tiles never hold two sequences: a tile here may, and an exact 0 weight times NaN is NaN, so the tiles' value
and gradient operands hold 0 in place of every non-finite entry (_finite), and the rows that entry reaches are
set to NaN afterwards. In the forward that is every query row whose band holds a non-finite value row; in the
backward, every gradient row of a sequence with a non-finite input, cotangent or saved output.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_ragged_attn.backends.shared.forward_mode import forward_mode
from jax_ragged_attn.backends.shared.remat_names import named_residuals
from jax_ragged_attn.backends.xla import memory as xla_memory
from jax_ragged_attn.backends.xla.memory import WorkingSetTooLargeError, warn_cudnn_fallback
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.index import row_positions, sanitize_both, sequence_lengths

__all__ = ["WorkingSetTooLargeError", "attention_xla", "warn_cudnn_fallback"]

# jax.nn's choice: exp() of it is exactly 0, and a running max that starts from it stays finite.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static part of one call: the `nondiff_argnums` of the custom_vjp."""

    config: AttentionConfig
    block_q: int
    block_kv: int
    memory_limit: int | None
    operand: str  # the matmuls' operand dtype (xla_memory.matmul_dtype); they accumulate in float32


class _Bands(NamedTuple):
    """Who attends whom, as intervals of absolute rows (int32; empty when first > last)."""

    first: jax.Array  # [Tq] the first key row a query row attends, Tkv when none
    last: jax.Array  # [Tq] the last one, -1 when none
    key_first: jax.Array  # [Tkv] the first query row that attends a key row, Tq when none
    key_last: jax.Array  # [Tkv] the last one, -1 when none
    key_valid: jax.Array  # [Tkv] bool: a real key within max_seqlen_kv (only those rows are ever read)
    seq_q: jax.Array  # [Tq] each query row's sequence (clamped to the last one for padding rows)
    seq_kv: jax.Array  # [Tkv] each key row's sequence, likewise


def _bands(cu_q, cu_kv, config: AttentionConfig, used_q=None, used_kv=None) -> _Bands:
    """Bands of every row, from sanitised cu_seqlens. With d = i (top_left) or i + skv - sq (bottom_right),
    query i of a sequence attends keys max(0, d - left) .. min(skv - 1, d + right), key j is attended by
    queries max(0, j - (d - i) - right) .. min(sq - 1, j - (d - i) + left)."""
    tq, tkv, last_seq = config.capacity_q, config.capacity_kv, config.num_seqs - 1
    left, right = config.left_bound, config.right_bound
    lengths_q = sequence_lengths(cu_q, config.max_seqlen_q, used_q)
    lengths_kv = sequence_lengths(cu_kv, config.max_seqlen_kv, used_kv)

    def offset(seq):  # d - i
        return 0 if config.diagonal_alignment == "top_left" else lengths_kv[seq] - lengths_q[seq]

    seq, pos, valid = row_positions(cu_q, tq, config.max_seqlen_q, used_q)
    seq = seq_q = jnp.minimum(seq, last_seq)
    first, last = jnp.zeros_like(pos), lengths_kv[seq] - 1
    if left is not None:
        first = jnp.maximum(first, pos + offset(seq) - left)
    if right is not None:
        last = jnp.minimum(last, pos + offset(seq) + right)
    attends = valid & (first <= last)
    first = jnp.where(attends, cu_kv[seq] + first, tkv)
    last = jnp.where(attends, cu_kv[seq] + last, -1)

    seq, pos, key_valid = row_positions(cu_kv, tkv, config.max_seqlen_kv, used_kv)
    seq = seq_kv = jnp.minimum(seq, last_seq)
    key_first, key_last = jnp.zeros_like(pos), lengths_q[seq] - 1
    if right is not None:
        key_first = jnp.maximum(key_first, pos - offset(seq) - right)
    if left is not None:
        key_last = jnp.minimum(key_last, pos - offset(seq) + left)
    attended = key_valid & (key_first <= key_last)
    key_first = jnp.where(attended, cu_q[seq] + key_first, tq)
    key_last = jnp.where(attended, cu_q[seq] + key_last, -1)
    return _Bands(first, last, key_first, key_last, key_valid, seq_q, seq_kv)


def attention_xla(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_kv,
    config: AttentionConfig,
    sinks=None,
    *,
    return_stats: bool | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    memory_limit=None,
    seqused_q=None,
    seqused_kv=None,
):
    """Returns (out [Tq, Hq, Dv] in q's dtype, stats float32 in the configured layout, or None).

    sinks: None or [Hq], one logit per query head that joins each row's softmax without a value.
    seqused_q, seqused_kv: None or int32 [B]: sequence b uses only the first seqused[b] rows of its slot.
    return_stats: None reads config.return_stats (ops.ragged.attend sets it); False returns stats None, and then no
    -inf is computed anywhere; "raw" returns them with 0 instead of -inf on rows without keys.
    block_q, block_kv, memory_limit: override config.xla_block_size / JAX_RAGGED_ATTN_XLA_MEMORY_LIMIT
    (xla_memory.py). Raises WorkingSetTooLargeError (a MemoryError) at trace time when the estimated
    working set of the forward, or of the backward when it is traced, exceeds the bound.
    """
    block_q, block_kv = xla_memory.block_sizes(config, block_q, block_kv)
    plan = _Plan(
        config, block_q, block_kv, xla_memory.memory_limit_bytes(memory_limit), xla_memory.matmul_dtype(config)
    )
    xla_memory.check_working_set(config, block_q, block_kv, "forward", plan.memory_limit)
    cu_q, cu_kv = sanitize_both(cu_seqlens_q, cu_seqlens_kv, config)
    bands = _bands(cu_q, cu_kv, config, seqused_q, seqused_kv)
    out, lse = _attention(plan, q, k, v, sinks, bands)
    wanted = config.return_stats if return_stats is None else return_stats
    if wanted == "raw":  # for an epilogue that masks them itself (sinks.py): 0, not -inf, on rows without keys
        return out, lse.T if config.stats_layout == "head_major" else lse
    if not wanted:
        return out, None
    # The documented -inf of rows without keys: the one place it exists (lse holds 0 there).
    stats = jnp.where((bands.first <= bands.last)[:, None], lse, -jnp.inf)
    return out, stats.T if config.stats_layout == "head_major" else stats


def _pad(x, rows: int, value=0):
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def _ceil_div(a, b):
    return -(-a // b)


def _steps(first, last, block: int, step: int):
    """Per block of `block` rows: (the first row of its range, how many `step`-row tiles cover the range)."""
    low = first.reshape(-1, block).min(axis=1)
    high = last.reshape(-1, block).max(axis=1) + 1
    return low, _ceil_div(jnp.maximum(high - low, 0), step)


def _clean(x, rows_ok, dtype=jnp.float32):
    """x in `dtype` with rows that are never attended set to 0: NaN there must not meet a 0 weight."""
    return jnp.where(rows_ok[:, None, None], x, 0).astype(dtype)


def _finite(x, rows_ok, dtype=jnp.float32):
    """_clean, and every non-finite entry set to 0 as well: a tile's masked products (an exact 0 weight times
    the entry) must not turn NaN for another sequence's rows. The caller sets the rows the entry really reaches
    to NaN (_nonfinite_rows)."""
    return jnp.where(rows_ok.reshape(rows_ok.shape + (1,) * (x.ndim - 1)) & jnp.isfinite(x), x, 0).astype(dtype)


def _nonfinite_rows(x, rows_ok):
    """[rows] bool: a row in rows_ok with a non-finite entry."""
    return rows_ok & ~jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1)


def _poison(x, rows):
    """x with the rows marked in `rows` ([len(x)] bool) set to NaN."""
    return jnp.where(rows.reshape(rows.shape + (1,) * (x.ndim - 1)), jnp.nan, x)


def _dot(plan, spec, a, b):
    """einsum of two tiles in the plan's operand dtype (probabilities and dS are cast down, as in
    FlashAttention), accumulated in float32; float32 operands at HIGHEST (no TF32 on a GPU)."""
    dtype = jnp.dtype(plan.operand)
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=precision, preferred_element_type=jnp.float32)


def _tile_mask(first, last, cols):
    """[n, 1, 1, rows, cols]: row r (band first[n, r]..last[n, r]) attends key row cols[n, c]."""
    inside = (cols[:, None, :] >= first[:, :, None]) & (cols[:, None, :] <= last[:, :, None])
    return inside[:, None, None]


def _logits(plan, q_tile, k_tile):
    """[n, Hkv, G, rows, cols] float32 scores of query tiles [n, rows, Hkv, G, D] and key tiles [n, cols, Hkv, D]:
    scale * q.k, capped to softcap * tanh(scale * q.k / softcap) when config.softcap is set (bounded by
    softcap, so a capped score never overflows anything the uncapped one would not)."""
    s = _dot(plan, "nqhgd,nkhd->nhgqk", q_tile, k_tile) * plan.config.scale
    cap = plan.config.softcap
    return cap * jnp.tanh(s / cap) if cap else s


def _uncapped_ds(plan, ds, logits):
    """dS of the capped scores (what the softmax backward gives) as dS of scale * q.k: times the cap's derivative
    1 - tanh^2, read back from the capped scores themselves (tanh = logits / softcap), so nothing is stored."""
    cap = plan.config.softcap
    return ds * (1.0 - jnp.square(logits / cap)) if cap else ds


def _query_blocks(plan, x):
    """[Tq, ...] -> [n_q, block_q, ...], padded."""
    n = _ceil_div(plan.config.capacity_q, plan.block_q)
    return _pad(x, n * plan.block_q).reshape(n, plan.block_q, *x.shape[1:])


def _heads_last(x):
    """[n, Hkv, G, bq, ...] -> [n * bq, Hq, ...] (the packed row order)."""
    n, hkv, g, bq = x.shape[:4]
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape(n * bq, hkv * g, *x.shape[4:])


def _heads_first(x, plan):
    """[Tq, Hq, ...] -> [n, Hkv, G, bq, ...], padded: the inverse of _heads_last."""
    c = plan.config
    x = _query_blocks(plan, x)  # [n, bq, Hq, ...]
    x = x.reshape(*x.shape[:2], c.num_heads_kv, c.group_size, *x.shape[3:])
    return jnp.moveaxis(x, 1, 3)


def _query_bands(plan: _Plan, bands: _Bands):
    """Per query block: the bands of its rows [n, bq] (padding rows empty), its range's first key row and
    how many key tiles cover the range."""
    c = plan.config
    rows = _ceil_div(c.capacity_q, plan.block_q) * plan.block_q
    first = _pad(bands.first, rows, c.capacity_kv).reshape(-1, plan.block_q)
    last = _pad(bands.last, rows, -1).reshape(-1, plan.block_q)
    low, steps = _steps(first, last, plan.block_q, plan.block_kv)
    return first, last, low, steps


def _key_tiles(plan, k_clean, v_clean, first, last, low):
    """For the passes whose lanes walk query blocks (the forward, dQ): read(block [lanes], tile r [lanes],
    valid [lanes]) -> (mask [lanes, 1, 1, bq, bk], k and v tiles [lanes, bk, Hkv, D]), the r-th key tile of
    each lane's block's range; a lane past the walk's total (valid False) gets an empty mask."""
    c, bk = plan.config, plan.block_kv
    # bk rows of padding: a tile starts before its range's end (< Tkv), so a slice never needs clamping.
    k_pad, v_pad = _pad(k_clean, c.capacity_kv + bk), _pad(v_clean, c.capacity_kv + bk)

    def read(block, r, valid):
        start = low[block] + r * bk
        cols = start[:, None] + jnp.arange(bk, dtype=jnp.int32)[None, :]
        mask = _tile_mask(jnp.where(valid[:, None], first[block], c.capacity_kv), last[block], cols)
        return mask, _rows(k_pad, start, bk), _rows(v_pad, start, bk)

    return read


def _merge_softmax(a, b):
    """Two online-softmax states (row max, row sum, weighted value sum) of one row's disjoint key sets as
    the state of their union; (_MASKED, 0, 0) is the neutral state."""
    (max_a, sum_a, acc_a), (max_b, sum_b, acc_b) = a, b
    new_max = jnp.maximum(max_a, max_b)
    scale_a, scale_b = jnp.exp(max_a - new_max), jnp.exp(max_b - new_max)
    return new_max, scale_a * sum_a + scale_b * sum_b, scale_a[..., None] * acc_a + scale_b[..., None] * acc_b


def _forward(plan: _Plan, q, k, v, sinks, bands: _Bands):
    """(out [Tq, Hq, Dv] float32, lse [Tq, Hq] float32 with 0 on rows without keys).

    The query blocks' key tiles are shared out among n lanes as the backward's (_walk): each lane keeps an
    online softmax over its run of one block's tiles (a segment), and each block merges its segments'
    states after the loop, so the forward costs the tiles each block needs, not blocks x the widest range."""
    c, bq = plan.config, plan.block_q
    first, last, low, steps = _query_bands(plan, bands)
    n = first.shape[0]
    row_shape = (c.num_heads_kv, c.group_size, bq)  # one block's state rows, as the tiles' matmuls lay them out
    q_tiles = _query_blocks(plan, _clean(q, bands.first <= bands.last, plan.operand))
    q_tiles = q_tiles.reshape(n, bq, c.num_heads_kv, c.group_size, c.head_dim_qk)
    # Keys need no such care: a masked score is replaced (jnp.where), never multiplied by 0. Values are.
    k_clean, v_clean = _clean(k, bands.key_valid, plan.operand), _finite(v, bands.key_valid, plan.operand)
    key_tile = _key_tiles(plan, k_clean, v_clean, first, last, low)

    def tile(block, r, valid, state, side):
        row_max, row_sum, acc = state
        mask, k_tile, v_tile = key_tile(block, r, valid)
        s = jnp.where(mask, _logits(plan, q_tiles[block], k_tile), _MASKED)
        new_max = jnp.maximum(row_max, s.max(axis=-1))
        # The where inside the exp: in a row that has seen no key yet, masked entries would give exp(0) = 1.
        p = jnp.exp(jnp.where(mask, s - new_max[..., None], _MASKED))
        correction = jnp.exp(row_max - new_max)
        row_sum = correction * row_sum + p.sum(axis=-1)
        acc = correction[..., None] * acc + _dot(plan, "nhgqk,nkhd->nhgqd", p, v_tile)
        return (new_max, row_sum, acc), side

    # float32 state whatever jax_enable_x64 says: jnp's default float would be float64 there.
    neutral = (
        jnp.full(row_shape, _MASKED, jnp.float32),
        jnp.zeros(row_shape, jnp.float32),
        jnp.zeros(row_shape + (c.head_dim_v,), jnp.float32),
    )
    (row_max, row_sum, acc), _ = _walk_fold(_walk(steps, n), n, tile, neutral, _merge_softmax)
    if sinks is not None:  # the sink is one more logit of every row, with weight exp(sink - max) and no value
        sink = sinks.astype(jnp.float32).reshape(1, c.num_heads_kv, c.group_size, 1)
        sink = jnp.broadcast_to(sink, row_max.shape)
        row_max, row_sum, acc = _merge_softmax(
            (row_max, row_sum, acc), (sink, jnp.ones_like(row_sum), jnp.zeros_like(acc))
        )
    shape = row_max.shape
    attends = jnp.broadcast_to((first <= last)[:, None, None, :], shape)
    # A row with a key has row_sum >= 1 (its largest logit contributes exp(0)); the others divide by 1.
    safe_sum = jnp.where(attends, row_sum, 1.0)
    out = jnp.where(attends[..., None], acc / safe_sum[..., None], 0.0)
    lse = jnp.where(attends, row_max + jnp.log(safe_sum), 0.0)
    out = _heads_last(out)[: c.capacity_q]
    return _poison_value_bands(out, v, bands, c), _heads_last(lse)[: c.capacity_q]


def _poison_value_bands(out, v, bands: _Bands, c: AttentionConfig):
    """out [Tq, Hq, Dv] with NaN in each (row, head) whose band holds a value row with a non-finite entry in
    that head's kv head: counted with a prefix sum over the key rows, since a band is an interval."""
    bad = (bands.key_valid[:, None] & ~jnp.all(jnp.isfinite(v), axis=-1)).astype(jnp.int32)  # [Tkv, Hkv]
    before = jnp.concatenate([jnp.zeros((1, c.num_heads_kv), jnp.int32), jnp.cumsum(bad, axis=0)])
    first = jnp.clip(bands.first, 0, c.capacity_kv)
    after_last = jnp.clip(bands.last + 1, 0, c.capacity_kv)
    reached = (bands.first <= bands.last)[:, None] & (before[after_last] - before[first] > 0)  # [Tq, Hkv]
    reached = jnp.repeat(reached, c.group_size, axis=1)  # query heads are grouped by kv head
    return jnp.where(reached[..., None], jnp.nan, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: _Plan, q, k, v, sinks, bands: _Bands):
    out, lse = _forward(plan, q, k, v, sinks, bands)
    return out.astype(q.dtype), lse


def _attention_fwd(plan, q, k, v, sinks, bands):
    out, lse = named_residuals(*_forward(plan, q, k, v, sinks, bands))
    return (out.astype(q.dtype), lse), (q, k, v, sinks, bands, out, lse)


def _attention_bwd(plan: _Plan, residuals, cotangents):
    c = plan.config
    xla_memory.check_working_set(c, plan.block_q, plan.block_kv, "backward", plan.memory_limit)
    q, k, v, sinks, bands, out, lse = residuals
    d_out, d_lse = cotangents
    attends = bands.first <= bands.last
    attended = bands.key_first <= bands.key_last
    # A sequence with a non-finite input, cotangent or saved output gets NaN in all its gradient rows; the
    # tiles see 0 in place of each such entry, so no other sequence's rows do (the module docstring).
    # Cotangents of rows without keys are ignored (they may hold anything, NaN included).
    bad_q = (
        _nonfinite_rows(q, attends)
        | _nonfinite_rows(d_out, attends)
        | _nonfinite_rows(out, attends)
        | _nonfinite_rows(d_lse, attends)
        | _nonfinite_rows(lse, attends)
    )
    bad_kv = _nonfinite_rows(k, bands.key_valid) | _nonfinite_rows(v, bands.key_valid)
    bad_seq = jnp.zeros(c.num_seqs, bool).at[bands.seq_q].max(bad_q).at[bands.seq_kv].max(bad_kv)
    d_out = _finite(d_out, attends)
    d_lse = _finite(d_lse, attends)
    out, lse = _finite(out, attends), _finite(lse, attends)
    # dS = P * (dP - delta) with delta = rowsum(dO * O) - d_lse: the stats cotangent enters here only,
    # since d lse_i / d s_ij = p_ij.
    delta = jnp.sum(d_out * out, axis=-1) - d_lse  # [Tq, Hq]
    # The tiles' operands in the matmul dtype (float32, or the bfloat16 / float16 inputs' own).
    d_out = d_out.astype(plan.operand)
    q_clean = _finite(q, attends, plan.operand)
    k_clean = _finite(k, bands.key_valid, plan.operand)
    v_clean = _finite(v, bands.key_valid, plan.operand)

    if xla_memory.fused_backward(c):
        d_k, d_v, d_q = _dkv_pass(plan, q_clean, k_clean, v_clean, d_out, lse, delta, bands, with_dq=True)
    else:
        d_q = _dq_pass(plan, q_clean, k_clean, v_clean, d_out, lse, delta, bands)
        d_k, d_v = _dkv_pass(plan, q_clean, k_clean, v_clean, d_out, lse, delta, bands)
    d_sinks = None
    if sinks is not None:
        # The sink is a logit without a value: d sink = sum_i p_sink,i * (d_lse_i - rowsum(dO * O)_i).
        logit = jnp.where(attends[:, None], sinks.astype(jnp.float32)[None, :] - lse, _MASKED)
        d_sinks = -jnp.sum(jnp.exp(logit) * delta, axis=0)
        d_sinks = jnp.where(jnp.any(bad_seq), jnp.nan, d_sinks).astype(sinks.dtype)  # every sequence reaches it
    d_q = _poison(d_q, attends & bad_seq[bands.seq_q])
    d_k, d_v = (_poison(x, attended & bad_seq[bands.seq_kv]) for x in (d_k, d_v))
    return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_sinks, jax.tree.map(lambda _: None, bands))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _reference(plan: _Plan, q, k, v, sinks, bands: _Bands):
    """_attention in plain jnp, for forward mode: its backward is plain jnp too, and differentiates as it is."""
    out, lse = _forward(plan, q, k, v, sinks, bands)
    return out.astype(q.dtype), lse


# The residuals begin with the arguments themselves.
_attention = forward_mode(_attention, _reference, second_order=False, primals_from=lambda plan, saved: saved[:5])


class _Walk(NamedTuple):
    """A balanced walk over blocks that need different numbers of tiles (steps [n] int32).

    The blocks' tiles, listed block after block, are cut into `lanes` runs of `per_lane` consecutive tiles;
    a loop step advances every lane by one tile. The work is the total number of tiles (+ at most `lanes`),
    not blocks * the largest count: causal blocks need from one tile to a whole sequence's worth.
    A lane's run of one block's tiles is a segment; segment (lane l, block b) is kept in slot l + b, which is
    unique since along the list l and b never decrease and one of them grows at every new segment. Block b's
    segments are slots base[b] .. base[b] + num_slots[b] - 1, summed in order after the loop: a fixed order,
    whatever the data, so the result is deterministic and nothing is scattered with an add.
    """

    steps: jax.Array  # [n] tiles per block
    starts: jax.Array  # [n] where each block's tiles begin in the list
    per_lane: jax.Array  # scalar: tiles per lane, ceil(total / lanes)
    total: jax.Array  # scalar: tiles in all
    base: jax.Array  # [n] block b's first slot
    num_slots: jax.Array  # [n] block b's slots (`count` would hide tuple.count)


def _walk(steps, lanes: int) -> _Walk:
    ends = jnp.cumsum(steps)
    starts, total = ends - steps, ends[-1]
    per_lane = jnp.maximum(_ceil_div(total, lanes), 1)
    first_lane, last_lane = starts // per_lane, (ends - 1) // per_lane
    count = jnp.where(steps > 0, last_lane - first_lane + 1, 0)
    return _Walk(steps, starts, per_lane, total, first_lane + jnp.arange(steps.shape[0], dtype=steps.dtype), count)


def _walk_loop(walk: _Walk, lanes: int, tile_fn, acc_shapes, side=None):
    """Runs tile_fn(block [lanes], tile r [lanes], valid [lanes]) -> per-lane contributions shaped like
    acc_shapes ([lanes, ...] each) over the walk; returns per block the sum of its tiles' contributions
    ([n, ...] each). Lanes past the total (valid False) must contribute zeros. With `side` (an array),
    tile_fn(block, r, valid, side) returns (contributions, side) and the loop returns (sums, side)."""

    def add(block, r, valid, acc, side):
        if side is None:
            return tuple(a + x for a, x in zip(acc, tile_fn(block, r, valid))), None
        contributions, side = tile_fn(block, r, valid, side)
        return tuple(a + x for a, x in zip(acc, contributions)), side

    neutral = tuple(jnp.zeros(s[1:], jnp.float32) for s in acc_shapes)
    sums, side = _walk_fold(walk, lanes, add, neutral, lambda a, b: tuple(x + y for x, y in zip(a, b)), side)
    return sums if side is None else (sums, side)


def _walk_fold(walk: _Walk, lanes: int, update, neutral, merge, side=None):
    """The walk's loop: update(block [lanes], tile r [lanes], valid [lanes], state, side) -> (state, side)
    takes every lane's state (a tuple of [lanes, ...] arrays) over one more tile; `neutral` is the state
    before any tile (one lane's: a tuple of [...] arrays), which a lane past the total (valid False) must
    keep; merge(a, b) combines the states of two segments of one block (associative, `neutral` its neutral
    element). Returns (per block the merge of its segments' states, [n, ...] each; side)."""
    n = walk.steps.shape[0]
    lane = jnp.arange(lanes, dtype=jnp.int32)
    # The next block with tiles after each block (n when none): a lane moving on skips empty blocks.
    has = jnp.where(walk.steps > 0, jnp.arange(n, dtype=jnp.int32), n)
    following = jnp.append(lax.cummin(has, reverse=True)[1:], n).astype(jnp.int32)
    t0 = lane * walk.per_lane
    block0 = jnp.minimum(jnp.searchsorted(walk.starts + walk.steps, t0, side="right"), n - 1).astype(jnp.int32)
    r0 = t0 - walk.starts[block0]

    def spread(count):  # the neutral state for `count` lanes, slots or blocks
        return tuple(jnp.broadcast_to(x, (count,) + x.shape) for x in neutral)

    def per_lane(mask, x):  # [count] -> broadcastable against x
        return mask.reshape(mask.shape + (1,) * (x.ndim - 1))

    def step(s, carry):
        block, r, state, slots, side = carry
        valid = lane * walk.per_lane + s < walk.total
        state, side = update(jnp.minimum(block, n - 1), r, valid, state, side)
        ends_block = r == walk.steps[jnp.minimum(block, n - 1)] - 1
        flush = valid & (ends_block | (s == walk.per_lane - 1))
        index = jnp.where(flush, lane + block, lanes + n)  # out of range: dropped
        slots = tuple(x.at[index].set(a, mode="drop") for x, a in zip(slots, state))
        state = tuple(jnp.where(per_lane(flush, a), e, a) for a, e in zip(state, neutral))
        block = jnp.where(ends_block, following[jnp.minimum(block, n - 1)], block)
        return block, jnp.where(ends_block, 0, r + 1), state, slots, side

    _, _, _, slots, side = lax.fori_loop(
        0, jnp.where(walk.total > 0, walk.per_lane, 0), step, (block0, r0, spread(lanes), spread(lanes + n), side)
    )

    def gather(j, out):
        index = jnp.minimum(walk.base + j, lanes + n - 1)
        taken = j < walk.num_slots
        return merge(out, tuple(jnp.where(per_lane(taken, x), x[index], e) for x, e in zip(slots, neutral)))

    merged = lax.fori_loop(0, walk.num_slots.max(initial=0), gather, spread(n))
    return merged, side


def _rows(x, start, size: int):
    """[len(start), size, ...]: rows start[i] .. start[i] + size - 1 of x, contiguous slices (x is padded so
    that none is clamped)."""
    return jax.vmap(lambda s: lax.dynamic_slice_in_dim(x, s, size))(start)


def _dq_pass(plan, q_clean, k_clean, v_clean, d_out, lse, delta, bands):
    """dQ: every query block's key range, tile by tile, recomputing P from lse; the tiles of all blocks are
    shared out evenly among n lanes (_walk), so a block pays for its own range, not the widest one."""
    c, bq = plan.config, plan.block_q
    n = _ceil_div(c.capacity_q, bq)
    split = (n, bq, c.num_heads_kv, c.group_size)
    q_tiles = _query_blocks(plan, q_clean).reshape(*split, c.head_dim_qk)
    do_tiles = _query_blocks(plan, d_out).reshape(*split, c.head_dim_v)
    lse_tiles, delta_tiles = _heads_first(lse, plan), _heads_first(delta, plan)  # [n, Hkv, G, bq]
    first, last, low, steps = _query_bands(plan, bands)
    key_tile = _key_tiles(plan, k_clean, v_clean, first, last, low)
    walk = _walk(steps, n)

    def tile(block, r, valid):
        mask, k_tile, v_tile = key_tile(block, r, valid)
        q_tile = q_tiles[block]
        logits = _logits(plan, q_tile, k_tile)
        p = jnp.exp(jnp.where(mask, logits - lse_tiles[block][..., None], _MASKED))
        dp = _dot(plan, "nqhgd,nkhd->nhgqk", do_tiles[block], v_tile)
        ds = _uncapped_ds(plan, p * (dp - delta_tiles[block][..., None]), logits)
        return (_dot(plan, "nhgqk,nkhd->nqhgd", ds, k_tile),)

    (d_q,) = _walk_loop(walk, n, tile, [q_tiles.shape])
    return (d_q * c.scale).reshape(n * bq, c.num_heads_q, c.head_dim_qk)[: c.capacity_q]


def _dkv_pass(plan, q_clean, k_clean, v_clean, d_out, lse, delta, bands, with_dq: bool = False):
    """dK, dV: every key block's query range (the rows that attend it), block_q rows a tile, balanced over
    n lanes as the dQ pass. A tile's rows are contiguous: slices of q, dO, lse, delta and the bands.
    with_dq: also dQ, each tile's dS.K added into the rows it covers (the fused backward): returns
    (dK, dV, dQ)."""
    c = plan.config
    bq, bk, tq = plan.block_q, plan.block_kv, c.capacity_q
    n = _ceil_div(c.capacity_kv, bk)
    k_tiles = _pad(k_clean, n * bk).reshape(n, bk, c.num_heads_kv, c.head_dim_qk)
    v_tiles = _pad(v_clean, n * bk).reshape(n, bk, c.num_heads_kv, c.head_dim_v)
    cols = jnp.arange(n * bk, dtype=jnp.int32).reshape(n, bk)  # these keys' own rows
    key_first = _pad(bands.key_first, n * bk, tq).reshape(n, bk)
    key_last = _pad(bands.key_last, n * bk, -1).reshape(n, bk)
    low, steps = _steps(key_first, key_last, bk, bq)
    # bq rows of padding, as in the dQ pass; padded rows attend nothing (first > last), so they are masked.
    rows = tq + bq
    q_pad = _pad(q_clean, rows).reshape(rows, c.num_heads_kv, c.group_size, -1)
    do_pad = _pad(d_out, rows).reshape(rows, c.num_heads_kv, c.group_size, -1)
    # lse and delta with the rows last ([Hkv, G, rows]): a slice of them is already a tile's [.., bq] layout.
    lse_pad = jnp.moveaxis(_pad(lse, rows).reshape(rows, c.num_heads_kv, c.group_size), 0, -1)
    delta_pad = jnp.moveaxis(_pad(delta, rows).reshape(rows, c.num_heads_kv, c.group_size), 0, -1)
    first_pad, last_pad = _pad(bands.first, rows, c.capacity_kv), _pad(bands.last, rows, -1)
    walk = _walk(steps, n)

    def tile(block, r, valid):
        start = low[block] + r * bq
        q_tile, do_tile = _rows(q_pad, start, bq), _rows(do_pad, start, bq)  # [lanes, bq, Hkv, G, D]
        lse_tile = jax.vmap(lambda s: lax.dynamic_slice_in_dim(lse_pad, s, bq, axis=2))(start)
        delta_tile = jax.vmap(lambda s: lax.dynamic_slice_in_dim(delta_pad, s, bq, axis=2))(start)
        first = jnp.where(valid[:, None], _rows(first_pad, start, bq), c.capacity_kv)
        mask = _tile_mask(first, _rows(last_pad, start, bq), cols[block])
        k_tile, v_tile = k_tiles[block], v_tiles[block]
        logits = _logits(plan, q_tile, k_tile)
        p = jnp.exp(jnp.where(mask, logits - lse_tile[..., None], _MASKED))
        dp = _dot(plan, "nqhgd,nkhd->nhgqk", do_tile, v_tile)
        ds = _uncapped_ds(plan, p * (dp - delta_tile[..., None]), logits)
        sums = (_dot(plan, "nhgqk,nqhgd->nkhd", ds, q_tile), _dot(plan, "nhgqk,nqhgd->nkhd", p, do_tile))
        return sums, ds, start, k_tile

    def fused_tile(block, r, valid, d_q):
        sums, ds, start, k_tile = tile(block, r, valid)
        # Lanes whose query tiles overlap add into the same rows: a scatter-add of one [bq, Hkv, G, D] window
        # per lane (a lane past the total has ds = 0, as every masked entry).
        part = _dot(plan, "nhgqk,nkhd->nqhgd", ds, k_tile)
        numbers = lax.ScatterDimensionNumbers(
            update_window_dims=(1, 2, 3, 4), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
        )
        return sums, lax.scatter_add(d_q, start[:, None], part, numbers, mode=lax.GatherScatterMode.CLIP)

    if with_dq:
        (d_k, d_v), d_q = _walk_loop(
            walk,
            n,
            fused_tile,
            [k_tiles.shape, v_tiles.shape],
            side=jnp.zeros((rows, c.num_heads_kv, c.group_size, c.head_dim_qk), jnp.float32),
        )
    else:
        d_k, d_v = _walk_loop(walk, n, lambda *args: tile(*args)[0], [k_tiles.shape, v_tiles.shape])
    d_k = (d_k * c.scale).reshape(n * bk, c.num_heads_kv, -1)[: c.capacity_kv]
    d_v = d_v.reshape(n * bk, c.num_heads_kv, -1)[: c.capacity_kv]
    if not with_dq:
        return d_k, d_v
    return d_k, d_v, (d_q * c.scale).reshape(rows, c.num_heads_q, c.head_dim_qk)[: c.capacity_q]


# ---- the backend surface (backends/__init__.py) ------------------------------------------------------------

NAME = "xla"


def unsupported_reason(config: AttentionConfig) -> str | None:
    """The portable path serves every call (its working-set bound raises at trace time, naming the fix)."""
    return None


def attend(buffers, index, config: AttentionConfig, *, stats=True):
    """(out, stats) of the parts sliced out of packed buffers; autodiff assembles their gradients."""
    from jax_ragged_attn.index.packings import TABLE

    return attention_xla(
        *TABLE[config.packing].split(buffers),
        index.cu_seqlens_q,
        index.cu_seqlens_kv,
        config,
        return_stats=stats,
        seqused_q=index.seqused_q,
        seqused_kv=index.seqused_kv,
    )
