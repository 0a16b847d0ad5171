"""Context parallelism, the ring strategy: K/V blocks travel around the devices of the token axis.

sharded_ragged_attention(..., token_axis=..., context_strategy="ring"). Device r of the n on the token axis
keeps its own query rows (natural chunk r of n, or chunks r and 2n-1-r of 2n with load_balance=True) and
its own K/V shard. The shards travel one device along the ring per step (lax.ppermute r -> r + 1), so at
step s device r holds the shard of device (r - s) mod n; after n - 1 steps every query row has met every
key row. Each step attends the local queries to the visiting block with the op (ops.ragged.attend with stats,
so the same implementation - cuDNN or xla - serves the blocks as any other call), and the partial results
merge exactly by their log-sum-exp:

    L = logsumexp_s lse_s,   O = sum_s exp(lse_s - L) O_s

A row without keys in a block reads O_s = 0, lse_s = -inf there and weighs 0; a row without any key ends
with O = 0 and L = -inf, the op's documented semantics. Per device the memory is O(T / n): the local q, k,
v, the visiting block and the one in flight (the ppermute for step s + 1 is issued before step s computes,
so XLA can overlap the transfer with the attention), never the whole K/V that all_gather holds.

The gradient (a custom_vjp of the whole ring) rotates K/V again and recomputes each step's (O_s, lse_s)
with jax.vjp of the op rather than letting autodiff keep every visiting block. With w_s = exp(lse_s - L):

    dO_s = w_s dO,   dlse_s = w_s (dL + <dO, O_s - O>)      (<.,.> sums over the value dim)

and the dK/dV accumulator of a block travels with the block: after n steps (one more rotation) it is back
on the device that owns those rows.

Which keys a block holds for a query chunk. Chunks are contiguous row ranges of the natural packed order,
so a key chunk lies wholly before, equal to or after a query chunk; a sequence's rows inside the visiting
shard (one chunk, or chunks k < 2n-1-k with load_balance) are one contiguous run of the shard's rows (a
sequence with rows in two chunks covers the end of the first and the start of the second, and the shard
holds them back to back). The pieces of `block_pieces` (queries of sequence b in the chunk, its keys in
the shard) go to the op as B sequences with explicit offsets (cu_seqlens + seqused, `pieces_arguments`):

  - no mask: one call per query chunk against the whole shard, every key of the sequence;
  - causal: a shard chunk other than the query chunk lies wholly before it (all its keys visible) or wholly
    after it (none): one call without a mask against the shard (`_shard_block`). At step 0 the query chunk meets itself:
    each piece's keys there are exactly its queries' rows, causal top-left (`_own_chunk_block`); with
    load_balance a device's later chunk also meets its earlier one, before it (one call without a mask);
  - causal with a left window l: positions matter, so each (query chunk, key chunk) pair is its own call:
    the diagonal pair is causal with window (l, 0) over identical runs, an earlier key chunk goes through
    `window_pair` (only the one sequence that crosses into the query chunk can have keys there), a later
    one attends nothing. In the natural order the ring stops once no chunk is within the window's reach.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ragged_attn.backends.shared.forward_mode import forward_mode
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.index import sanitize_cu_seqlens
from jax_ragged_attn.ops.ragged import attend
from jax_ragged_attn.parallel import context_parallel as cp

__all__ = [
    "CONTEXT_STRATEGIES",
    "block_pieces",
    "check_strategy",
    "device_attention",
    "merge_partials",
    "pieces_arguments",
    "window_band",
    "window_layout",
    "window_pair",
]

CONTEXT_STRATEGIES = ("all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static part of one ring call (hashable: the custom_vjp's nondiff argument)."""

    plan: cp.Plan
    options: AttentionOptions  # the op's options for every block: stats on, token-major, no check
    chunk_rows: int  # C: rows of one chunk (a device holds plan.chunks_per_device of them)
    window: int | None  # the left window, None when there is none or it cannot cut any sequence

    @property
    def devices(self) -> int:
        return self.plan.devices

    @property
    def steps(self) -> int:
        """How many shards each device meets (its own first). n, except with a left window in the natural
        order: at step s the visiting chunk lies s chunks before (or after) the query chunk, so steps past
        the window's reach (_window_reach) attend nothing and are not taken."""
        if self.window is None or self.plan.load_balance:
            return self.devices
        return min(self.devices, _window_reach(self) + 1)


