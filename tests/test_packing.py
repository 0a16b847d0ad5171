"""Row bookkeeping shared by both paths, against a plain NumPy statement of the same thing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import index
from jax_ragged_attn.index import cu_seqlens_from_lengths, row_positions, sanitize_cu_seqlens


@pytest.fixture(params=["compare_all", "scan"])
def scan_kind(request, monkeypatch):
    """Both ways index/__init__.py counts and takes running maxima: every pair compared (small batches) and the
    linear-work scans (past COMPARE_ALL_LIMIT)."""
    if request.param == "scan":
        monkeypatch.setattr(index, "COMPARE_ALL_LIMIT", 0)
    # JAX caches a function's trace across jit wrappers: without this, a scan case reuses the compare-all case's
    # trace of the same shapes and never runs the scans.
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def _expected(cu: np.ndarray, capacity: int, max_seqlen: int):
    rows = np.arange(capacity)
    sequence = np.searchsorted(cu[1:], rows, side="right")
    clamped = np.minimum(sequence, len(cu) - 2)
    position = rows - cu[clamped]
    lengths = np.minimum(np.diff(cu), max_seqlen)
    valid = (sequence < len(cu) - 1) & (position >= 0) & (position < lengths[clamped])
    return sequence, position, valid


@pytest.mark.parametrize("seed", range(20))
def test_row_positions_match_a_binary_search(seed, scan_kind):
    rng = np.random.default_rng(seed)
    num_seqs = int(rng.integers(1, 12))
    lengths = np.where(rng.random(num_seqs) < 0.3, 0, rng.integers(0, 9, num_seqs))
    slack = int(rng.integers(0, 5))
    capacity = max(int(lengths.sum()) + slack, 1)
    max_seqlen = int(rng.integers(1, 10))
    cu = cu_seqlens_from_lengths(lengths)
    got = jax.jit(row_positions, static_argnums=(1, 2))(jnp.asarray(cu), capacity, max_seqlen)
    for name, a, b in zip(("sequence", "position", "valid"), got, _expected(cu, capacity, max_seqlen)):
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=f"{name}: cu={cu.tolist()} capacity={capacity}")


@pytest.mark.parametrize("seed", range(8))
def test_sanitize_cu_seqlens_of_garbage_matches_numpy(seed, scan_kind):
    """Any int32 values, extremes included, come out monotone and inside [0, capacity]."""
    rng = np.random.default_rng(seed)
    n, capacity = int(rng.integers(1, 40)), int(rng.integers(1, 50))
    cu = rng.integers(-60, 60, n).astype(np.int32)
    cu[rng.random(n) < 0.1] = np.iinfo(np.int32).min
    cu[rng.random(n) < 0.1] = np.iinfo(np.int32).max
    got = jax.jit(sanitize_cu_seqlens, static_argnums=1)(jnp.asarray(cu), capacity)
    expected = np.clip(np.maximum.accumulate(cu.astype(np.int64)), 0, capacity)
    np.testing.assert_array_equal(np.asarray(got), expected, err_msg=f"cu={cu.tolist()} capacity={capacity}")


def test_row_positions_of_sanitised_garbage_and_under_vmap(scan_kind):
    capacity = 6
    cus = jnp.asarray([[5, 2, 9, 4], [0, 3, 3, 6], [0, 0, 0, 0]], jnp.int32)
    clean = jax.vmap(lambda cu: sanitize_cu_seqlens(cu, capacity))(cus)
    got = jax.vmap(lambda cu: row_positions(cu, capacity, 4))(clean)
    for i, cu in enumerate(np.asarray(clean)):
        for a, b in zip(got, _expected(cu, capacity, 4)):
            np.testing.assert_array_equal(np.asarray(a[i]), b)


@pytest.mark.parametrize("seed", range(12))
def test_row_positions_of_constant_cu_seqlens_under_jit(seed):
    """cu_seqlens a jitted function closes over are constants XLA may fold: on the GPU XLA folded
    [0, 1] (capacity 2) through sanitize_cu_seqlens and row_positions to sequence [1, 1], making the real
    row padding (sanitize_cu_seqlens' optimization barrier prevents it). Runs on every backend."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, int(rng.integers(1, 4))) if seed else np.asarray([1])
    capacity, max_seqlen = int(lengths.sum()) + int(rng.integers(0, 3)) or 1, int(rng.integers(1, 5))
    cu = jnp.asarray(cu_seqlens_from_lengths(lengths))
    got = jax.jit(lambda: row_positions(sanitize_cu_seqlens(cu, capacity), capacity, max_seqlen))()
    for name, a, b in zip(("sequence", "position", "valid"), got, _expected(np.asarray(cu), capacity, max_seqlen)):
        np.testing.assert_array_equal(
            np.asarray(a), b, err_msg=f"{name}: cu={np.asarray(cu).tolist()} capacity={capacity}"
        )


def test_running_max_of_int64_beyond_int32(scan_kind):
    """Under jax_enable_x64 an index array may be int64 below int32's range: the running maximum is still
    lax.cummax's (the compare-all path fills masked entries with the dtype's own minimum)."""
    with jax.enable_x64(True):
        x = jnp.asarray(np.array([-(2**40), -(2**40), 5, -(2**41), 7], np.int64))
        np.testing.assert_array_equal(np.asarray(index.running_max(x)), np.asarray(jax.lax.cummax(x, axis=0)))


@pytest.mark.parametrize("seed", range(6))
def test_host_slots_are_the_device_sanitising_on_the_host(seed):
    """index.host_slots (trace-time proofs: FA3's top-left mask, dew's layout, the append check's counts) sees the
    slots sanitize_cu_seqlens makes on the device, garbage included; a traced cu_seqlens gives None."""
    rng = np.random.default_rng(seed)
    cu = rng.integers(-20, 60, int(rng.integers(1, 12))).astype(np.int32)
    capacity = int(rng.integers(1, 50))
    device = np.diff(np.asarray(sanitize_cu_seqlens(jnp.asarray(cu), capacity)))
    np.testing.assert_array_equal(index.host_slots(cu, capacity), device, err_msg=f"cu={cu.tolist()}")
    assert jax.jit(lambda c: jnp.int32(index.host_slots(c, capacity) is None))(jnp.asarray(cu)) == 1
