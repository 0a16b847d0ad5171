"""Load balance for context parallelism: the dual-chunk order, on sharded arrays too, and causal work per device.

With causal attention a query row at position p of its sequence attends p + 1 keys, so on n devices that
each hold a contiguous T/n rows of the packed buffer the last device does far more work than the first.
The dual-chunk order cuts the token axis into 2n chunks of C = T/(2n) rows and gives device r chunks r and
2n-1-r: an early chunk paired with its mirror image.

    n = 2, T = 8 (C = 2): natural rows [0 1 | 2 3 | 4 5 | 6 7]  chunks 0 1 2 3
                          reordered   [0 1   6 7 | 2 3   4 5]  device 0: chunks 0, 3; device 1: chunks 1, 2

`permute_chunks` applies that order (or its inverse) to a JAX array. On an array split along the token axis
over a mesh axis of n devices it exchanges half-shards with two collective permutes inside a shard_map, so
the result keeps the input's sharding and nothing is all-gathered; anywhere else it permutes a [2n, T/(2n)]
view of the axis, which XLA's partitioner handles for any T (jnp.split into 2n pieces is refused by
sharding-in-types on a split axis when T/(2n) is not a multiple of n).

The rest is NumPy for the host: `causal_work_per_device` measures each device's share of the causal
query-key pairs of a packing, and `balanced_document_order` chooses the order of a batch's documents so that
the shares come out close to 1/n (the packer uses it: jax_ragged_attn.inputs.data, context_parallel_devices).
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "balanced_document_order",
    "causal_work_per_device",
    "device_of_chunk",
    "dual_chunk_order",
    "dual_chunk_rows",
    "permute_chunks",
]


# ---- The order itself. ----


def dual_chunk_order(n: int) -> list[int]:
    """The natural chunks (of 2n) in load-balanced order: position j holds natural chunk order[j], device r
    positions 2r and 2r + 1, i.e. chunks r and 2n-1-r.

        n = 1 -> [0, 1];  n = 2 -> [0, 3, 1, 2];  n = 4 -> [0, 7, 1, 6, 2, 5, 3, 4]
    """
    n = _positive_int(n, "n")
    return [c for r in range(n) for c in (r, 2 * n - 1 - r)]


def device_of_chunk(n: int) -> np.ndarray:
    """int32 [2n]: the device that holds each natural chunk in the dual-chunk order.

    n = 2 -> [0, 1, 1, 0];  n = 4 -> [0, 1, 2, 3, 3, 2, 1, 0]
    """
    device = np.empty(2 * n, np.int32)
    device[dual_chunk_order(n)] = np.arange(2 * n, dtype=np.int32) // 2
    return device


def dual_chunk_rows(total: int, n: int, *, inverse: bool = False) -> np.ndarray:
    """int32 [total]: the row permutation of the dual-chunk order, reordered = natural[rows] (inverse=True:
    natural = reordered[rows]). For host (NumPy) arrays; `permute_chunks` does the same to JAX arrays.

        total = 8, n = 2 -> [0, 1, 6, 7, 2, 3, 4, 5]; inverse -> [0, 1, 4, 5, 6, 7, 2, 3]
    """
    _check_total(total, n, "dual_chunk_rows")
    chunk = total // (2 * n)
    order = np.asarray(_permutation(n, inverse), np.int64)
    return (order[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1).astype(np.int32)


def _permutation(n: int, inverse: bool) -> list[int]:
    """The chunk at each position: the dual-chunk order, or the order that undoes it (n = 2: [0, 2, 3, 1])."""
    order = dual_chunk_order(n)
    return [order.index(c) for c in range(2 * n)] if inverse else order


def _check_total(total: int, n: int, name: str, axis: int | None = None) -> None:
    n = _positive_int(n, "n")
    if total % (2 * n):
        where = "the token axis" if axis is None else f"the token axis (axis {axis}"
        where += f", {total} rows)" if axis is not None else f" ({total} rows)"
        raise ValueError(f"{name}: {where} must be a multiple of 2n = {2 * n} (2 chunks for each of the {n} devices)")


# ---- JAX arrays: a local permutation, or a half-shard exchange between the devices. ----


def permute_chunks(x, n: int, axis: int = 0, *, inverse: bool = False, name: str = "permute_chunks"):
    """x in the dual-chunk order along `axis` (inverse=True: back to the natural order).

    What reorder_for_load_balance and restore_order run (`name` names the caller in errors). Three ways,
    chosen from the sharding visible at trace time (`jax.typeof(x)`: explicit mesh axes; `x.sharding` of a
    concrete array):
      split along `axis` over mesh axes of n devices: a shard_map exchanging half-shards (collective
        permutes); the result keeps x's sharding;
      split over m != n devices (m divides the axis): a shard_map that all-gathers the axis, permutes, and
        keeps its own slice; the sharding is kept, at the price of an all-gather;
      otherwise (unsharded, replicated, Auto axes under jit, inside a shard_map): the 2n chunks permuted on
        a [2n, T/(2n)] view of the axis, which XLA's partitioner handles whatever the input's sharding.
    Differentiable (the transpose of a permutation is the inverse permutation), eager or under jit.
    """
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    axis = _axis(x, axis, name)
    _check_total(x.shape[axis], n, name, axis)
    if n == 1:
        return x  # one device: chunks 0 and 1 are already in order
    split = _token_split(x, axis)
    if split is not None:
        mesh, spec, axes = split
        devices = math.prod(mesh.shape[a] for a in axes)
        if devices > 1 and x.shape[axis] % devices == 0:
            return _sharded_permutation(mesh, spec, axes, devices == n, n, axis, inverse)(x)
    return _local_permutation(n, axis, inverse)(x)


# Jitted and cached: called eagerly, a bare shard_map would run its body primitive by primitive (seconds on a
# CPU for a few collectives), and a fresh function per call would be traced again each time. Under an outer
# jit the inner jit is inlined.
@functools.lru_cache(maxsize=256)
def _sharded_permutation(mesh, spec, axes: tuple, exchange: bool, n: int, axis: int, inverse: bool):
    body = _exchange_halves if exchange else _gather_permute_slice
    body = functools.partial(body, n=n, axis=axis, axes=axes, inverse=inverse)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


@functools.lru_cache(maxsize=256)
def _local_permutation(n: int, axis: int, inverse: bool):
    return jax.jit(functools.partial(_permute_locally, n=n, axis=axis, inverse=inverse))


def _axis(x, axis, name: str) -> int:
    ndim = np.ndim(x)
    axis = _int(axis, "axis")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: axis {axis} is out of range for an array of {ndim} dimensions")
    return axis % ndim


def _token_split(x, axis: int):
    """(mesh, full spec, mesh axes of `axis`) when x is visibly split along `axis`, else None."""
    shardings = [jax.typeof(x).sharding]  # explicit axes: traced or concrete
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        shardings.append(x.sharding)  # a concrete array placed on Auto axes
    for sharding in shardings:
        if not isinstance(sharding, NamedSharding):
            continue
        entries = tuple(sharding.spec) + (None,) * (np.ndim(x) - len(sharding.spec))
        names = entries[axis]
        names = (names,) if isinstance(names, str) else names
        if isinstance(names, tuple) and names:
            return sharding.mesh, P(*entries), names
    return None


def _permute_locally(x, n: int, axis: int, inverse: bool):
    """The 2n chunks permuted on a [..., 2n, T/(2n), ...] view, as unit slices of its chunk dimension.

    Never a split of the token axis into 2n pieces, which sharding-in-types refuses on a split axis unless
    T/(2n) is a multiple of the devices. Under jit over Auto axes, where the input's sharding is not known
    here, XLA's partitioner takes it for any T: on 4 CPU devices (jax 0.10.2) with a token-split input it
    moves the chunks with collective permutes and one all-reduce of the array's size, and returns the
    result split along tokens (a jnp.take of the chunks came back replicated). Explicit axes, or an eager
    call on a placed array, get the exchange instead.
    """
    size = x.shape[axis]
    view = x.reshape(x.shape[:axis] + (2 * n, size // (2 * n)) + x.shape[axis + 1 :])
    chunks = [lax.slice_in_dim(view, c, c + 1, axis=axis) for c in _permutation(n, inverse)]
    return jnp.concatenate(chunks, axis=axis).reshape(x.shape)


def _exchange_plan(n: int, inverse: bool):
    """Where the half-shards go: (perm of the first halves, perm of the second halves, flip [n] bool).

    Device s holds natural chunks 2s and 2s + 1 as its halves; device r needs chunks r and 2n-1-r. Every
    first half goes to a different device (so does every second half), so each half is one collective
    permute. A receiver whose first slot comes from a second half (flip) swaps the two it gets.
        n = 2: first halves 0 -> 0, 1 -> 1 (chunks 0, 2); second halves 0 -> 1, 1 -> 0 (chunks 1, 3);
               device 0 gets chunks (0, 3): no flip; device 1 gets (2, 1): flip -> chunks 1, 2.
    inverse: the same exchange run backwards (sources and destinations swapped).
    """
    device = device_of_chunk(n)
    slot = np.empty(2 * n, np.int32)
    slot[dual_chunk_order(n)] = np.arange(2 * n, dtype=np.int32) % 2
    perms = tuple([(s, int(device[2 * s + h])) for s in range(n)] for h in (0, 1))
    flip = np.zeros(n, bool)
    flip[device[0::2]] = slot[0::2] == 1  # the receiver of a first half puts it second
    if inverse:
        perms = tuple([(d, s) for s, d in perm] for perm in perms)
    return perms[0], perms[1], flip


def _exchange_halves(block, *, n: int, axis: int, axes: tuple, inverse: bool):
    """shard_map body (one device's block of T/n rows): the dual-chunk exchange of its two halves."""
    first_perm, second_perm, flip = _exchange_plan(n, inverse)
    half = block.shape[axis] // 2
    lo, hi = lax.slice_in_dim(block, 0, half, axis=axis), lax.slice_in_dim(block, half, 2 * half, axis=axis)
    flipped = jnp.asarray(flip)[lax.axis_index(axes)]
    if inverse:
        # Send back what arrived: the slot that came from a first half returns as the sender's first half.
        lo, hi = jnp.where(flipped, hi, lo), jnp.where(flipped, lo, hi)
        return jnp.concatenate([lax.ppermute(lo, axes, first_perm), lax.ppermute(hi, axes, second_perm)], axis=axis)
    from_first, from_second = lax.ppermute(lo, axes, first_perm), lax.ppermute(hi, axes, second_perm)
    return jnp.concatenate(
        [jnp.where(flipped, from_second, from_first), jnp.where(flipped, from_first, from_second)], axis=axis
    )


def _gather_permute_slice(block, *, n: int, axis: int, axes: tuple, inverse: bool):
    """shard_map body for a split over m != n devices: the whole axis gathered, permuted, this device's
    slice kept."""
    whole = _permute_locally(lax.all_gather(block, axes, axis=axis, tiled=True), n, axis, inverse)
    rows = block.shape[axis]
    start = lax.axis_index(axes).astype(jnp.int32) * jnp.int32(rows)
    return lax.dynamic_slice_in_dim(whole, start, rows, axis=axis)


# ---- Causal work per device (NumPy). ----


def causal_work_per_device(cu_seqlens, n: int, load_balance: bool = True, *, capacity: int | None = None) -> np.ndarray:
    """int64 [n]: the causal query-key pairs each of n context-parallel devices computes.

    A row at position p of its sequence attends p + 1 keys, so a sequence of length L costs L (L + 1) / 2
    pairs; device r's work is the pairs of the query rows it holds: chunks r and 2n-1-r of 2n with
    load_balance (the dual-chunk order), rows [r T/n, (r+1) T/n) without. cu_seqlens: the natural packed
    order ([B + 1], non-decreasing from 0); capacity: T, the rows of the buffer (default cu_seqlens[-1]);
    rows past cu_seqlens[-1] are padding and cost nothing.

        cu_seqlens = [0, 8], n = 2:  pairs per row 1..8
          load_balance=True  -> [1+2 + 7+8, 3+4 + 5+6] = [18, 18]
          load_balance=False -> [1+2+3+4, 5+6+7+8]     = [10, 26]
    """
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be a 1-D integer array [B + 1], got {cu.dtype} {cu.shape}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu.tolist()}")
    total = int(cu[-1]) if capacity is None else _int(capacity, "capacity")
    if total < cu[-1]:
        raise ValueError(f"capacity ({total}) must hold the {int(cu[-1])} rows cu_seqlens describe")
    n = _positive_int(n, "n")
    chunks = 2 * n if load_balance else n
    if total % chunks:
        raise ValueError(f"capacity ({total}) must be a multiple of {'2n' if load_balance else 'n'} = {chunks}")
    work = _chunk_work(np.diff(cu)[None], total, chunks)[0] if cu.size > 1 else np.zeros(chunks, np.int64)
    if not load_balance:
        return work
    per_device = np.zeros(n, np.int64)
    np.add.at(per_device, device_of_chunk(n), work)
    return per_device


