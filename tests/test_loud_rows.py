"""Invalid index input with check off (the default) and device arrays: the rows it concerns come out NaN.

Each case of docs/API.md's "Input that does not fit" table runs under jax.jit on the xla path and on
FlashAttention-3's wrapper with its CPU stand-in kernels (testing/fa3_emulator.py for ragged_attention,
the xla path with FA3's masks for the KV cache, as test_kvcache.py runs it). Each asserts NaN exactly on
the invalid sequence's query rows (out and stats), every other row bit for bit what the same call gives
with that sequence made valid, the overflow counted, and jax.debug_nans stopping the call.
"""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kvcache_varlen import _fa3_tile_stand_in  # tests/ is on sys.path under pytest

from jax_ragged_attn import flash_attn_varlen_func, ragged_attention, ragged_attention_with_kvcache
from jax_ragged_attn.backends.fa3 import kvcache as fa3_kvcache
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.inputs.packed import ragged_attention_qkvpacked
from jax_ragged_attn.inputs.segments import ragged_attention_segments
from jax_ragged_attn.ops import common
from jax_ragged_attn.testing import fa3_emulator

T_Q, T_KV, HEADS, DIM = 12, 12, 2, 128  # FlashAttention-3's head dim
MAX_Q, MAX_KV = 4, 5


@dataclasses.dataclass(frozen=True)
class Case:
    """An invalid call and the same call made valid: NaN rows [start, stop) in the first, and every other
    row of both equal bit for bit; `counts` the Overflow's first three fields."""

    cu_q: tuple[int, ...]
    cu_kv: tuple[int, ...]
    valid_cu_q: tuple[int, ...]
    valid_cu_kv: tuple[int, ...]
    nan_rows: tuple[int, int]
    counts: tuple[int, int, int]


# Sequences 0 and 1 stay valid; sequence 2 (rows 5..) is the one made invalid.
VALID_Q, VALID_KV = (0, 3, 5, 9), (0, 4, 7, 11)
CASES = {
    "q_past_max_seqlen_q": Case((0, 3, 5, 11), VALID_KV, (0, 3, 5, 9), VALID_KV, (5, 11), (2, 0, 0)),
    "kv_past_max_seqlen_kv": Case(VALID_Q, (0, 4, 6, 12), VALID_Q, (0, 4, 6, 11), (5, 9), (0, 1, 0)),
    "q_past_T": Case((0, 3, 5, 15), VALID_KV, (0, 3, 5, 9), VALID_KV, (5, T_Q), (3, 0, 1)),
    "kv_past_T": Case(VALID_Q, (0, 4, 7, 14), VALID_Q, (0, 4, 7, 11), (5, 9), (0, 0, 1)),
    # Malformed: every row, padding included.
    "q_without_leading_0": Case((1, 3, 5, 9), VALID_KV, VALID_Q, VALID_KV, (0, T_Q), (0, 0, 1)),
    "kv_decreasing": Case(VALID_Q, (0, 4, 3, 11), VALID_Q, VALID_KV, (0, T_Q), (0, 2, 1)),
}


def _inputs(seed=0, dtype=jnp.bfloat16):
    """q, k, v in a dtype both paths serve (FlashAttention-3: bfloat16 or float16)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((T_Q, HEADS, DIM)), dtype)
    k = jnp.asarray(rng.standard_normal((T_KV, HEADS, DIM)), dtype)
    v = jnp.asarray(rng.standard_normal((T_KV, HEADS, DIM)), dtype)
    return q, k, v


@pytest.fixture(params=["xla", "fa3_emulated"])
def implementation(request):
    if request.param == "xla":
        yield "xla"
    else:
        with fa3_emulator.patched():
            yield "fa3"


def _ragged(implementation, **options):
    q, k, v = _inputs()

    @jax.jit
    def f(cu_q, cu_kv):
        return ragged_attention(
            q,
            k,
            v,
            cu_q,
            cu_kv,
            max_seqlen_q=MAX_Q,
            max_seqlen_kv=MAX_KV,
            implementation=implementation,
            return_stats=True,
            stats_layout="token_major",
            **options,
        )

    return f


def _cu(values):
    return jnp.asarray(values, jnp.int32)


def _nan_mask(rows, capacity):
    mask = np.zeros(capacity, bool)
    mask[slice(*rows)] = True
    return mask


def _assert_loud(out, stats, valid_out, valid_stats, nan_rows):
    """NaN exactly on the rows `nan_rows` marks (every element of them), the others bit for bit the valid call's."""
    out, stats, valid_out, valid_stats = (np.asarray(x, np.float32) for x in (out, stats, valid_out, valid_stats))
    assert np.isnan(out[nan_rows]).all() and np.isnan(stats[nan_rows]).all()
    assert not np.isnan(out[~nan_rows]).any() and not np.isnan(stats[~nan_rows]).any()
    np.testing.assert_array_equal(out[~nan_rows], valid_out[~nan_rows])
    np.testing.assert_array_equal(stats[~nan_rows], valid_stats[~nan_rows])


