"""The index arithmetic of a call, done once: integer index arrays made int32, sanitised cu_seqlens, each
row's sequence, position and validity, and the `RaggedIndex` that carries them from the entry point through
the features to the backend.

Everything here is jit-traceable and cheap: O(B + T) integer work. Shared by the xla path (to gather rows
into a padded batch and back), the cuDNN path (to zero the rows cuDNN never writes), FlashAttention-3 (its
seqused), the sink epilogue (which rows are real, which have keys) and the overflow counts.

## Index arrays of any integer dtype (`as_int32`)

Users build them the ordinary way - `jnp.array([0, 3, 7])`, NumPy's int64 `np.cumsum`, a data loader's
uint32 - and under `jax_enable_x64` the first is int64 too. The kernels and the graphs take int32, so every
entry point passes its index arrays through `as_int32` first thing:

- int32 passes through untouched (no op added to the program);
- NumPy (host) arrays of another integer dtype are converted at trace time, and a value outside int32 is a
  ValueError naming the argument and the first such entry (it would be a different value after the cast);
- device arrays and tracers of another integer dtype are clipped into int32's range, then cast: a value
  that does not fit becomes int32's min or max, which every consumer already treats as out of range
  (cu_seqlens are clamped into the buffer and counted by return_overflow, check mode raises naming the
  argument; a segment id above the range stays a positive id), never a wrapped-around small value;
- anything else (floats, bools, non-arrays) is a ValueError naming the argument.

Python lists and tuples of ints are accepted as NumPy arrays would be.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

_INT32 = np.iinfo(np.int32)


def cu_seqlens_from_lengths(lengths) -> np.ndarray:
    """Host-side int32 [B + 1] offsets of sequences packed back to back: [3, 0, 2] -> [0, 3, 3, 5]."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int32)


def sanitize_cu_seqlens(cu_seqlens: jax.Array, capacity: int) -> jax.Array:
    """Clamps cu_seqlens monotone into [0, capacity], so no offset can address outside the buffer.

    Valid input passes through unchanged: [0, 3, 3, 7] -> [0, 3, 3, 7]. Garbage is made harmless:
    [5, 2, 9, 4] with capacity 6 -> [5, 5, 6, 6].

    The optimization barrier keeps XLA from constant-folding what derives from cu_seqlens a jitted function
    closes over: on the GPU (jax 0.11.2), XLA folds row_positions of the constant [0, 1] (capacity 2)
    through a cummax, a scatter-add and a cumsum to sequence [1, 1] instead of [0, 1], so the one real
    row would read as padding and the op return out 0 for it, silently (tests/test_packing.py has the case).
    """
    return jnp.clip(running_max(jax.lax.optimization_barrier(cu_seqlens)), 0, capacity)


# Up to this many (row, entry) pairs, the scans below compare every pair: one fused kernel on a GPU, where
# lax.cummax / jnp.cumsum lower to reduce_window, which XLA runs as passes of a tree
# (docs/PERFORMANCE.md#what-the-measurements-found, "Index scans"). Past it, the linear-work scan: 2^24
# compares cost about what those passes do, and a million rows of a thousand sequences would cost more.
COMPARE_ALL_LIMIT = 1 << 24


def running_max(x: jax.Array) -> jax.Array:
    """lax.cummax(x) of a 1-D integer array: [3, 1, 5, 2] -> [3, 3, 5, 5]."""
    n = x.shape[0]
    if n == 0 or n * n > COMPARE_ALL_LIMIT:
        return jax.lax.cummax(x, axis=0)
    at = jnp.arange(n, dtype=jnp.int32)
    earlier = at[None, :] <= at[:, None]  # [i, j]: entry j lies at or before i
    return jnp.max(jnp.where(earlier, x[None, :], jnp.iinfo(x.dtype).min), axis=1).astype(x.dtype)