def _chunk_work(packings: np.ndarray, total: int, chunks: int) -> np.ndarray:
    """int64 [K, chunks]: causal pairs in each of `chunks` equal row ranges, for K packings [K, B] at once
    (sequence lengths in row order, back to back from row 0).

    W(t), the pairs of the rows before t, is the pairs of every sequence that ends by t plus m (m + 1) / 2 for
    the m rows of the one that holds row t; a chunk's work is W at its end minus W at its start. The sequence
    that holds each edge comes from one searchsorted over all K packings (row k's ends offset by k (T + 1),
    so that the flattened ends stay sorted).
    """
    count, width = packings.shape
    ends = np.cumsum(packings, axis=1)
    full = packings * (packings + 1) // 2
    before = np.cumsum(full, axis=1) - full  # pairs of the sequences before each one
    edges = np.arange(chunks + 1, dtype=np.int64) * (total // chunks)
    offset = np.arange(count, dtype=np.int64)[:, None] * (total + 1)
    done = np.searchsorted((ends + offset).reshape(-1), (edges[None, :] + offset).reshape(-1), side="right")
    # The sequence holding each edge (the last one, with all its rows, once the edge is past every end).
    held = np.minimum(done.reshape(count, -1) - np.arange(count)[:, None] * width, width - 1)
    rows = np.arange(count)[:, None]
    m = np.clip(edges[None, :] - (ends - packings)[rows, held], 0, packings[rows, held])
    pairs = before[rows, held] + m * (m + 1) // 2
    return np.diff(pairs, axis=1)


# ---- A document order that balances the dual-chunk devices. ----


def balanced_document_order(
    lengths,
    n: int,
    capacity: int,
    *,
    tolerance: float = 0.01,
    descents: int = 16,
    max_candidates: int = 2048,
    seed: int = 0,
) -> np.ndarray:
    """int64 [B]: an order of the documents (indices into lengths) for which the dual-chunk devices' causal
    work is as even as a local search finds (packed back to back from row 0, padding at the end).

    The dual-chunk order balances one long sequence exactly (row t and its mirror T-1-t sit on the same
    device, and their pairs add up to T + 1), but a batch of documents restarts its ramp of pairs at every
    boundary, and where the long documents fall decides the devices' shares:

        lengths [8, 4, 2, 2] in 16 rows, n = 2 (chunks of 4 rows; device 0: rows 0-3 and 12-15):
          given order    [8, 4, 2, 2]                         -> pairs per device [16, 36]
          balanced order [2, 4, 8, 2] (returns [2, 1, 0, 3])  -> [24, 28]

    A local search: it starts from the given order, a mirrored one (lengths sorted, dealt alternately to
    the front and the back) and a greedy fill along a target line of pairs, and descends from each, best
    first, by the best single move - swapping two documents, or moving one elsewhere - that lowers the
    busiest device's share (ties: the sum of squared shares) until none helps; then from the best so far
    with a few documents swapped at random, up to `descents` descents in all. It stops as soon as the
    busiest device is within `tolerance` of the idlest (max / min - 1). Moves are scored together
    (vectorised); with many documents, a random sample of them per round (max_candidates, fewer with many
    documents). Deterministic for given arguments (seed). Costs milliseconds for 16 documents on 2-4
    devices, 0.1-0.2 s on 8 (one CPU core).

    What it can reach depends on the batch: with documents much shorter than a chunk (T/(2n) rows) the
    devices come within 1 %; with a few documents several chunks long (10 documents of 4k..32k in 128k rows
    on 8 devices) no order of them gets close (the best one by exhaustive search: 15-30 % apart).
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer) or np.any(lengths < 0):
        raise ValueError(f"lengths must be a 1-D array of non-negative integers, got {lengths.dtype} {lengths.shape}")
    lengths = lengths.astype(np.int64)
    n = _positive_int(n, "n")
    capacity = _int(capacity, "capacity")
    _check_total(capacity, n, "balanced_document_order")
    if lengths.sum() > capacity:
        raise ValueError(f"lengths must sum to at most capacity ({capacity}), got {int(lengths.sum())}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    descents = _positive_int(descents, "descents")
    search = _Search(
        lengths, n, capacity, tolerance, _positive_int(max_candidates, "max_candidates"), np.random.default_rng(seed)
    )
    starts = sorted(
        (
            (search.score(order), order)
            for order in (np.arange(lengths.size), _mirrored(lengths), _greedy_by_mass(lengths, n, capacity))
        ),
        key=lambda scored: scored[0],
    )
    best = starts[0]
    for start in range(descents):
        if search.balanced(best[0]) or lengths.size < 2:
            break
        # The first descents start from the three orders above, best first; later ones from the best so far
        # with a few documents swapped at random (iterated local search: a kick out of a local optimum).
        order = starts[start][1] if start < len(starts) else search.kick(best[1])
        best = min(best, search.descend(order), key=lambda scored: scored[0])
    return best[1]


class _Search:
    """The local search's pieces: the score of an order, one steepest descent, a random kick."""

    def __init__(self, lengths, n, capacity, tolerance, max_candidates, rng):
        self.lengths, self.n, self.capacity = lengths, n, capacity
        self.tolerance, self.rng = tolerance, rng
        # Candidates per round: all moves of a small batch; with many documents fewer, so that a round reads
        # about 2**18 lengths (many short documents barely change the balance one at a time anyway).
        self.candidates = min(max_candidates, max(64, 2**18 // max(lengths.size, 1)))

    def score(self, order: np.ndarray) -> tuple[float, float, float]:
        return tuple(_scores(self.lengths[None, order], self.n, self.capacity)[0])

    def balanced(self, score) -> bool:
        """Busiest device within `tolerance` of the idlest (score[2]: their ratio)."""
        return score[2] - 1 <= self.tolerance

    def descend(self, order: np.ndarray):
        """Steepest descent: (score, order) where no single move improves the score (or one within tolerance)."""
        score = self.score(order)
        for _ in range(4 * self.lengths.size):  # a bound; descents end long before it
            if self.balanced(score):
                break
            candidates = _moves(order, self.candidates, self.rng)
            scores = _scores(self.lengths[candidates], self.n, self.capacity)
            i = int(np.lexsort(scores[:, 1::-1].T)[0])
            if not tuple(scores[i]) < score:
                break
            score, order = tuple(scores[i]), candidates[i]
        return score, order

    def kick(self, order: np.ndarray, swaps: int = 3) -> np.ndarray:
        order = order.copy()
        for _ in range(swaps):
            i, j = self.rng.choice(order.size, 2, replace=False)
            order[i], order[j] = order[j], order[i]
        return order


def _mirrored(lengths: np.ndarray) -> np.ndarray:
    """Documents in ascending length order dealt alternately to the front and the back: the longest ends up
    in the middle, and each front document faces one of similar length across it ([1, 2, 3, 4, 5] ->
    front 1, 3, 5 / back 2, 4 -> [1, 3, 5, 4, 2])."""
    ascending = np.argsort(lengths, kind="stable")
    return np.concatenate([ascending[0::2], ascending[1::2][::-1]])


def _greedy_by_mass(lengths: np.ndarray, n: int, capacity: int) -> np.ndarray:
    """Documents laid out from row 0, each time the one whose pairs L (L + 1) / 2 best match what the rows it
    would cover should carry, so that the pairs accumulate along a target line: every device 1/n of the
    total, split between its two chunks by their real (non-padding) rows. Good with many short documents,
    where the search's single moves each change little; poor with a few long ones (the mirrored start's
    case)."""
    chunk = capacity // (2 * n)
    real = np.clip(int(lengths.sum()) - np.arange(2 * n) * chunk, 0, chunk).astype(np.float64)
    device = device_of_chunk(n)
    device_rows = np.zeros(n)
    np.add.at(device_rows, device, real)
    mass = lengths * (lengths + 1) / 2.0
    share = mass.sum() / n * real / np.maximum(device_rows[device], 1.0)
    edges = np.arange(2 * n + 1) * chunk
    target = np.concatenate([[0.0], np.cumsum(share)])  # pairs wanted before each edge; linear in between
    remaining = np.argsort(-lengths, kind="stable")  # ties: the longest, then the first, wins
    order, row, placed = [], 0, 0.0
    while remaining.size:
        wanted = np.interp(row + lengths[remaining], edges, target) - placed
        k = int(np.argmin(np.abs(mass[remaining] - wanted)))
        order.append(remaining[k])
        row, placed = row + int(lengths[remaining[k]]), placed + mass[remaining[k]]
        remaining = np.delete(remaining, k)
    return np.asarray(order, np.int64)


def _device_work(packings: np.ndarray, n: int, capacity: int) -> np.ndarray:
    """int64 [K, n]: the dual-chunk devices' causal pairs for K packings (lengths in row order) [K, B]."""
    work = _chunk_work(packings, capacity, 2 * n)
    return work[:, dual_chunk_order(n)].reshape(-1, n, 2).sum(axis=2)


def _scores(packings: np.ndarray, n: int, capacity: int) -> np.ndarray:
    """float64 [K, 3] per packing [K, B]: the busiest device's pairs and the sum of squares of all devices'
    pairs, both relative to a perfect share 1/n, and busiest / idlest. The first two, compared in that
    order, are the objective (lower is better): the busiest device sets the step time, and the sum of
    squares breaks its ties (a move that only relieves the second busiest device still counts)."""
    work = _device_work(packings, n, capacity).astype(np.float64)
    relative = work / np.maximum(work.sum(axis=1, keepdims=True) / n, 1.0)
    busiest = relative.max(axis=1)
    spread = busiest / np.maximum(relative.min(axis=1), 1e-300)
    return np.stack([busiest, (relative**2).sum(axis=1), spread], axis=1)


def _moves(order: np.ndarray, limit: int, rng: np.random.Generator) -> np.ndarray:
    """[K, B]: orders one move away: swap the documents in slots i and j, or take the one in slot i out and
    put it back at slot j. Every (i, j) of both kinds up to `limit` candidates, a random sample beyond."""
    count = order.size
    pairs = count * count
    picked = np.arange(2 * pairs) if 2 * pairs <= limit else rng.choice(2 * pairs, limit, replace=False)
    swap = picked < pairs
    i, j = (picked % pairs) // count, picked % count
    keep = (i < j) | ((i > j) & ~swap)  # a swap of (i, j) is one of (j, i)
    swap, i, j = swap[keep], i[keep], j[keep]
    slot = np.arange(count)[None, :]
    # Swap: slot i reads j and slot j reads i. Move i to j: slot j reads i; the slots between shift by one
    # towards where i was (k in (i, j]: k + 1 ... written as the source slot of every k).
    forward = (slot >= np.minimum(i, j)[:, None]) & (slot <= np.maximum(i, j)[:, None])
    shift = np.where(i < j, 1, -1)[:, None]
    moved = np.where(slot == j[:, None], i[:, None], np.where(forward, slot + shift, slot))
    swapped = np.where(slot == i[:, None], j[:, None], np.where(slot == j[:, None], i[:, None], slot))
    return order[np.where(swap[:, None], swapped, moved)]


# ---- Arguments. ----


def _int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _positive_int(value, name: str) -> int:
    value = _int(value, name)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value