@pytest.mark.parametrize("case_name", CASES)
def test_ragged_attention_rows_of_an_invalid_sequence_are_nan(implementation, case_name):
    case = CASES[case_name]
    f = _ragged(implementation, return_overflow=True)
    out, stats, overflow = f(_cu(case.cu_q), _cu(case.cu_kv))
    valid_out, valid_stats, valid_overflow = f(_cu(case.valid_cu_q), _cu(case.valid_cu_kv))
    _assert_loud(out, stats, valid_out, valid_stats, _nan_mask(case.nan_rows, T_Q))
    assert [int(x) for x in overflow[:3]] == list(case.counts)
    assert [int(x) for x in valid_overflow] == [0, 0, 0, 0]
    valid_cu = np.asarray(case.valid_cu_q)
    if case.nan_rows[1] - case.nan_rows[0] < T_Q:  # padding past the last sequence stays exactly 0
        assert np.all(np.asarray(out)[max(valid_cu[-1], case.nan_rows[1]) :] == 0)


def test_valid_rows_are_unchanged_by_the_select(implementation):
    """Valid input: the result is the backend's (bit for bit from a kernel), and padding rows read exactly 0."""
    f = _ragged(implementation)
    out, stats = f(_cu(VALID_Q), _cu(VALID_KV))
    assert np.all(np.asarray(out)[VALID_Q[-1] :] == 0) and np.isfinite(np.asarray(out)).all()
    with mock.patch.object(common, "loud", lambda out, stats, rows, layout: (out, stats)):
        plain_out, plain_stats = _ragged(implementation)(_cu(VALID_Q), _cu(VALID_KV))
    if implementation == "xla":
        # The select joins the portable path's own XLA program, which XLA may fuse differently with it: the same
        # values within a few roundings of their dtype. A kernel's result reaches the select as a finished buffer.
        for got, want in ((out, plain_out), (stats, plain_stats)):
            eps = float(jnp.finfo(got.dtype).eps)
            np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=4 * eps, atol=0)
    else:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(plain_out))
        np.testing.assert_array_equal(np.asarray(stats), np.asarray(plain_stats))


@pytest.mark.parametrize("case_name", ["q_past_max_seqlen_q", "kv_decreasing"])
def test_debug_nans_catches_an_invalid_sequence(case_name):
    case = CASES[case_name]
    f = _ragged("xla")
    with jax.debug_nans(True):
        jax.block_until_ready(f(_cu(VALID_Q), _cu(VALID_KV)))  # valid input: no NaN anywhere
        with pytest.raises(FloatingPointError):
            jax.block_until_ready(f(_cu(case.cu_q), _cu(case.cu_kv)))


def test_debug_nans_stays_quiet_on_valid_eager_calls_and_catches_invalid_ones():
    """Eagerly every operation is checked on its own: the NaN fill must not trip it where no row is invalid."""
    q, k, v = _inputs()

    def call(cu_q):
        return ragged_attention(
            q, k, v, cu_q, _cu(VALID_KV), max_seqlen_q=MAX_Q, max_seqlen_kv=MAX_KV, implementation="xla"
        )

    with jax.debug_nans(True):
        assert np.isfinite(np.asarray(call(_cu(VALID_Q)), np.float32)).all()
        with pytest.raises(FloatingPointError):
            call(_cu(CASES["q_past_T"].cu_q))


