"""backends/shared/cache_index.safe_cache_index: a KV cache's lengths clamped into [0, capacity] and its page
table's entries outside [0, num_pages) replaced by page 0, what FA3's kvcache kernel (which reads both without
bounds) is given. On a GPU one launch of the extension's kernel (ffi/own_kernels.cu), elsewhere two jnp
expressions; both bit for bit against NumPy on garbage, and the op layer hands FA3 the safe pair."""

from __future__ import annotations

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_configs import decode_config  # tests/ is on sys.path under pytest

from jax_ragged_attn.backends.shared import cache_index

INT32 = np.iinfo(np.int32)
CONFIG = decode_config(
    batch=5,
    num_heads_q=4,
    head_dim_qk=16,
    head_dim_v=16,
    dtype="float32",
    page_size=4,
    num_pages=9,
    max_pages=3,
    scale=1.0,
)  # capacity 12


def _garbage(rng, batch=5, pages=3):
    """Lengths and entries in range, at and past both ends, and the int32 extremes."""
    lengths = np.array([0, 12, 13, -1, INT32.max][:batch] + list(rng.integers(-20, 30, max(0, batch - 5))), np.int32)
    table = rng.integers(-12, 20, (batch, pages)).astype(np.int32)
    table.flat[:4] = [INT32.min, INT32.max, 8, 9][: table.size]
    return lengths, table


def _expected(lengths, table, config):
    return (
        np.clip(lengths.astype(np.int64), 0, config.capacity).astype(np.int32),
        np.where((table >= 0) & (table < config.num_pages), table, 0).astype(np.int32),
    )


def test_clamps_match_numpy():
    lengths, table = _garbage(np.random.default_rng(0))
    got = jax.jit(lambda n, t: cache_index.safe_cache_index(n, t, CONFIG))(lengths, table)
    for array, want in zip(got, _expected(lengths, table, CONFIG)):
        assert array.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(array), want)


def test_vmap_serves_batched_and_unbatched_arguments():
    rng = np.random.default_rng(1)
    stacked = [_garbage(rng) for _ in range(3)]
    lengths, tables = np.stack([s[0] for s in stacked]), np.stack([s[1] for s in stacked])
    clamp = lambda n, t: cache_index.safe_cache_index(n, t, CONFIG)
    got = jax.jit(jax.vmap(clamp))(lengths, tables)
    for array, want in zip(got, _expected(lengths, tables, CONFIG)):
        np.testing.assert_array_equal(np.asarray(array), want)
    got = jax.jit(jax.vmap(clamp, in_axes=(0, None)))(lengths, tables[0])  # the table shared by every call
    np.testing.assert_array_equal(
        np.asarray(got[1]), np.broadcast_to(_expected(lengths, tables[0], CONFIG)[1], tables.shape)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("batch,pages", [(700, 300), (1100, 1000)])  # many blocks; more entries than threads
def test_the_gpu_launches_one_kernel_for_both(batch, pages):
    if jax.default_backend() != "gpu":
        pytest.skip("the clamp kernel runs on a CUDA GPU; this backend uses the jnp expressions")
    lengths, table = _garbage(np.random.default_rng(2), batch=batch, pages=pages)
    config = dataclasses.replace(CONFIG, batch=batch, max_pages=pages, num_pages=1000)
    f = jax.jit(lambda n, t: cache_index.safe_cache_index(n, t, config))
    assert "jax_ragged_attn_clamp_cache_index" in f.lower(lengths, table).as_text()
    for array, want in zip(f(lengths, table), _expected(lengths, table, config)):
        np.testing.assert_array_equal(np.asarray(array), want)


def test_the_op_layer_hands_fa3_the_safe_pair():
    """implementation="fa3" on a paged cache (FA3 replaced by a recorder): the lengths and table FA3's call gets
    are the clamped pair, made by safe_cache_index; the xla path reads the table as passed."""
    from jax_ragged_attn import ragged_attention_with_kvcache
    from jax_ragged_attn.backends.fa3 import kvcache as fa3_kvcache
    from jax_ragged_attn.backends.fa3 import ragged as fa3_ragged
    from jax_ragged_attn.ops import kvcache as kvcache_op

    lengths, table = _garbage(np.random.default_rng(3))
    q = jnp.ones((5, 1, 4, 16), jnp.float32)
    cache = jnp.ones((9, 4, 2, 16), jnp.float32)
    seen = {}

    def recorder(q, k_cache, v_cache, lengths, page_table, config, window, used_q=None):
        jax.debug.callback(lambda n, t: seen.update(lengths=np.asarray(n), table=np.asarray(t)), lengths, page_table)
        return jnp.zeros(q.shape, q.dtype), jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    calls = mock.Mock(wraps=cache_index.safe_cache_index)
    with (
        mock.patch.object(fa3_kvcache, "_fa3_call", recorder),
        mock.patch.object(fa3_ragged, "unavailable_reason", lambda: None),
        mock.patch.object(fa3_ragged, "FA3_DTYPES", ("float32",)),
        mock.patch.object(fa3_ragged, "FA3_HEAD_DIM", 16),
        mock.patch.object(kvcache_op, "safe_cache_index", calls),
    ):
        jax.block_until_ready(
            ragged_attention_with_kvcache(q, cache, cache, lengths, page_table=table, implementation="fa3")
        )
        assert calls.call_count == 1
        ragged_attention_with_kvcache(q, cache, cache, lengths, page_table=table, implementation="xla")
        assert calls.call_count == 1  # the xla path leaves entries outside the cache out itself
    want_lengths, want_table = _expected(lengths, table, CONFIG)
    np.testing.assert_array_equal(seen["lengths"], want_lengths)
    np.testing.assert_array_equal(seen["table"], want_table)
