"""Attention over rows packed with segment ids (the MaxText / Flax packing convention), on the THD op.

Inputs are q [R, S, Hq, D], k [R, S, Hkv, D], v [R, S, Hkv, Dv] and segment_ids [R, S]: a positive id
marks the tokens of one packed sequence, 0 (or any id <= 0) marks padding. A segment is a maximal run of
equal positive ids within one row, so ids may repeat across rows, and a run of one id that a row boundary,
a padding run or another id interrupts is two segments. (MaxText's and Flax's own masks compare ids, so
they join equal ids that a different id separates within one row; their packers never emit such rows.)

How it maps onto `ragged_attention`: compaction. The real tokens are gathered, in row-major order, to the
front of one [R * S] token buffer; the padding tokens (and tokens of segments past max_segments) follow
them, past cu_seqlens[-1], where the THD op treats them as capacity padding; the results are gathered back:

    segment_ids = [[1, 1, 0, 2],          flattened tokens  0  1  2  3  4  5  6  7
                   [2, 0, 0, 2]]          segment           a  a  -  b  c  -  -  d
    gather_index  = [0, 1, 3, 4, 7, 2, 5, 6]   compacted row j reads token gather_index[j]
    scatter_index = [0, 1, 5, 2, 3, 6, 7, 4]   token t's result sits in compacted row scatter_index[t]
    cu_seqlens    = [0, 2, 3, 4, 5]            a = rows 0:2, b = 2:3, c = 3:4, d = 4:5; rows 5: are padding

Why compaction rather than a zero-length slot per padding run: cu_seqlens describe contiguous runs, so a
padding run left in place would need a sequence slot of its own, be attended like a sequence (wasted work,
O(L^2) per run on cuDNN and a whole [max_seqlen, max_seqlen] tile on the xla path) and need its inputs and
results masked by hand. Compacted padding is the THD op's own capacity padding, which it already
guarantees: out exactly 0, stats -inf, gradients exactly 0, and NaN or Inf there never read. max_segments
counts real segments only. The price is one gather of q, k, v and one of out and stats (and their
transposes, scatter-adds of a permutation, in the backward): O(R * S * H * D) memory traffic.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.features import checks
from jax_ragged_attn.ops.ragged import attend


class SegmentLayout(NamedTuple):
    """Where each token of [R, S] segment-id rows goes in the compacted THD buffer; see the module docstring."""

    cu_seqlens: jax.Array  # [max_segments + 1] int32 over the compacted [R * S] token axis
    gather_index: jax.Array  # [R * S] int32: compacted row j reads flattened token gather_index[j]
    scatter_index: jax.Array  # [R * S] int32: flattened token t sits in compacted row scatter_index[t]
    valid: jax.Array  # [R, S] bool: the token belongs to one of the first max_segments segments
    num_segments: jax.Array  # int32 scalar: segments found, which may exceed max_segments


def segments_to_cu_seqlens(segment_ids: jax.Array, *, max_segments: int) -> SegmentLayout:
    """Converts segment_ids [R, S] into THD cu_seqlens over the compacted token buffer; jit-traceable.

    Segments are numbered in row-major order. Segment b (b < max_segments) owns compacted rows
    cu_seqlens[b]:cu_seqlens[b + 1]; when there are fewer segments, the trailing entries repeat the last
    offset (zero-length sequences). Segments past max_segments are dropped: their tokens are treated like
    padding (valid False, placed past cu_seqlens[-1]); num_segments reports how many there were, so a
    caller can detect the overflow. All indices stay within [0, R * S) whatever the ids are.

    Budget: R times the most segments a row holds (what a packer bounds) suffices; R * S always does.
    """
    _check_segment_ids(segment_ids)
    max_segments = _static_int(max_segments, "max_segments")
    rows, seq = segment_ids.shape
    ids = segment_ids.reshape(-1)
    tokens = ids.shape[0]
    real = ids > 0
    # A segment starts at a real token that opens a row or differs from its left neighbour. Within one
    # row [1, 1, 2, 0, 2] has starts [T, F, T, F, T]; across rows [[.., 1], [1, ..]] the row start splits.
    first_in_row = jnp.arange(tokens, dtype=jnp.int32) % seq == 0
    previous = jnp.concatenate([ids[:1], ids[:-1]])
    starts = real & (first_in_row | (ids != previous))
    segment = jnp.cumsum(starts, dtype=jnp.int32) - 1  # for real tokens: the index of their segment
    kept = real & (segment < max_segments)

    # Kept tokens first, in their order, then all the others, in theirs: a permutation of the tokens.
    num_kept = jnp.sum(kept, dtype=jnp.int32)
    scatter_index = jnp.where(
        kept, jnp.cumsum(kept, dtype=jnp.int32) - 1, num_kept + jnp.cumsum(~kept, dtype=jnp.int32) - 1
    )
    gather_index = jnp.zeros(tokens, jnp.int32).at[scatter_index].set(jnp.arange(tokens, dtype=jnp.int32))

    # lengths[b + 1] = kept tokens of segment b; index max_segments + 1 (not kept) is out of range: dropped.
    slot = jnp.where(kept, segment + 1, max_segments + 1)
    lengths = jnp.zeros(max_segments + 1, jnp.int32).at[slot].add(1, mode="drop")
    return SegmentLayout(
        cu_seqlens=jnp.cumsum(lengths, dtype=jnp.int32),
        gather_index=gather_index,
        scatter_index=scatter_index,
        valid=kept.reshape(rows, seq),
        num_segments=jnp.sum(starts, dtype=jnp.int32),
    )


def ragged_attention_segments(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    max_segments: int,
    max_seqlen: int | None = None,
    check: bool | None = None,
    return_overflow: bool = False,
    **kwargs,
):
    """Attention within each segment of segment-id rows, through `ragged_attention` on the compacted tokens.

    Args:
      q: [R, S, Hq, Dqk]; k: [R, S, Hkv, Dqk]; v: [R, S, Hkv, Dv].
      segment_ids: integer [R, S]; a segment is a maximal run of one positive id within a row; ids <= 0
        are padding. Queries of a segment attend to the keys of the same segment only.
      max_segments: static bound on the number of segments in the whole batch (real segments only; padding
        needs no slot). Segments past it, counted in row-major order, are treated as padding (counted in
        the overflow's dropped_segments; check=True raises instead).
      max_seqlen: static bound on a segment's length, default S (always enough). A longer segment's tokens
        read NaN, as a longer sequence's rows do in `ragged_attention` (counted in truncated_rows_q/kv;
        check=True raises instead).
      check: as in `ragged_attention`, plus: more segments than max_segments, or a segment longer than
        max_seqlen, raises checks.RaggedAttentionInputError naming segment_ids' row and token, the count
        and the bound. None reads JAX_RAGGED_ATTN_CHECK. Off, NumPy segment_ids that will lose segments or
        tokens raise a RaggedAttentionInputWarning when traced (device arrays cost nothing: not read).
      return_overflow: also return an overflow.Overflow of int32 scalars: dropped_segments, and
        truncated_rows_q = truncated_rows_kv (tokens cut by max_seqlen); invalid_cu_seqlens is always 0.
      **kwargs: any other keyword of `ragged_attention` (scale, is_causal, diagonal_alignment,
        local_window_size, stats_layout, return_stats, implementation, deterministic, autotune, strategy,
        sinks, softcap). Positions for causal masks and windows count from each segment's first token; a segment's
        queries and keys are the same tokens, so the two diagonal alignments coincide.

    Returns:
      out [R, S, Hq, Dv] in q's dtype, or (out, stats) with return_stats=True: stats float32 [Hq, R, S] for
      stats_layout="head_major" (the default), [R, S, Hq] for "token_major". Padding tokens and tokens of
      dropped segments read out = 0 and stats = -inf, their gradients are exactly 0, and NaN or Inf in
      them never reaches any other result. With return_overflow=True the Overflow comes last: (out,
      overflow) or (out, stats, overflow).
    """
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"):
        if name in kwargs:
            raise ValueError(
                f"ragged_attention_segments derives {name} from segment_ids and max_seqlen; got {name}={kwargs[name]!r}"
            )
    options, rest = AttentionOptions.split({**kwargs, "check": check})
    sinks = rest.pop("sinks", None)
    if rest:
        raise TypeError(f"ragged_attention_segments got unexpected keyword arguments {sorted(rest)}")
    _check_segment_ids(segment_ids)
    rows, seq = segment_ids.shape
    for name, x, layout in (("q", q, "[R, S, Hq, Dqk]"), ("k", k, "[R, S, Hkv, Dqk]"), ("v", v, "[R, S, Hkv, Dv]")):
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != 4 or shape[:2] != (rows, seq):
            raise ValueError(
                f"{name} must be {layout} with [R, S] = segment_ids.shape {(rows, seq)}, got shape {shape}"
            )
    max_seqlen = seq if max_seqlen is None else _static_int(max_seqlen, "max_seqlen")
    max_segments = _static_int(max_segments, "max_segments")
    if not isinstance(return_overflow, bool):
        raise ValueError(f"return_overflow must be a Python bool, got {type(return_overflow).__name__}")
    if checks.check_enabled(options.check):
        # The layout is computed from the checked ids, so nothing downstream runs on ids that fail.
        segment_ids = checks.checked_segment_ids(segment_ids, max_segments=max_segments, max_seqlen=max_seqlen)
    else:
        checks.warn_segment_ids_on_host(segment_ids, max_segments=max_segments, max_seqlen=max_seqlen)

    layout = segments_to_cu_seqlens(segment_ids, max_segments=max_segments)

    def compact(x):
        return x.reshape(rows * seq, *x.shape[2:])[layout.gather_index]

    out, *rest = attend(
        (compact(q), compact(k), compact(v)),
        layout.cu_seqlens,
        layout.cu_seqlens,
        options,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        sinks=sinks,
        return_overflow=True,
    )
    result = (out[layout.scatter_index].reshape(rows, seq, *out.shape[1:]),)
    if options.return_stats:
        stats = rest[0]
        if options.stats_layout == "head_major":
            stats = stats[:, layout.scatter_index].reshape(-1, rows, seq)  # [Hq, T] -> [Hq, R, S]
        else:
            stats = stats[layout.scatter_index].reshape(rows, seq, -1)  # [T, Hq] -> [R, S, Hq]
        result += (stats,)
    if return_overflow:
        dropped = jnp.maximum(layout.num_segments - max_segments, 0).astype(jnp.int32)
        result += (rest[-1]._replace(dropped_segments=jax.lax.stop_gradient(dropped)),)
    return result if len(result) > 1 else result[0]


def _check_segment_ids(segment_ids) -> None:
    shape = getattr(segment_ids, "shape", None)
    dtype = getattr(segment_ids, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"segment_ids must be an integer array [R, S], got {type(segment_ids).__name__}")
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"segment_ids must be an integer array [R, S] with R, S >= 1, got shape {tuple(shape)}")
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"segment_ids must have an integer dtype, got {dtype}")


def _static_int(value, name: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be a static Python int (it fixes a shape), got {type(value).__name__} "
            f"{value!r}; pass it outside jax.jit or mark it static"
        ) from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)
