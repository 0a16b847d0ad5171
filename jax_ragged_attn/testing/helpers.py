"""Packed random batches and dtype-derived tolerances, shared by the tests, the benchmarks and the demo."""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.index import cu_seqlens_from_lengths


def random_lengths(rng: np.random.Generator, num_seqs: int, low: int, high: int, *, zero_at=()) -> tuple[int, ...]:
    """num_seqs lengths drawn uniformly from [low, high], then forced to 0 at the indices in zero_at.

    zero_at puts empty sequences exactly where a test wants them (first, middle, last), since a uniform
    draw would rarely hit both ends.
    """
    lengths = rng.integers(low, high, size=num_seqs, endpoint=True)
    for index in zero_at:
        lengths[index] = 0
    return tuple(int(n) for n in lengths)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedBatch:
    """One packed batch: jax inputs for the op, float64 NumPy copies of the same values for the reference.

    q64/k64/v64 hold exactly the values of q/k/v after rounding to their dtype, so the reference sees the
    op's inputs and the comparison measures only the op's arithmetic. Padding rows (from cu[-1] up to the
    capacity) hold the poison value in both copies.
    """

    q: jnp.ndarray  # [Tq, Hq, Dqk]
    k: jnp.ndarray  # [Tkv, Hkv, Dqk]
    v: jnp.ndarray  # [Tkv, Hkv, Dv]
    cu_seqlens_q: jnp.ndarray  # [B + 1] int32
    cu_seqlens_kv: jnp.ndarray
    max_seqlen_q: int
    max_seqlen_kv: int
    q64: np.ndarray
    k64: np.ndarray
    v64: np.ndarray
    seqlens_q: tuple[int, ...]
    seqlens_kv: tuple[int, ...]

    @property
    def args(self) -> tuple:
        """The positional arguments of `ragged_attention`."""
        return self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_kv

    @property
    def reference_args(self) -> tuple:
        """The positional arguments of `reference_attention`, in float64."""
        return self.q64, self.k64, self.v64, np.asarray(self.cu_seqlens_q), np.asarray(self.cu_seqlens_kv)

    @property
    def padding_q(self) -> np.ndarray:
        """[Tq] bool: rows past the last query sequence."""
        return np.arange(self.q.shape[0]) >= sum(self.seqlens_q)

    @property
    def padding_kv(self) -> np.ndarray:
        """[Tkv] bool: rows past the last key sequence."""
        return np.arange(self.k.shape[0]) >= sum(self.seqlens_kv)


def _packed(rng, rows: int, heads: int, dim: int, capacity: int, dtype, poison):
    values = rng.standard_normal((capacity, heads, dim)).astype(dtype)
    values[rows:] = poison
    return jnp.asarray(values), values.astype(np.float64)


def packed_batch(
    rng: np.random.Generator,
    seqlens_q,
    seqlens_kv,
    *,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim_qk: int,
    head_dim_v: int,
    dtype,
    slack_q: int = 0,
    slack_kv: int = 0,
    poison=np.nan,
) -> PackedBatch:
    """Standard normal q, k, v packed back to back, with slack_q / slack_kv poisoned rows of capacity padding."""
    seqlens_q, seqlens_kv = tuple(map(int, seqlens_q)), tuple(map(int, seqlens_kv))
    if len(seqlens_q) != len(seqlens_kv):
        raise ValueError(
            f"seqlens_q and seqlens_kv must name the same number of sequences, got "
            f"{len(seqlens_q)} and {len(seqlens_kv)}"
        )
    total_q, total_kv = sum(seqlens_q), sum(seqlens_kv)
    dtype = np.dtype(dtype)
    q, q64 = _packed(rng, total_q, num_heads_q, head_dim_qk, total_q + slack_q, dtype, poison)
    k, k64 = _packed(rng, total_kv, num_heads_kv, head_dim_qk, total_kv + slack_kv, dtype, poison)
    v, v64 = _packed(rng, total_kv, num_heads_kv, head_dim_v, total_kv + slack_kv, dtype, poison)
    return PackedBatch(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=jnp.asarray(cu_seqlens_from_lengths(seqlens_q)),
        cu_seqlens_kv=jnp.asarray(cu_seqlens_from_lengths(seqlens_kv)),
        # max_seqlen must be >= 1 even when every sequence is empty.
        max_seqlen_q=max(max(seqlens_q, default=0), 1),
        max_seqlen_kv=max(max(seqlens_kv, default=0), 1),
        q64=q64,
        k64=k64,
        v64=v64,
        seqlens_q=seqlens_q,
        seqlens_kv=seqlens_kv,
    )


# How many units of the dtype's epsilon a result may be off by, relative to the size of the values compared.
# bfloat16 / float16: the inputs are exact (the reference reads the same rounded values), so the error is
# the roundings a fused kernel makes on the way: p and dS rounded to the dtype before their matmuls (each
# term off by eps/2, so a convex combination of O(1) values is off by about eps/2 times their largest,
# which for standard normal inputs is a few units), and the result rounded once more on the way out. 8 eps
# covers that with room; it is loose on purpose, so that a fused kernel passes the same tests.
# float32: rounding to the output is negligible; what is left is float32 accumulation over reductions of a
# few hundred terms (up to about sqrt(n) eps) and exp() turning an absolute error in O(10) logits into a
# relative one, hence a larger multiple of a much smaller eps.
_EPS_MULTIPLE = {"float32": 32, "float16": 8, "bfloat16": 8}