def count_at_or_before(ends: jax.Array, capacity: int) -> jax.Array:
    """For each of `capacity` rows r, how many of `ends` are <= r (ends int32, already clipped to [0, capacity]):
    ends [2, 2, 5], capacity 7 -> [0, 0, 2, 2, 2, 3, 3]."""
    if capacity * ends.shape[0] <= COMPARE_ALL_LIMIT:
        rows = jnp.arange(capacity, dtype=jnp.int32)
        return jnp.sum(ends[None, :] <= rows[:, None], axis=1, dtype=jnp.int32)
    # A scatter-add and a cumsum rather than jnp.searchsorted's binary search, a loop of log2(B) small steps
    # (on a GPU a while loop costs a host round trip per iteration).
    return jnp.cumsum(jnp.zeros(capacity + 1, jnp.int32).at[ends].add(1), dtype=jnp.int32)[:capacity]


def host_slots(cu_seqlens, capacity: int) -> np.ndarray | None:
    """Each slot's rows of cu_seqlens sanitised as sanitize_cu_seqlens does, on the host (int64 [B]), or None when
    the values are not known at trace time (a tracer): [5, 2, 9, 4] with capacity 6 -> [0, 1, 0]."""
    if isinstance(cu_seqlens, jax.core.Tracer):
        return None
    return np.diff(np.clip(np.maximum.accumulate(np.asarray(cu_seqlens, np.int64)), 0, capacity))


def sanitize_both(cu_seqlens_q: jax.Array, cu_seqlens_kv: jax.Array, config) -> tuple[jax.Array, jax.Array]:
    """Both cu_seqlens clamped into their buffers, once per call: offsets, lengths and masks derive from these."""
    return (
        sanitize_cu_seqlens(cu_seqlens_q, config.capacity_q),
        sanitize_cu_seqlens(cu_seqlens_kv, config.capacity_kv),
    )


def sequence_lengths(cu_seqlens: jax.Array, max_seqlen: int, seqused: jax.Array | None = None) -> jax.Array:
    """Rows of each sequence, capped at max_seqlen (the graph has room for no more) and, when given, at
    seqused (FlashAttention's: sequence b uses only the first seqused[b] rows of its slot
    cu_seqlens[b]:cu_seqlens[b+1]); a negative seqused counts as 0.

    cu_seqlens [0, 4, 4, 9], max_seqlen 8, seqused [2, 3, 9] -> [2, 0, 5]
    """
    lengths = jnp.minimum(jnp.diff(cu_seqlens), max_seqlen).astype(jnp.int32)
    if seqused is None:
        return lengths
    # Not folded as a constant either (see sanitize_cu_seqlens).
    return jnp.clip(jax.lax.optimization_barrier(seqused).astype(jnp.int32), 0, lengths)


def row_positions(cu_seqlens: jax.Array, capacity: int, max_seqlen: int, seqused: jax.Array | None = None):
    """For each of `capacity` rows: (sequence index, position within it, whether it is a real token).

    cu_seqlens = [0, 2, 2, 5], capacity 7, max_seqlen 8:
      sequence = [0, 0, 2, 2, 2, 3, 3]   (3 = past the last sequence)
      position = [0, 1, 0, 1, 2, 0, 1]
      valid    = [T, T, T, T, T, F, F]
    """
    rows = jnp.arange(capacity, dtype=jnp.int32)
    num_seqs = cu_seqlens.shape[0] - 1
    # A row's sequence is how many sequence ends lie at or before it (so zero-length sequences are skipped:
    # row 2 above lies in sequence 2, not the empty sequence 1).
    sequence = count_at_or_before(jnp.clip(cu_seqlens[1:], 0, capacity), capacity)
    clamped = jnp.minimum(sequence, num_seqs - 1)
    position = rows - cu_seqlens[clamped]
    lengths = sequence_lengths(cu_seqlens, max_seqlen, seqused)  # rows past seqused: in the slot, not real
    valid = (sequence < num_seqs) & (position >= 0) & (position < lengths[clamped])
    return sequence, position, valid