def test_the_loss_is_nan_and_the_backward_runs(implementation):
    q, k, v = _inputs()
    case = CASES["q_past_max_seqlen_q"]

    @jax.jit
    def loss(q, k, v, cu_q, cu_kv):
        out = ragged_attention(
            q, k, v, cu_q, cu_kv, max_seqlen_q=MAX_Q, max_seqlen_kv=MAX_KV, implementation=implementation
        )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, _cu(case.cu_q), _cu(case.cu_kv))
    assert np.isnan(float(value))
    assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))


# ---- the other entry points of ragged_attention ------------------------------------------------------------


def test_qkvpacked_sequence_past_max_seqlen_is_nan():
    q, k, v = _inputs()
    qkv = jnp.stack([q, k, v], axis=1)  # [T, 3, H, D]
    f = jax.jit(lambda cu: ragged_attention_qkvpacked(qkv, cu, max_seqlen=MAX_Q, implementation="xla"))
    out, valid = f(_cu((0, 3, 5, 11))), f(_cu((0, 3, 5, 9)))
    nan = _nan_mask((5, 11), T_Q)
    assert np.isnan(np.asarray(out)[nan]).all() and not np.isnan(np.asarray(out)[~nan]).any()
    np.testing.assert_array_equal(np.asarray(out)[:5], np.asarray(valid)[:5])


def test_segment_longer_than_max_seqlen_is_nan():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 6, HEADS, DIM)), jnp.float32)
    ids = jnp.asarray([[1, 1, 2, 2, 2, 2], [3, 3, 3, 0, 0, 0]], jnp.int32)  # segment 2: 4 tokens
    f = jax.jit(
        lambda ids, m: ragged_attention_segments(x, x, x, ids, max_seqlen=m, max_segments=4, implementation="xla"),
        static_argnums=1,
    )
    out = np.asarray(f(ids, 3))
    assert np.isnan(out[0, 2:]).all() and not np.isnan(out[0, :2]).any() and not np.isnan(out[1]).any()
    assert np.all(out[1, 3:] == 0)  # padding


def test_flash_attn_varlen_func_sequence_past_T_is_nan():
    q, k, v = _inputs()
    f = jax.jit(lambda cu: flash_attn_varlen_func(q, k, v, cu, cu, MAX_Q, MAX_Q))
    out = np.asarray(f(_cu((0, 3, 5, 14))))
    assert np.isnan(out[5:]).all() and not np.isnan(out[:5]).any()


# ---- ragged_attention_with_kvcache ---------------------------------------------------------------------------

B, PAGE, NUM_PAGES, MAX_PAGES = 3, 4, 7, 2  # capacity 8 rows a sequence
VALID_LENGTHS, VALID_TABLE = (5, 3, 8), ((0, 1), (2, 3), (4, 5))


@pytest.fixture(params=["xla", "fa3_stand_in"])
def cache_implementation(request):
    if request.param == "xla":
        yield "xla"
        return
    patches = [
        mock.patch.object(fa3_kvcache, "_fa3_call", _fa3_tile_stand_in),
        mock.patch.object(_fa3, "unavailable_reason", lambda: None),
        mock.patch.object(_fa3, "FA3_DTYPES", ("float32",)),
        mock.patch.object(_fa3, "FA3_HEAD_DIM", DIM),
    ]
    for patch in patches:
        patch.start()
    yield "fa3"
    for patch in patches:
        patch.stop()


def _cache(seed=2):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((NUM_PAGES, PAGE, HEADS, DIM)), jnp.float32)


@functools.cache
def _decode(implementation):
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((B, 1, HEADS, DIM)), jnp.float32)
    cache = _cache()

    @jax.jit
    def f(lengths, table):
        return ragged_attention_with_kvcache(
            q,
            cache,
            cache,
            lengths,
            page_table=table,
            return_stats=True,
            stats_layout="token_major",
            implementation=implementation,
            return_overflow=True,
        )

    return f