def tolerance(dtype) -> tuple[float, float]:
    """(atol, rtol) for comparing a result computed from `dtype` inputs with the float64 reference.

    Both are the same multiple of finfo(dtype).eps: float32 32 eps (about 3.8e-6), float16 8 eps
    (about 7.8e-3), bfloat16 8 eps (about 6.3e-2). atol is meant to be scaled by the size of the values
    compared (see `assert_close`) so that large gradients are not held to a bound meant for O(1) values.
    """
    dtype = np.dtype(dtype)
    eps = float(jnp.finfo(dtype).eps)
    tol = _EPS_MULTIPLE[dtype.name] * eps
    return tol, tol


def assert_close(actual, expected, dtype, what: str) -> None:
    """Asserts |actual - expected| <= atol * max(1, max|expected|) + rtol * |expected| everywhere.

    Scaling atol by the largest expected magnitude keeps one bound meaningful for outputs near 1 and for
    gradients that sum many terms: an element's rounding error follows the size of the terms that made it,
    not its own (possibly cancelled) size. -inf must match exactly; NaN never passes.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    infinite = np.isinf(expected)
    mismatched_inf = infinite & (actual != expected)
    assert not mismatched_inf.any(), (
        f"{what}: {int(mismatched_inf.sum())} entries should be {expected[mismatched_inf][0]}, e.g. at "
        f"{tuple(int(i) for i in np.argwhere(mismatched_inf)[0])} got {actual[mismatched_inf][0]}"
    )
    finite = ~infinite
    atol, rtol = tolerance(dtype)
    scale = max(1.0, float(np.abs(expected[finite]).max(initial=0.0)))
    error = np.abs(np.where(finite, actual, 0.0) - np.where(finite, expected, 0.0))
    bound = atol * scale + rtol * np.abs(np.where(finite, expected, 0.0))
    bad = ~(error <= bound)  # NaN in actual fails here
    if bad.any():
        worst = np.unravel_index(
            np.argmax(np.where(bad, np.nan_to_num(error, nan=np.inf) - bound, -np.inf)), error.shape
        )
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} entries off by more than atol={atol:.3g} * {scale:.3g} + "
            f"rtol={rtol:.3g} * |expected| ({np.dtype(dtype).name}); worst at {tuple(int(i) for i in worst)}: "
            f"got {actual[worst]}, expected {expected[worst]}"
        )


def stand_in_handler_args(args: tuple, result_types: tuple, aliases: dict | None, attributes: dict):
    """(inputs + index arrays, workspace, initial results) of a call a CPU stand-in for the FFI handlers
    receives, from the call's input_output_aliases and attributes (cudnn._launch): no aliases, and the
    stand-in gets a fresh workspace and NaN results, like uninitialised memory, or zeros where the
    zero_outputs attribute asks the handler to zero the rows it does not own (whole outputs, or the unowned
    rows, which a stand-in that writes every row it owns cannot tell apart; "poisoned" NaN in owned rows
    checks cuDNN's writes and is for the GPU); one initial buffer per result but the workspace (the split
    bottom-right backward's second call, launch._backward_into), and a fresh workspace; or check mode's
    workspace then one per result."""
    num_results = len(result_types) - 1
    if not aliases:
        workspace = jnp.zeros(result_types[-1].shape, jnp.uint8)
        fill = 0 if int(attributes.get("zero_outputs", 0)) else jnp.nan
        return args, workspace, [jnp.full(t.shape, fill, t.dtype) for t in result_types[:-1]]
    if num_results in aliases.values():  # the workspace (the last result) comes in too
        return args[: -num_results - 1], args[-num_results - 1], args[-num_results:]
    return args[:-num_results], jnp.zeros(result_types[-1].shape, jnp.uint8), args[-num_results:]


class SeededCacheCase:
    """A mixin for the KV-cache test bases: a generator seeded by the test's id (fresh inputs per test, the same
    ones on a rerun, so a failure reproduces), and the cache capacity of the base's page_size x max_pages."""

    page_size: int
    max_pages: int

    def setUp(self):
        super().setUp()
        self.rng = np.random.default_rng(zlib.crc32(self.id().encode()))

    @property
    def capacity(self) -> int:
        return self.max_pages * self.page_size


def implementation_options(name: str) -> dict:
    """The op's keywords that run a test's backend label: an FA3 provider's name ("dew-flash-attn",
    "flash-attn3-jax") is implementation="fa3" with that provider, any other label the implementation so named."""
    from jax_ragged_attn.config import FA3_PROVIDERS

    return dict(implementation="fa3", fa3_provider=name) if name in FA3_PROVIDERS else dict(implementation=name)