def query_rows_with_keys(cu_seqlens_q, cu_seqlens_kv, config, seqused_q=None, seqused_kv=None) -> jax.Array:
    """[Tq] boolean: the row is a real token and attends to at least one key.

    Rows outside it must read out = 0 and stats = -inf whatever a kernel left there: padding rows are never
    written, and a row whose band is empty (causal bottom-right with sq > skv, a narrow window, skv = 0)
    has no softmax to take. Arguments are already sanitised cu_seqlens.
    """
    seq, pos, valid = row_positions(cu_seqlens_q, config.capacity_q, config.max_seqlen_q, seqused_q)
    seq = jnp.minimum(seq, config.num_seqs - 1)
    sq = sequence_lengths(cu_seqlens_q, config.max_seqlen_q, seqused_q)[seq]
    skv = sequence_lengths(cu_seqlens_kv, config.max_seqlen_kv, seqused_kv)[seq]
    diagonal = pos if config.diagonal_alignment == "top_left" else pos + skv - sq
    first, last = jnp.zeros_like(pos), skv - 1
    if config.left_bound is not None:
        first = jnp.maximum(first, diagonal - config.left_bound)
    if config.right_bound is not None:
        last = jnp.minimum(last, diagonal + config.right_bound)
    return valid & (first <= last)


# ---- invalid input: the rows that come out NaN ---------------------------------------------------------------
# One definition of each invalid case, shared by the overflow counts (features/overflow.py) and the NaN rows
# (RaggedIndex.invalid_rows_q, ops/common.loud); check mode and the host warnings (features/checks.py) test
# the same conditions on NumPy values. Malformed cu_seqlens make every row NaN: the clamped offsets then
# describe a different batch, so no row is known to be right. A well-formed cu_seqlens makes a sequence
# invalid where its end runs past the buffer or it holds more than max_seqlen rows.


def out_of_order(cu_seqlens: jax.Array) -> jax.Array:
    """bool [B + 1]: the entry breaks the order (entry 0 is not 0, or it falls below an earlier entry):
    [2, 5, 3, 12] -> [T, F, T, F]. Any such entry makes the whole cu_seqlens malformed."""
    cu_seqlens = jax.lax.optimization_barrier(cu_seqlens)  # not constant-folded (see sanitize_cu_seqlens)
    earlier_max = running_max(cu_seqlens)[:-1]
    return jnp.concatenate([cu_seqlens[:1] != 0, cu_seqlens[1:] < earlier_max])


def invalid_sequences(cu_seqlens: jax.Array, capacity: int, max_seqlen: int, seqused=None) -> jax.Array:
    """bool [B]: sequence b of a well-formed cu_seqlens is invalid: it ends past `capacity` or holds more
    than max_seqlen rows (with seqused, more than max_seqlen used rows). cu_seqlens [0, 7, 9, 14], capacity
    12, max_seqlen 4 -> [T, F, T]."""
    cu_seqlens = jax.lax.optimization_barrier(cu_seqlens)
    lengths = jnp.diff(sanitize_cu_seqlens(cu_seqlens, capacity))
    if seqused is not None:
        lengths = jnp.clip(seqused, 0, lengths)
    return (cu_seqlens[1:] > capacity) | (lengths > max_seqlen)


def rows_of_invalid(sanitized: jax.Array, capacity: int, malformed: jax.Array, invalid: jax.Array) -> jax.Array:
    """bool [capacity]: the row lies in the slot of an invalid sequence (`invalid` [B]) of the sanitised
    cu_seqlens, or `malformed` (a bool scalar) is true. Padding rows past the last slot stay False.
    sanitized [0, 3, 3, 5], capacity 7, invalid [F, F, T] -> [F, F, F, T, T, F, F]."""
    num_seqs = invalid.shape[0]
    sequence = count_at_or_before(sanitized[1:], capacity)  # [capacity]; num_seqs past the last slot
    owned = (sequence < num_seqs) & invalid[jnp.minimum(sequence, num_seqs - 1)]
    return malformed | owned


def as_int32(x, name: str):
    """`x` as int32 (a NumPy array stays a NumPy array, a jax value a jax value); see the module docstring."""
    if isinstance(x, (list, tuple)):
        try:
            x = np.asarray(x)
        except ValueError:
            raise ValueError(f"{name} must be an integer array, got a ragged {type(x).__name__}") from None
    dtype = getattr(x, "dtype", None)
    if dtype is None or getattr(x, "shape", None) is None:
        raise ValueError(f"{name} must be an integer array, got {type(x).__name__}")
    if dtype == np.int32:
        return x
    if not np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        raise ValueError(f"{name} must have an integer dtype (any width; it is converted to int32), got {dtype}")
    if isinstance(x, np.ndarray):
        outside = (x < _INT32.min) | (x > _INT32.max)
        if outside.any():
            at = tuple(int(i) for i in np.argwhere(outside)[0])
            where = at[0] if len(at) == 1 else at
            raise ValueError(
                f"{name}[{where}] = {x[at]} does not fit int32 (the kernels' index type); "
                f"{name} must hold values in [{_INT32.min}, {_INT32.max}]"
            )
        return x.astype(np.int32)
    return _clip_to_int32(x)