CACHE_CASES = {
    "cache_seqlens_past_capacity": ((5, 3, 9), VALID_TABLE, 2, 1),
    "cache_seqlens_negative": ((5, -1, 8), VALID_TABLE, 1, 1),
    "page_entry_99": ((5, 3, 8), ((0, 1), (2, 3), (4, 99)), 2, 1),
    "page_entry_minus_1_used": ((5, 3, 8), ((0, -1), (2, 3), (4, 5)), 0, 1),
}


@pytest.mark.parametrize("case_name", CACHE_CASES)
def test_kvcache_rows_of_an_invalid_sequence_are_nan(cache_implementation, case_name):
    lengths, table, bad, count = CACHE_CASES[case_name]
    f = _decode(cache_implementation)
    out, stats, overflow = f(_cu(lengths), _cu(table))
    valid_out, valid_stats, valid_overflow = f(_cu(VALID_LENGTHS), _cu(VALID_TABLE))
    nan = np.arange(B) == bad
    _assert_loud(out, stats, valid_out, valid_stats, nan)
    assert int(overflow.invalid_cu_seqlens) == count and int(valid_overflow.invalid_cu_seqlens) == 0


def test_kvcache_unused_entry_may_be_anything(cache_implementation):
    """-1 for an unallocated page a sequence does not use is valid: no NaN."""
    out, stats, overflow = _decode(cache_implementation)(_cu((4, 3, 8)), _cu(((0, -1), (2, -1), (4, 5))))
    assert np.isfinite(np.asarray(out)).all() and int(overflow.invalid_cu_seqlens) == 0


def test_kvcache_debug_nans_catches_an_invalid_page_entry():
    f = _decode("xla")
    with jax.debug_nans(True):
        jax.block_until_ready(f(_cu(VALID_LENGTHS), _cu(VALID_TABLE)))
        with pytest.raises(FloatingPointError):
            jax.block_until_ready(f(_cu(VALID_LENGTHS), _cu(((0, 1), (2, 3), (4, 99)))))


T_PACKED = 8


@functools.cache
def _packed(implementation):
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((T_PACKED, HEADS, DIM)), jnp.float32)
    cache = _cache()

    @jax.jit
    def f(cu, lengths):
        return ragged_attention_with_kvcache(
            q,
            cache,
            cache,
            lengths,
            cu_seqlens_q=cu,
            max_seqlen_q=3,
            page_table=_cu(VALID_TABLE),
            return_stats=True,
            stats_layout="token_major",
            implementation=implementation,
            return_overflow=True,
        )

    return f


PACKED_CASES = {
    # A prefill chunk of 5 queries with max_seqlen_q 3 (sequence 2, rows 3..7).
    "chunk_past_max_seqlen_q": ((0, 1, 3, 8), (0, 1, 3, 3), (3, 8), (2, 0)),
    "cu_seqlens_q_past_T": ((0, 1, 3, 9), (0, 1, 3, 3), (3, T_PACKED), (2, 1)),
    "cu_seqlens_q_without_leading_0": ((1, 1, 3, 4), (0, 1, 3, 4), (0, T_PACKED), (0, 1)),
    "cache_seqlens_past_capacity": ((0, 1, 3, 5), (0, 1, 3, 5), (1, 3), (0, 1)),
}


@pytest.mark.parametrize("case_name", PACKED_CASES)
def test_packed_kvcache_rows_of_an_invalid_sequence_are_nan(cache_implementation, case_name):
    cu, valid_cu, nan_rows, (truncated, invalid) = PACKED_CASES[case_name]
    lengths = (5, 9, 8) if case_name == "cache_seqlens_past_capacity" else VALID_LENGTHS
    f = _packed(cache_implementation)
    out, stats, overflow = f(_cu(cu), _cu(lengths))
    valid_out, valid_stats, _ = f(_cu(valid_cu), _cu(VALID_LENGTHS))
    _assert_loud(out, stats, valid_out, valid_stats, _nan_mask(nan_rows, T_PACKED))
    assert (int(overflow.truncated_rows_q), int(overflow.invalid_cu_seqlens)) == (truncated, invalid)