def device_attention(plan: cp.Plan, options: AttentionOptions, q, k, v, cu_seqlens):
    """The per-device body under shard_map (the ring counterpart of context_parallel.device_attention).

    plan: the context-parallel plan (sharding._context_parallel_plan). options: the op's options for the
    chunks' calls there (is_causal / window already folded by the plan, check off); the ring changes the
    mask and alignment per block and always asks for stats. q, k, v: this device's rows; cu_seqlens: the
    replicated int32 [B + 1] of the natural order. Returns (out [rows, Hq, Dv] in q's dtype, stats in
    options.stats_layout or None when options.return_stats is False).
    """
    per_device = plan.chunks_per_device
    rows = q.shape[0]
    window = plan.window_left
    if window is not None and window >= plan.max_seqlen - 1:
        window = None  # positions of one sequence differ by at most max_seqlen - 1: the window cuts nothing
    block_options = dataclasses.replace(
        options, return_stats=True, stats_layout="token_major", check=False, local_window_size=None
    )
    ring = _Ring(plan=plan, options=block_options, chunk_rows=rows // per_device, window=window)
    cu = sanitize_cu_seqlens(cu_seqlens, rows * plan.devices)
    out, lse = _ring_attention(ring, q, k, v, cu)
    if not options.return_stats:
        return out, None
    return out, lse.T if plan.stats_axis == 1 else lse


# ---- Pieces: which rows of a block each sequence attends. ----


def _shard_rows_before(x, chunk_starts, chunk_rows: int):
    """How many rows of a shard (the chunks starting at the natural rows chunk_starts, held back to back)
    lie before natural row x: maps natural rows to shard rows. Chunks [0, 3] of 4 rows (rows 0..3, 12..15):
    x = 2 -> 2, x = 9 -> 4, x = 14 -> 6."""
    return sum(jnp.clip(x - start, 0, chunk_rows) for start in chunk_starts)


def block_pieces(
    cu_seqlens, q_start, q_rows: int, kv_starts, kv_rows: int, *, max_seqlen: int, keys_up_to_queries: bool
) -> cp.Pieces:
    """Per sequence b: its queries in the query chunk, and its keys in a shard made of key chunks.

    cu_seqlens: sanitised int32 [B + 1] of the natural order; q_start (may be traced): the query chunk's
    first natural row, q_rows its rows; kv_starts: the shard's chunks' first natural rows (ascending, each
    kv_rows rows, held back to back). A sequence keeps its first max_seqlen rows. keys_up_to_queries
    (causal): only keys at natural rows up to the sequence's last query in the chunk.

    Natural order, cu_seqlens = [0, 5, 14, 16], 2 devices of 8 rows, causal; device 1's queries (rows
    8..15) at step 1, visiting shard of device 0 (rows 0..7):
      sequence 1: queries rows 8..13 (local 0..5), keys natural 5..7 -> shard rows 5..7
      sequence 2: queries local 6..7, keys natural 14..15 are not in the shard: none
      pieces (q_start, q_len, kv_start, kv_len) = (0, 0, 0, 0), (0, 6, 5, 3), (6, 2, 8, 0)
    At step 0 (the shard is rows 8..15 itself) sequence 1's keys are shard rows 0..5, its own queries.
    """
    start = cu_seqlens[:-1]
    end = start + jnp.minimum(cu_seqlens[1:] - start, max_seqlen)
    q_first = jnp.clip(start - q_start, 0, q_rows)
    q_end = jnp.clip(end - q_start, 0, q_rows)
    q_len = q_end - q_first
    high = jnp.minimum(end, q_start + q_end) if keys_up_to_queries else end
    kv_start = _shard_rows_before(start, kv_starts, kv_rows)  # ascending with b, also for empty pieces
    kv_len = jnp.where(q_len > 0, jnp.maximum(_shard_rows_before(high, kv_starts, kv_rows) - kv_start, 0), 0)
    return cp.Pieces(*(x.astype(jnp.int32) for x in (q_first, q_len, kv_start, kv_len)))


def pieces_arguments(pieces: cp.Pieces, q_rows: int, kv_rows: int) -> dict:
    """The one place pieces become the op's arguments: B sequences whose slots run from one piece's start to
    the next one's (cu_seqlens, the last slot to the end of the buffer) and which use only the piece's rows
    (seqused, FlashAttention's semantics), as context_parallel.chunk_attention spells them. With the pieces
    of block_pieces' example, (0, 0, 0, 0), (0, 6, 5, 3), (6, 2, 8, 0) in a chunk of 8 against 8 shard rows:
      cu_seqlens_q = [0, 0, 6, 8], seqused_q = [0, 6, 2];  cu_seqlens_kv = [0, 5, 8, 8], seqused_kv = [0, 3, 0]
    """

    def slots(starts, rows):
        return jnp.concatenate([starts, jnp.full((1,), rows, jnp.int32)])

    return dict(
        cu_seqlens_q=slots(pieces.q_start, q_rows),
        cu_seqlens_kv=slots(pieces.kv_start, kv_rows),
        seqused_q=pieces.q_len,
        seqused_kv=pieces.kv_len,
    )


# ---- One step: the local query chunks against the visiting shard. ----


def _chunk_starts(ring: _Ring, device):
    """First natural rows of the device's chunks: [r C] or, balanced, [r C, (2n-1-r) C] (ascending)."""
    c, n = ring.chunk_rows, ring.devices
    ids = [device] if not ring.plan.load_balance else [device, 2 * n - 1 - device]
    return [(i * c).astype(jnp.int32) for i in ids]


def _call(
    options: AttentionOptions,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_kv,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    seqused_q=None,
    seqused_kv=None,
):
    """The op on one block: (out float32 [rows, Hq, Dv], lse float32 [rows, Hq])."""
    out, lse = attend(
        (q, k, v),
        cu_seqlens_q,
        cu_seqlens_kv,
        options,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        seqused_q=seqused_q,
        seqused_kv=seqused_kv,
        loud=False,  # a block's own offsets: sharding.py selects over the caller's rows
    )
    return out.astype(jnp.float32), lse


def _pieces_call(ring: _Ring, options: AttentionOptions, q_chunk, k, v, pieces: cp.Pieces):
    """The op on one block's pieces (k, v: the shard rows they index)."""
    max_seqlen = ring.plan.max_seqlen
    return _call(
        options,
        q_chunk,
        k,
        v,
        max_seqlen_q=min(max_seqlen, q_chunk.shape[0]),
        max_seqlen_kv=min(max_seqlen, k.shape[0]),
        **pieces_arguments(pieces, q_chunk.shape[0], k.shape[0]),
    )


def _empty(q, v):
    """(out 0, lse -inf) of rows that attend nothing in a block."""
    rows, heads = q.shape[0], q.shape[1]
    return (jnp.zeros((rows, heads, v.shape[2]), jnp.float32), jnp.full((rows, heads), -jnp.inf, jnp.float32))


def _step(ring: _Ring, diagonal: bool, q, k, v, cu, r, src):
    """(out float32 [rows, Hq, Dv], lse float32 [rows, Hq]) of the local queries against the shard of
    device src (k, v). diagonal (static): step 0, where src is this device."""
    c = ring.chunk_rows
    q_starts, kv_starts = _chunk_starts(ring, r), _chunk_starts(ring, src)
    results = []
    for j, q_start in enumerate(q_starts):
        q_chunk = q[j * c : (j + 1) * c]
        if ring.window is None and not (diagonal and ring.plan.is_causal):
            results.append(_shard_block(ring, q_chunk, k, v, cu, q_start, kv_starts))
            continue
        # Causal at step 0, or a window: each key chunk on its own. A balanced device's chunk r never sees
        # chunk 2n-1-src of a shard (>= n > r: after it), and its chunk 2n-1-r sees its own chunk r whole.
        partials = []
        for i, kv_start in enumerate(kv_starts):
            k_chunk, v_chunk = k[i * c : (i + 1) * c], v[i * c : (i + 1) * c]
            if diagonal and i == j:
                partials.append(_own_chunk_block(ring, q_chunk, k_chunk, v_chunk, cu, q_start))
            elif j < i:
                continue
            elif ring.window is None:
                partials.append(_shard_block(ring, q_chunk, k_chunk, v_chunk, cu, q_start, [kv_start]))
            else:
                partials.append(window_pair(ring, q_chunk, k_chunk, v_chunk, cu, q_start, kv_start))
        results.append(functools.reduce(lambda a, b: merge_partials(*a, *b), partials))
    out = jnp.concatenate([o for o, _ in results], axis=0)
    lse = jnp.concatenate([s for _, s in results], axis=0)
    return out, lse


def _shard_block(ring: _Ring, q_chunk, k, v, cu, q_start, kv_starts):
    """A query chunk against shard chunks that are not itself, no window: one call without a mask (causal:
    only the chunks before it hold keys of its sequences, all visible; block_pieces drops the later ones)."""
    plan, c = ring.plan, ring.chunk_rows
    pieces = block_pieces(cu, q_start, c, kv_starts, c, max_seqlen=plan.max_seqlen, keys_up_to_queries=plan.is_causal)
    # No mask: the alignment means nothing; top-left keeps cuDNN off its bottom-right backward (sq x skv).
    options = dataclasses.replace(ring.options, is_causal=False, diagonal_alignment="top_left")
    return _pieces_call(ring, options, q_chunk, k, v, pieces)


def _own_chunk_block(ring: _Ring, q_chunk, k_chunk, v_chunk, cu, q_start):
    """A query chunk against its own rows, causal (with the left window if any). Every piece's keys are its
    own queries' rows (a sequence's earlier rows lie in other chunks), so top-left causal is the mask."""
    plan = ring.plan
    pieces = block_pieces(
        cu, q_start, ring.chunk_rows, [q_start], ring.chunk_rows, max_seqlen=plan.max_seqlen, keys_up_to_queries=True
    )
    options = dataclasses.replace(
        ring.options,
        is_causal=True,
        diagonal_alignment="top_left",
        local_window_size=None if ring.window is None else (ring.window, 0),
    )
    return _pieces_call(ring, options, q_chunk, k_chunk, v_chunk, pieces)


def _window_reach(ring: _Ring) -> int:
    """M: the farthest key chunk (in chunks before the query chunk) a left window of l rows can reach.
    A key chunk m chunks before holds rows m C .. (m - 1) C + 1 before the query chunk's first row, so it is
    within reach of that row while (m - 1) C + 1 <= l: m <= ceil(l / C). l = 6, C = 8 -> 1; l = 17 -> 3."""
    farthest = 2 * ring.devices - 1 if ring.plan.load_balance else ring.devices - 1
    return min(-(-ring.window // ring.chunk_rows), farthest)


def window_pair(ring: _Ring, q_chunk, k_chunk, v_chunk, cu, q_start, kv_start):
    """A query chunk against a different key chunk, causal with a left window l: exact, with a static window.

    Only an earlier key chunk, m = (q_start - kv_start) / C >= 1 chunks before, can hold keys, and only of
    the one sequence that holds the query chunk's first row (it must cross from the key chunk into the
    query chunk): its queries are local rows 0 .. run - 1, its keys local rows kv0 .. C - 1, and query i
    (position a + i) sees key j (position a - m C + j) when j >= i + e, e = m C - l. The op's windows are
    static and anchored at the piece's ends, so the piece is laid out to make the band static for each m:
    bottom-right, with sq = C - max(e, 0) query rows (d = i + (C - kv0) - sq) and window
    L = max(-e, 0) gives j >= i + C - sq - L = i + e. The piece's rows past the run belong to other
    sequences: their q is zeroed and their results masked out afterwards; rows past sq see no key anyway.

        C = 8, l = 6, m = 1: e = 2, sq = 6, L = 0: query row i sees key rows i + 2 .. 7 of the key chunk
        C = 8, l = 20, m = 2: e = -4, sq = 8, L = 4: query row i sees key rows max(kv0, i - 4) .. 7

    m is traced (it depends on the device and the step), so lax.switch picks the branch of each m in
    1 .. M (_window_reach); pairs out of reach, later chunks and pairs without the crossing sequence take
    the branch that attends nothing.
    """
    c = ring.chunk_rows
    if _window_reach(ring) == 0:
        return _empty(q_chunk, v_chunk)
    index, run, kv0, kv_end = window_layout(ring, cu, q_start, kv_start)

    def skip(q_chunk, k_chunk, v_chunk, run, kv0, kv_end):
        return _empty(q_chunk, v_chunk)

    def branch(m: int):
        sq, left = window_band(ring, m)
        options = dataclasses.replace(
            ring.options, is_causal=False, diagonal_alignment="bottom_right", local_window_size=(left, c)
        )

        def attend_band(q_chunk, k_chunk, v_chunk, run, kv0, kv_end):
            own = jnp.arange(c, dtype=jnp.int32) < run  # the crossing sequence's query rows
            q_in = jnp.where(own[:, None, None], q_chunk, 0)
            # One sequence: query rows 0 .. sq - 1 (rows past sq: out 0), key rows kv0 .. kv_end - 1.
            # max_seqlen = C: the bottom-right diagonal must count every row of the piece.
            out, lse = _call(
                options,
                q_in,
                k_chunk,
                v_chunk,
                jnp.asarray([0, c], jnp.int32),
                jnp.stack([kv0, jnp.full((), c, jnp.int32)]),
                c,
                c,
                seqused_q=jnp.full((1,), sq, jnp.int32),
                seqused_kv=(kv_end - kv0)[None],
            )
            return jnp.where(own[:, None, None], out, 0), jnp.where(own[:, None], lse, -jnp.inf)

        return attend_band

    branches = [skip] + [branch(m) for m in range(1, _window_reach(ring) + 1)]
    return lax.switch(index, branches, q_chunk, k_chunk, v_chunk, run, kv0, kv_end)


def window_layout(ring: _Ring, cu, q_start, kv_start):
    """The traced part of window_pair: (branch: m, or 0 when the pair attends nothing; run: the crossing
    sequence's query rows 0 .. run - 1; its key rows kv0 .. kv_end - 1 of the key chunk), int32 scalars."""
    c = ring.chunk_rows
    pieces = block_pieces(cu, q_start, c, [kv_start], c, max_seqlen=ring.plan.max_seqlen, keys_up_to_queries=True)
    crossing = pieces.kv_len > 0  # at most one sequence: the one holding rows kv_start + C - 1 and q_start
    run = jnp.sum(jnp.where(crossing, pieces.q_len, 0), dtype=jnp.int32)
    kv0 = jnp.sum(jnp.where(crossing, pieces.kv_start, 0), dtype=jnp.int32)
    kv_end = kv0 + jnp.sum(pieces.kv_len, dtype=jnp.int32)
    m = (q_start - kv_start) // c
    branch = jnp.where((m >= 1) & (m <= _window_reach(ring)) & (run > 0), m, 0).astype(jnp.int32)
    return branch, run, kv0, kv_end


def window_band(ring: _Ring, m: int) -> tuple[int, int]:
    """The static part of window_pair for a key chunk m >= 1 chunks before: (sq, the op's left window L)."""
    e = m * ring.chunk_rows - ring.window
    return ring.chunk_rows - max(e, 0), max(-e, 0)


# ---- Merging partial results. ----


def _live(lse):
    return lse > -jnp.inf


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Exact merge of two partial attentions of the same rows over disjoint keys (float32, out [rows, H, D],
    lse [rows, H]): L = logaddexp(lse_a, lse_b), O = exp(lse_a - L) O_a + exp(lse_b - L) O_b. Rows with no key
    on either side stay O = 0, L = -inf; no NaN or inf is formed on the way, in value or gradient (every
    exp and log sees a finite argument)."""
    high = jnp.maximum(lse_a, lse_b)
    live = _live(high)
    high0 = jnp.where(live, high, 0.0)
    w_a = jnp.where(_live(lse_a), jnp.exp(jnp.where(_live(lse_a), lse_a, high0) - high0), 0.0)
    w_b = jnp.where(_live(lse_b), jnp.exp(jnp.where(_live(lse_b), lse_b, high0) - high0), 0.0)
    total = jnp.where(live, w_a + w_b, 1.0)  # >= 1 where live: the larger side contributes exp(0)
    out = (w_a[..., None] * out_a + w_b[..., None] * out_b) / total[..., None]
    return out, jnp.where(live, high0 + jnp.log(total), -jnp.inf)


def _weight(lse_s, lse):
    """w_s = exp(lse_s - L), 0 where the step saw no key (then lse_s = -inf; L may be -inf too)."""
    live = _live(lse_s)  # live implies L >= lse_s is finite
    lse0 = jnp.where(_live(lse), lse, 0.0)
    return jnp.where(live, jnp.exp(jnp.where(live, lse_s, lse0) - lse0), 0.0)


# ---- The ring, forward and backward. ----


def _rotate(ring: _Ring, x, shift: int = 1):
    """Every device's x to the device `shift` further on the ring (r -> r + shift mod n)."""
    n = ring.devices
    return lax.ppermute(x, ring.plan.token_axis, perm=[(i, (i + shift) % n) for i in range(n)])


def _source(ring: _Ring, r, s):
    """The device whose shard device r holds at step s."""
    s = jnp.asarray(s).astype(jnp.int32)  # a fori_loop index is int64 under jax_enable_x64
    return jnp.remainder(r - s + ring.devices, ring.devices)  # jnp: the Python ints stay int32 under x64


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, cu):
    """(out [rows, Hq, Dv] in q's dtype, lse float32 [rows, Hq]) of this device's queries against all keys."""
    return _forward(ring, q, k, v, cu)


def _forward(ring: _Ring, q, k, v, cu):
    n = ring.steps
    r = lax.axis_index(ring.plan.token_axis).astype(jnp.int32)
    in_flight = _rotate(ring, (k, v)) if n > 1 else None  # sent before step 0 computes: overlap
    out, lse = _step(ring, True, q, k, v, cu, r, r)

    def body(s, carry):
        block, out, lse = carry
        following = _rotate(ring, block)
        out, lse = merge_partials(out, lse, *_step(ring, False, q, *block, cu, r, _source(ring, r, s)))
        return following, out, lse

    if n > 2:
        in_flight, out, lse = lax.fori_loop(1, n - 1, body, (in_flight, out, lse))
    if n > 1:  # the last step: nothing left to send
        out, lse = merge_partials(out, lse, *_step(ring, False, q, *in_flight, cu, r, _source(ring, r, n - 1)))
    return out.astype(q.dtype), lse


def _ring_fwd(ring: _Ring, q, k, v, cu):
    out, lse = _forward(ring, q, k, v, cu)
    return (out, lse), (q, k, v, cu, out, lse)


def _ring_bwd(ring: _Ring, residuals, cotangents):
    q, k, v, cu, out, lse = residuals
    d_out, d_lse = (x.astype(jnp.float32) for x in cotangents)
    out = out.astype(jnp.float32)
    n = ring.steps
    r = lax.axis_index(ring.plan.token_axis).astype(jnp.int32)

    def grads(diagonal, block, s):
        """dq, dk, dv (float32) of step s: the step recomputed, fed the chain rule of the merge."""
        step = functools.partial(_step, ring, diagonal)
        (out_s, lse_s), pullback = jax.vjp(lambda q, k, v: step(q, k, v, cu, r, _source(ring, r, s)), q, *block)
        w = _weight(lse_s, lse)
        d_lse_s = w * (d_lse + jnp.sum(d_out * (out_s - out), axis=-1))
        return tuple(g.astype(jnp.float32) for g in pullback((w[..., None] * d_out, d_lse_s)))

    in_flight = _rotate(ring, (k, v)) if n > 1 else None
    dq, dk, dv = grads(True, (k, v), 0)
    if n == 1:
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None
    # The accumulator of a block travels with it: device r + 1 holds block r at step 1.
    d_block = _rotate(ring, (dk, dv))

    def body(s, carry):
        block, d_block, dq = carry
        following = _rotate(ring, block)
        dq_s, dk_s, dv_s = grads(False, block, s)
        d_block = _rotate(ring, (d_block[0] + dk_s, d_block[1] + dv_s))
        return following, d_block, dq + dq_s

    if n > 2:
        in_flight, d_block, dq = lax.fori_loop(1, n - 1, body, (in_flight, d_block, dq))
    dq_s, dk_s, dv_s = grads(False, in_flight, n - 1)
    # The accumulator of block r - (n - 1), complete: it has moved n - 1 devices, and the rest of the ring
    # takes it home (one more step when every shard went round; fewer steps taken, a longer hop).
    dk, dv = _rotate(ring, (d_block[0] + dk_s, d_block[1] + dv_s), ring.devices - n + 1)
    return (dq + dq_s).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
# Forward mode differentiates the ring's forward as it is: its steps are the op's own calls (which have forward
# mode), the rotations and merges plain JAX; the backward likewise, for forward-over-reverse.
_ring_attention = forward_mode(
    _ring_attention, _forward, second_order=False, primals_from=lambda ring, saved: saved[:4]
)


def check_strategy(context_strategy, token_axis) -> None:
    """ValueError unless context_strategy is one of CONTEXT_STRATEGIES (and "ring" has a token_axis)."""
    if context_strategy not in CONTEXT_STRATEGIES:
        raise ValueError(f"context_strategy must be one of {CONTEXT_STRATEGIES}, got {context_strategy!r}")
    if context_strategy == "ring" and token_axis is None:
        raise ValueError("context_strategy='ring' rotates K/V over the token axis: it needs token_axis")