def _clip_to_int32(x):
    info = jnp.iinfo(x.dtype)
    if info.min >= _INT32.min and info.max <= _INT32.max:  # int8/16, uint8/16: every value fits
        return x.astype(jnp.int32)
    # Clip in x's own dtype (its bounds expressed in it), so no value wraps before the cast.
    low = np.array(max(info.min, _INT32.min), x.dtype)
    high = np.array(min(info.max, _INT32.max), x.dtype)
    return jax.lax.clamp(low, x, high).astype(jnp.int32)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["cu_seqlens_q", "cu_seqlens_kv", "seqused_q", "seqused_kv"],
    meta_fields=["same"],
)
@dataclasses.dataclass(frozen=True)
class RaggedIndex:
    """The index arrays of one call, as the caller passed them (int32; checked ones in check mode), and what
    derives from them, computed the first time a feature or backend asks and then shared.

    `same`: one array serves as both cu_seqlens (qkv-packed, segments): checked and counted once, and a
    bottom-right mask over it is the top-left one. A pytree (the arrays are leaves), so it crosses jit and
    custom_vjp boundaries; the derived values are recomputed on the other side.
    """

    cu_seqlens_q: jax.Array
    cu_seqlens_kv: jax.Array
    seqused_q: jax.Array | None = None
    seqused_kv: jax.Array | None = None
    same: bool = False

    @property
    def seqused(self) -> tuple:
        return self.seqused_q, self.seqused_kv

    def replace(self, **changes) -> RaggedIndex:
        return dataclasses.replace(self, **changes)

    def _memo(self, key, compute):
        memo = self.__dict__.setdefault("_derived", {})  # not a field: never flattened, never compared
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def sanitized(self, config) -> tuple[jax.Array, jax.Array]:
        """(cu_seqlens_q, cu_seqlens_kv) clamped monotone into their buffers (sanitize_cu_seqlens)."""
        return self._memo(
            ("sanitized", config.capacity_q, config.capacity_kv),
            lambda: sanitize_both(self.cu_seqlens_q, self.cu_seqlens_kv, config),
        )

    def real_rows_q(self, config) -> jax.Array:
        """[Tq] bool: the query row is a real token (row_positions' valid)."""
        return self._memo(
            ("real_q", config.capacity_q, config.max_seqlen_q),
            lambda: row_positions(self.sanitized(config)[0], config.capacity_q, config.max_seqlen_q, self.seqused_q)[2],
        )

    def rows_with_keys(self, config) -> jax.Array:
        """[Tq] bool: the query row is real and its band holds at least one key (query_rows_with_keys)."""
        key = (
            "keys",
            config.capacity_q,
            config.capacity_kv,
            config.max_seqlen_q,
            config.max_seqlen_kv,
            config.diagonal_alignment,
            config.left_bound,
            config.right_bound,
        )
        return self._memo(key, lambda: query_rows_with_keys(*self.sanitized(config), config, *self.seqused))

    def invalid_rows_q(self, config) -> jax.Array:
        """[Tq] bool: the query row comes out NaN (see "invalid input" above): every row when either
        cu_seqlens is malformed, else the rows of each sequence invalid on the q or the kv side."""

        def compute():
            cu_q, cu_kv = self.cu_seqlens_q, self.cu_seqlens_kv
            malformed = jnp.any(out_of_order(cu_q)) | jnp.any(out_of_order(cu_kv))
            invalid = invalid_sequences(cu_q, config.capacity_q, config.max_seqlen_q, self.seqused_q)
            invalid = invalid | invalid_sequences(cu_kv, config.capacity_kv, config.max_seqlen_kv, self.seqused_kv)
            return rows_of_invalid(self.sanitized(config)[0], config.capacity_q, malformed, invalid)

        key = ("invalid_q", config.capacity_q, config.capacity_kv, config.max_seqlen_q, config.max_seqlen_kv)
        return self._memo(key, compute)
