"""Context parallelism: the packed token axis of self-attention split over the devices of a mesh axis.

The all-gather strategy (Llama 3, TransformerEngine): inside shard_map each device gathers every device's
K and V (an all-gather, whose transpose, a reduce-scatter, returns dK and dV to their owners)
and attends its own queries to the gathered rows with one call of the ragged op (over its one contiguous
chunk of rows, or its two with load_balance). Nothing else crosses devices: out, stats and dQ stay where the
queries are.

A contiguous chunk of rows [s, s + C) of the natural packed order cuts each sequence into at most one
contiguous run of its queries, a *piece*: positions [a, c) of its sequence. Causal attention of those
queries needs the sequence's keys [0, c) (a left window l trims them to [max(0, a - l), c)), and the
diagonal of the piece's query i is its position a + i: bottom-right alignment of a piece with c - a queries
and c keys (sq = c - a, skv = c - lo, d = i + skv - sq). Without a mask a piece's keys are the whole sequence.

    cu_seqlens = [0, 5, 14, 16], capacity 16, 2 devices (C = 8), device 1 holds rows 8..15, causal:
      piece 0: none (q_len 0)
      piece 1: queries rows 8..13 (local 0..5) at positions 3..8 of sequence 1, keys rows 5..13 (c = 9)
      piece 2: queries rows 14..15 (local 6..7) at positions 0..1 of sequence 2, keys rows 14..15

Pieces' key ranges leave gaps (rows 0..4 above), so they are not a prefix sum: a chunk's call spells them
as B sequences with explicit offsets, cu_seqlens the slots (each piece's first row up to the next piece's)
and seqused the pieces' lengths (`chunk_attention`; FlashAttention's seqused semantics, on every
implementation). Every piece but the chunk's first starts at its sequence's first token, so top-left causal
is its mask; the first may start inside its sequence and is the one bottom-right call (see
`chunk_attention`). Pieces and their spellings live in pieces.py, the key windows a chunk reads in
key_windows.py; this module holds the plan and the per-device calls.

Within one call no two pieces share key rows (they belong to different sequences), so the cuDNN backward,
which writes dK/dV per sequence, never overwrites one piece's gradient with another's. With
load_balance=True a device holds two chunks (r and 2n-1-r of 2n), run as one call over the two chunks' key
windows side by side (`device_chunks_attention`); the two windows' dK/dV add.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from jax_ragged_attn.index import sanitize_cu_seqlens
from jax_ragged_attn.parallel.key_windows import window_bounds, windows

# pieces_cu_seqlens is imported for the callers that reach it here, where it lived before pieces.py.
from jax_ragged_attn.parallel.pieces import Pieces, chunk_pieces, pieces_cu_seqlens, two_chunk_slots  # noqa: F401


def _chunk_order(n: int) -> list[int]:
    """The natural chunks (of 2n) in load-balanced order: device r holds chunks r and 2n-1-r.
    n = 2 -> [0, 3, 1, 2]."""
    from jax_ragged_attn.parallel.load_balance import dual_chunk_order  # (here, not at the top: keeps edits local)

    return dual_chunk_order(n)


def reorder_for_load_balance(x, n: int, axis: int = 0):
    """The dual-chunk order: the token axis cut into 2n chunks, device r's shard = chunks r and 2n-1-r.

    With causal attention the cost of a row grows with its position in its sequence; pairing an early
    chunk with a late one evens the devices' work. Apply it to q, k and v (and positions, targets, ...)
    before sharded_ragged_attention(..., load_balance=True); cu_seqlens keep describing the natural order.
    axis: the token axis (0 for q, k, v, out and token-major stats; 1 for head-major stats).

        n = 2, T = 8: rows [0 1 2 3 4 5 6 7] -> [0 1 6 7 2 3 4 5] (chunks 0, 3 | 1, 2)

    Any T that is a multiple of 2n, eager or under jit, differentiable. On an array split along `axis`
    over mesh axes of n devices (explicit axes, or a concrete array's NamedSharding) the devices swap
    half-shards with collective permutes and the result keeps the sharding; otherwise a local permutation
    of the chunks (load_balance.permute_chunks). jax_ragged_attn.inputs.data can emit batches already in this
    order (pack_documents(context_parallel_devices=n)).
    """
    from jax_ragged_attn.parallel.load_balance import permute_chunks

    return permute_chunks(x, n, axis, name="reorder_for_load_balance")


def restore_order(x, n: int, axis: int = 0):
    """The inverse of reorder_for_load_balance: the natural packed order back (n = 2, T = 8:
    [0 1 6 7 2 3 4 5] -> [0 1 2 3 4 5 6 7]), with the same sharding rules."""
    from jax_ragged_attn.parallel.load_balance import permute_chunks

    return permute_chunks(x, n, axis, inverse=True, name="restore_order")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static part of one context-parallel call."""

    token_axis: str | tuple[str, ...]
    devices: int  # n: the token axis's size
    load_balance: bool
    max_seqlen: int
    is_causal: bool  # after folding a (l, 0) window without is_causal into causal
    window_left: int | None
    stats_axis: int  # the token axis of stats: 0 token-major [T, H], 1 head-major [H, T]

    @property
    def chunks_per_device(self) -> int:
        return 2 if self.load_balance else 1


def device_attention(plan: Plan, attend, q, k, v, cu_seqlens):
    """The per-device body under shard_map: q, k, v are this device's rows; returns (out, stats or None).

    attend(q, k, v, cu_q, cu_kv, max_seqlen_q, max_seqlen_kv, *, seqused, diagonal_alignment) -> (out, stats or
    None) runs the op on one chunk (stats token-major [rows, H] or head-major [H, rows] as configured, or None).
    """
    n = plan.devices
    total = q.shape[0] * n
    cu = sanitize_cu_seqlens(cu_seqlens, total)

    # The gathered K and V are residuals of the op's backward, which reads them (as one device without context
    # parallelism holds all T rows of K and V too). A jax.checkpoint around the gather alone would not drop
    # them; one around the caller's whole layer re-gathers them in the backward instead.
    def gather(x):
        x = lax.all_gather(x, plan.token_axis, axis=0, tiled=True)
        return restore_order(x, n) if plan.load_balance else x

    k_all, v_all = gather(k), gather(v)
    return device_chunks_attention(plan, attend, q, k_all, v_all, cu, lax.axis_index(plan.token_axis))


def device_chunks_attention(plan: Plan, attend, q, k_all, v_all, cu, r):
    """Device r's queries (its chunk, or its two chunks r and 2n-1-r in that order) against the gathered,
    natural-order K/V: (out, stats or None) for its rows. Public so the one-GPU benchmark times exactly what
    a device runs (benchmarks/context_parallel.py).

    Two chunks run as one call where one call can spell them (no left window): each chunk's key window is
    cut from the gathered K/V and the two are concatenated, so the pieces of both chunks are B + 1 sequences
    (two_chunk_slots) with explicit offsets over disjoint key rows (a document that reaches both chunks
    appears in both windows, and the windows' backward adds the two copies' dK/dV). One call instead of two halves the
    launches and the per-call passes and gives the kernels twice the tiles to fill the GPU with; a device's
    share of short documents is a small call, where those matter (CP-c in docs/PERFORMANCE.md#context-parallel).
    """
    n, rows = plan.devices, q.shape[0] // plan.chunks_per_device
    chunk_ids = [r] if not plan.load_balance else [r, 2 * n - 1 - r]
    if len(chunk_ids) == 1 or plan.window_left is not None:
        parts = [
            chunk_attention(plan, attend, q[j * rows : (j + 1) * rows], k_all, v_all, cu, chunk * rows)
            for j, chunk in enumerate(chunk_ids)
        ]
        out = jnp.concatenate([o for o, _ in parts], axis=0)
        return out, None if parts[0][1] is None else jnp.concatenate([s for _, s in parts], axis=plan.stats_axis)
    slots, starts, size = two_chunk_call(plan, cu, r, rows, k_all.shape[0])
    ends = lambda x: jnp.full((1,), x, jnp.int32)
    cu_q = jnp.concatenate([slots.q_start, ends(2 * rows)])
    cu_kv = jnp.concatenate([slots.kv_start, ends(2 * size)])
    # Every piece but a chunk's first starts at its sequence's first token (as many keys as queries, where
    # bottom-right is top-left); each chunk's first may start inside its sequence: bottom-right is every
    # piece's mask (chunk_attention).
    return attend(
        q,
        windows(k_all, starts, size),
        windows(v_all, starts, size),
        cu_q,
        cu_kv,
        min(plan.max_seqlen, rows),
        plan.max_seqlen,
        seqused=(slots.q_len, slots.kv_len),
        diagonal_alignment="bottom_right" if plan.is_causal else "top_left",
    )


def two_chunk_call(plan: Plan, cu, r, rows: int, total: int):
    """(slots, window starts, window size) of device r's one call over its two chunks r and 2n-1-r, each of
    `rows` rows, against `total` gathered key rows: the B + 1 slots (two_chunk_slots) in the call's rows, chunk
    j's queries from j * rows and its key window's rows from j * size, and the first gathered row of each
    window."""
    parts, starts = [], []
    for j, chunk in enumerate((r, 2 * plan.devices - 1 - r)):
        pieces = chunk_pieces(cu, chunk * rows, rows, max_seqlen=plan.max_seqlen, is_causal=plan.is_causal)
        first, size = _window_bounds(plan, total, chunk * rows, rows)
        # Pieces without queries may start outside the window: clamped, they stay empty and ascending.
        parts.append(
            Pieces(
                j * rows + pieces.q_start,
                pieces.q_len,
                j * size + jnp.clip(pieces.kv_start - first, 0, size),
                pieces.kv_len,
            )
        )
        starts.append(first)
    return two_chunk_slots(*parts), tuple(starts), size


def chunk_attention(plan: Plan, attend, q_chunk, k_all, v_all, cu, chunk_start):
    """One chunk's queries (rows [chunk_start, chunk_start + rows) of the natural order) against the gathered
    K/V: the pieces as B sequences with explicit offsets (cu_seqlens the slots, seqused the pieces).

    Causal masks: every piece but the chunk's first starts at its sequence's first token, so its keys are
    exactly its queries' positions and top-left causal is its mask; only a first piece that starts inside its
    sequence (positions [a, c) with a > 0, keys [lo, c)) needs bottom-right alignment, which is therefore the
    alignment of the one call. cuDNN's bottom-right *backward* alone would cost sq x skv whatever the mask
    (1.2-1.7x top-left on identical masks); the cuDNN path splits it into a rectangle and a top-left square
    (backends/cudnn/launch.py _backward). With a left window that split does not apply, and the pieces run as two
    calls: all top-left pieces in one, the offset piece alone (a single sequence) in the other, each call's
    results exactly 0 / -inf in the other's rows. Public so the one-GPU benchmark times exactly
    what a device runs (benchmarks/context_parallel.py).
    """
    rows = q_chunk.shape[0]
    pieces = chunk_pieces(
        cu, chunk_start, rows, max_seqlen=plan.max_seqlen, is_causal=plan.is_causal, window_left=plan.window_left
    )
    k_all, v_all, kv_offset = key_window(plan, k_all, v_all, chunk_start, rows)
    total = k_all.shape[0]
    cu_q = jnp.concatenate([pieces.q_start, jnp.full((1,), rows, jnp.int32)])
    # Pieces without queries may start outside the window: clamped, they stay empty and ascending.
    cu_kv = jnp.concatenate([jnp.clip(pieces.kv_start - kv_offset, 0, total), jnp.full((1,), total, jnp.int32)])
    max_q = min(plan.max_seqlen, rows)
    if not plan.is_causal:  # no mask: alignment means nothing, one call
        return attend(
            q_chunk,
            k_all,
            v_all,
            cu_q,
            cu_kv,
            max_q,
            plan.max_seqlen,
            seqused=(pieces.q_len, pieces.kv_len),
            diagonal_alignment="top_left",
        )
    if plan.window_left is None:
        # One bottom-right call: every piece but the first has as many keys as queries (bottom-right is then
        # top-left), and the cuDNN path runs a causal bottom-right backward as rectangle + square
        # (backends/cudnn/launch.py _backward), so no piece pays for masked tiles.
        return attend(
            q_chunk,
            k_all,
            v_all,
            cu_q,
            cu_kv,
            max_q,
            plan.max_seqlen,
            seqused=(pieces.q_len, pieces.kv_len),
            diagonal_alignment="bottom_right",
        )
    # With a left window the backward is not split: a piece needs bottom-right alignment iff it has more keys
    # than queries (a > 0 and keys before it), so that one piece runs alone.
    offset = (pieces.q_len > 0) & (pieces.kv_len != pieces.q_len)
    zero = jnp.zeros_like(pieces.q_len)
    out, stats = attend(
        q_chunk,
        k_all,
        v_all,
        cu_q,
        cu_kv,
        max_q,
        plan.max_seqlen,
        seqused=(jnp.where(offset, zero, pieces.q_len), jnp.where(offset, zero, pieces.kv_len)),
        diagonal_alignment="top_left",
    )
    # The offset piece (at most one) as a single sequence: its slot from its first query / key to the end.
    b = jnp.argmax(offset)
    has = jnp.any(offset)
    one = lambda x: jnp.where(has, x[b], 0)[None]
    first_q, first_kv = jnp.where(has, pieces.q_start[b], 0), jnp.where(has, cu_kv[b], 0)  # in the window
    out_b, stats_b = attend(
        q_chunk,
        k_all,
        v_all,
        jnp.stack([first_q, jnp.full((), rows, jnp.int32)]),
        jnp.stack([first_kv, jnp.full((), total, jnp.int32)]),
        max_q,
        plan.max_seqlen,
        seqused=(one(pieces.q_len), one(pieces.kv_len)),
        diagonal_alignment="bottom_right",
    )
    local = jnp.arange(rows, dtype=jnp.int32)
    in_b = has & (local >= first_q) & (local < first_q + one(pieces.q_len)[0])
    out = jnp.where(in_b[:, None, None], out_b, out)
    if stats is not None:
        stats = jnp.where(in_b[:, None] if plan.stats_axis == 0 else in_b[None, :], stats_b, stats)
    return out, stats


def key_window(plan: Plan, k_all, v_all, chunk_start, rows: int):
    """(k, v, first row): the rows of the gathered K/V a chunk's queries can reach (key_windows.window_bounds),
    a static-size slice, or all of them where the window would be no smaller."""
    first, size = _window_bounds(plan, k_all.shape[0], chunk_start, rows)
    if size == k_all.shape[0]:
        return k_all, v_all, first
    return windows(k_all, (first,), size), windows(v_all, (first,), size), first


def _window_bounds(plan: Plan, total: int, chunk_start, rows: int):
    return window_bounds(total, chunk_start, rows, max_seqlen=plan.max_seqlen, is_causal=plan.is_causal)


def batch_tokens_per_sequence(total: int, num_seqs: int) -> int:
    """The whole batch's shape class, T / B tokens a sequence, that each device's call passes to
    implementation=None's choice (AttentionOptions.policy_tokens_per_sequence) in place of its own slots'."""
    return max(total // num_seqs, 1)


def effective_mask(is_causal: bool, window: tuple[int, int] | None) -> tuple[bool, int | None]:
    """(causal, left window) of a supported mask; NotImplementedError naming the reason otherwise.

    A window (l, 0) without is_causal is causal with a left window; causal ignores a window's right side.
    """
    if window is None:
        return is_causal, None
    left, right = window
    if is_causal or right == 0:
        return True, left
    raise NotImplementedError(
        f"local_window_size={window} without is_causal: context parallelism serves no mask, causal, or causal "
        "with a left window (l, 0). A window reaching right of the diagonal needs, for a run of queries that "
        "starts inside a sequence, keys on both sides of it, which a bottom-right aligned piece cannot express"
    )


def token_axis_size(mesh, token_axis) -> int:
    axes = (token_axis,) if isinstance(token_axis, str) else tuple(token_axis)
    return math.prod(mesh.shape[a] for a in axes)
