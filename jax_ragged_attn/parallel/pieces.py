"""A chunk of packed query rows, spelled as sequences the ragged op takes: pieces and slots.

Context parallelism (context_parallel.py) gives each device contiguous chunks of the natural packed order. A
chunk of rows [s, s + C) cuts each sequence into at most one contiguous run of its queries, a *piece*:
positions [a, c) of its sequence, with the keys causal attention needs ([0, c), or the whole sequence without
a mask). `chunk_pieces` finds them; `pieces_cu_seqlens` spells them as a plain prefix sum (3B + 1 sequences,
gaps included); `two_chunk_slots` spells a device's two chunks' pieces as B + 1 slots for one call with
explicit offsets and seqused. Everything here is traced JAX on int32 [B] arrays: no data leaves the device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Pieces(NamedTuple):
    """Per sequence b of the packing (int32 [B] each): the run of its queries in one chunk, and its keys.

    Queries: local rows q_start[b] .. q_start[b] + q_len[b] - 1 of the chunk (q_len 0: none in it). Keys:
    rows kv_start[b] .. kv_start[b] + kv_len[b] - 1 of the gathered, natural-order K/V. Both ranges ascend
    with b and never overlap (FlashAttention's cu_seqlens + seqused, with gaps).
    """

    q_start: jax.Array
    q_len: jax.Array
    kv_start: jax.Array
    kv_len: jax.Array


def chunk_pieces(
    cu_seqlens, chunk_start, chunk_rows: int, *, max_seqlen: int, is_causal: bool, window_left: int | None = None
) -> Pieces:
    """The pieces of the chunk of rows [chunk_start, chunk_start + chunk_rows) (chunk_start may be traced).

    cu_seqlens: int32 [B + 1] in the natural order, already sanitised into the buffer. A sequence longer
    than max_seqlen keeps its first max_seqlen rows (the rest are padding, as in ragged_attention).
    is_causal: keys up to each piece's last query (bottom-right aligned); window_left (causal only) also
    drops keys more than window_left left of the diagonal. Otherwise every key of the sequence.
    """
    start = cu_seqlens[:-1]
    length = jnp.minimum(cu_seqlens[1:] - start, max_seqlen)
    first = jnp.clip(start - chunk_start, 0, chunk_rows)
    end = jnp.clip(start + length - chunk_start, 0, chunk_rows)
    q_len = end - first
    a = first + chunk_start - start  # the piece's first query's position in its sequence (if it has one)
    if is_causal:
        low = jnp.zeros_like(a) if window_left is None else jnp.maximum(a - window_left, 0)
        high = a + q_len
    else:
        low, high = jnp.zeros_like(a), length
    has = q_len > 0
    # A sequence without queries here gets an empty key range at its own start: ranges stay ascending.
    kv_start = start + jnp.where(has, low, 0)
    kv_len = jnp.where(has, high - low, 0)
    return Pieces(*(x.astype(jnp.int32) for x in (first, q_len, kv_start, kv_len)))


def pieces_cu_seqlens(pieces: Pieces) -> tuple[jax.Array, jax.Array]:
    """(cu_seqlens_q, cu_seqlens_kv), int32 [3B + 1]: the pieces as a prefix sum, each gap a sequence of its own.

    Sequence 3b holds the query rows between piece b - 1 and piece b and no keys (they read out 0), 3b + 1
    the key rows between them and no queries (they get dK = dV = 0), 3b + 2 the piece. With the pieces of
    context_parallel's module docstring ((q_start, q_len, kv_start, kv_len) = (0, 0, 0, 0), (0, 6, 5, 9),
    (6, 2, 14, 2)):
      lengths_q  = [0, 0, 0,  0, 0, 6,  0, 0, 2]    -> cu_q  = [0, 0, 0, 0, 0, 0, 6, 6, 6, 8]
      lengths_kv = [0, 0, 0,  0, 5, 9,  0, 0, 2]    -> cu_kv = [0, 0, 0, 0, 0, 5, 14, 14, 14, 16]
    """

    def gaps(start, length):
        end = start + length
        return start - jnp.concatenate([jnp.zeros((1,), end.dtype), end[:-1]])

    zeros = jnp.zeros_like(pieces.q_len)
    lengths_q = jnp.stack([gaps(pieces.q_start, pieces.q_len), zeros, pieces.q_len], axis=1).reshape(-1)
    lengths_kv = jnp.stack([zeros, gaps(pieces.kv_start, pieces.kv_len), pieces.kv_len], axis=1).reshape(-1)

    def cumulative(lengths):
        return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths).astype(jnp.int32)])

    return cumulative(lengths_q), cumulative(lengths_kv)


def two_chunk_slots(first: Pieces, second: Pieces) -> Pieces:
    """The pieces of a device's two chunks (each [B], in the call's rows) as B + 1 slots, not 2B.

    The chunks' pieces come from two runs of sequences: those reaching into the first chunk (b <= last, the
    last sequence with queries there) and those reaching into the second, which comes later in the natural
    order. Only sequence `last` can have pieces in both (it covers every row between them). Slot b <= last
    holds sequence b's first-chunk piece, slot last + 1 sequence last's second-chunk piece (empty if it has
    none), slot b + 1 > last + 1 sequence b's second-chunk piece: every offset ascends, and the kernels' grids
    over slots (FA3's dQ conversion and preprocessing, sized by slots x max_seqlen) are half the size.

        first chunk:  sequences 0, 1, 2 have pieces (last = 2);  second chunk: sequences 2, 3
        slots: [first 0, first 1, first 2, second 2, second 3, second 4 (empty), ...]
    """
    num = first.q_len.shape[0]
    index = jnp.arange(num, dtype=jnp.int32)
    last = jnp.max(jnp.where(first.q_len > 0, index, -1))
    slot = jnp.arange(num + 1, dtype=jnp.int32)
    from_first = slot <= last
    sequence = jnp.clip(jnp.where(from_first, slot, slot - 1), 0, num - 1)
    # With no piece in the first chunk (last = -1) slot 0 is an empty slot at the start of both buffers.
    empty_start = (slot == 0) & (last < 0)
    return Pieces(
        *(
            jnp.where(empty_start, 0, jnp.where(from_first, a[sequence], b[sequence])).astype(jnp.int32)
            for a, b in zip(first, second)
        )
    )
