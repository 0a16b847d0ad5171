"""ragged_attention_with_kvcache and kvcache_append against the float64 reference (testing/kvcache_reference.py).

`KVCacheTest` draws [B, Sq] queries over the cache and runs kvcache_conformance.py's checks (every case of CASES,
jit, vmap, invalid page entries, check mode, forward only) and this layout's own, through the public API only;
each subclass runs them on one implementation: `XlaKVCacheTest` on the portable path (any backend; small blocks,
so sequences straddle them), `Fa3KVCacheTest` on FlashAttention-3's kvcache kernels and `CudnnKVCacheTest` on the
ragged cuDNN kernel over a contiguous cache (its paged graph: test_kvcache_cudnn.py) (GPU only, skipped with the
reason elsewhere; a configuration a backend declines by design, as testing/declines.py lists, is a skip naming
its reason, any other decline fails). Every row and page a sequence does not use is NaN in both caches: a NaN in
a result proves an unused row leaked. Inputs come from a seed derived from the test's id, so a failure
reproduces with `pytest tests/test_kvcache.py -k 'XlaKVCacheTest and test_attention_gqa_two_queries_paged'`.
"""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from decode_configs import decode_config  # tests/ is on sys.path under pytest
from kvcache_conformance import KVCacheConformance, XlaKVCacheConformance, attention_tests
from tiers import slow_cases  # tests/ is on sys.path under pytest

import jax_ragged_attn
from jax_ragged_attn import kvcache_append, ragged_attention_with_kvcache
from jax_ragged_attn.backends.fa3 import kvcache as fa3_kvcache
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.backends.shared import known_issues
from jax_ragged_attn.backends.xla import kvcache as xla_kvcache
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.ops.kvcache import kvcache_config
from jax_ragged_attn.testing import assert_close, declines, fa3_emulator
from jax_ragged_attn.testing.kvcache_reference import reference_kvcache_attention
from jax_ragged_attn.testing.private_config import backend_options

# name -> keywords of one case: heads (Hq, Hkv), Sq, paged, options.
CASES = {
    "decode": dict(seqlen_q=1),
    "decode_non_causal": dict(seqlen_q=1, is_causal=False),
    "gqa_two_queries": dict(seqlen_q=2),
    "mqa_five_queries": dict(seqlen_q=5, heads=(4, 1)),
    "mha": dict(seqlen_q=2, heads=(2, 2)),
    "window": dict(seqlen_q=5, local_window_size=(3, 0)),
    "window_non_causal": dict(seqlen_q=2, is_causal=False, local_window_size=(2, 1)),
    "sinks": dict(seqlen_q=2, sinks=True),
    "scale": dict(seqlen_q=2, scale=0.3),
    "wide_window": dict(seqlen_q=3, local_window_size=(10, 0)),  # reaches past a short tail into the head
    "chunked_prefill": dict(seqlen_q=9),  # more queries than Fa3SplitKVCacheTest's tail rows
    # Sq x group = 80 query rows: past fa3_kvcache.ZERO_FILL_MAX_ROWS, FA3 reads through its head / tail route.
    "long_chunk": dict(seqlen_q=40),
    "softcap": dict(seqlen_q=5, softcap=2.0, scale=1.5),  # scores past the cap: tanh bends them
    "softcap_window_sinks": dict(seqlen_q=2, softcap=1.0, local_window_size=(3, 0), sinks=True),
}


class KVCacheTest(KVCacheConformance):
    """[B, Sq] queries over the cache: kvcache_conformance.py's hooks for this layout, and its own checks."""

    __test__ = False  # the subclasses run these, each against its implementation
    paged_only = False
    test_attention = attention_tests(CASES)

    def lengths(self, batch: int) -> np.ndarray:
        """A full cache, an empty one, one shorter than 5 queries, the rest at random."""
        fixed = [self.capacity, 0, 3, self.capacity - 1]
        return np.asarray(fixed + list(self.rng.integers(0, self.capacity + 1, batch - len(fixed))), np.int32)[:batch]

    def make(self, *, batch=5, seqlen_q=2, heads=(4, 2), paged=False, lengths=None, extra_pages=2):
        """(q, k_cache, v_cache, cache_seqlens, page_table): unused rows and pages NaN, pages shuffled, table
        entries of unused pages -1 or past the cache."""
        hq, hkv = heads
        d = self.head_dim
        lengths = self.lengths(batch) if lengths is None else np.asarray(lengths, np.int32)
        batch = len(lengths)
        q = self.rng.standard_normal((batch, seqlen_q, hq, d))
        if not paged:
            k = self.rng.standard_normal((batch, self.capacity, hkv, d))
            v = self.rng.standard_normal((batch, self.capacity, hkv, d))
            unused = np.arange(self.capacity)[None, :] >= lengths[:, None]
            k[unused], v[unused] = np.nan, np.nan
            table = None
        else:
            used = [math.ceil(n / self.page_size) for n in lengths]
            num_pages = sum(used) + extra_pages
            order = self.rng.permutation(num_pages)  # shuffled: sequence b's pages anywhere in the cache
            k = np.full((num_pages, self.page_size, hkv, d), np.nan)
            v = np.full((num_pages, self.page_size, hkv, d), np.nan)
            table = np.full((batch, self.max_pages), -1, np.int64)
            for b in range(0, batch, 2):  # an entry past the cache on an unused page: never read
                table[b, -1] = num_pages + 7 if used[b] < self.max_pages else -1
            at = 0
            for b, n in enumerate(lengths):
                for p in range(used[b]):
                    page = order[at]
                    at += 1
                    table[b, p] = page
                    rows = min(self.page_size, n - p * self.page_size)
                    k[page, :rows] = self.rng.standard_normal((rows, hkv, d))
                    v[page, :rows] = self.rng.standard_normal((rows, hkv, d))
            table = table.astype(np.int32)
        cast = lambda x: jnp.asarray(x, self.dtype)
        return cast(q), cast(k), cast(v), jnp.asarray(lengths), (None if table is None else jnp.asarray(table))

    def attend(self, *args, **kwargs):
        """The op through self.implementation; a decline testing/declines.py lists is a skip naming the reason,
        any other fails."""
        return declines.call(
            self.implementation,
            ragged_attention_with_kvcache,
            *args,
            implementation=self.implementation,
            skip=self.skipTest,
            **kwargs,
        )

    def check(self, args, *, sinks=None, compare=slice(None), **options):
        """Runs the op twice (bit-identical), both stats layouts, against the reference."""
        q, k, v, lengths, table = args
        if sinks is True:
            sinks = jnp.asarray(self.rng.standard_normal(q.shape[2]), jnp.float32)
        out, stats = self.attend(q, k, v, lengths, page_table=table, sinks=sinks, return_stats=True, **options)
        again, token_major = self.attend(
            q, k, v, lengths, page_table=table, sinks=sinks, return_stats=True, stats_layout="token_major", **options
        )
        # As float32: numpy's NaN-aware equality does not reach bfloat16 (a sequence outside `compare` may
        # hold NaN where it reads an entry outside the cache; the rest must agree, NaN-free).
        pairs = (
            (np.asarray(out, np.float32)[compare], np.asarray(again, np.float32)[compare], "two runs differ"),
            (
                np.asarray(stats)[compare],
                np.asarray(token_major).transpose(0, 2, 1)[compare],
                "token_major is not the head-major stats transposed",
            ),
        )
        for first, second, message in pairs:
            if self.bit_reproducible:
                np.testing.assert_array_equal(first, second, message)
            else:  # within the dtype's tolerance (NaN never passes)
                assert_close(second, first, self.dtype, message)
        expected = reference_kvcache_attention(q, k, v, lengths, page_table=table, sinks=sinks, **options)
        self.assertEqual(out.dtype, q.dtype)
        self.assertEqual(stats.shape, (q.shape[0], q.shape[2], q.shape[1]))
        assert_close(out[compare], expected["out"][compare], self.dtype, "out")
        assert_close(stats[compare], expected["stats"][compare], self.dtype, "stats")
        no_keys = np.isneginf(expected["stats"]).transpose(0, 2, 1)[compare]  # [B, Sq, Hq]
        self.assertTrue((np.asarray(out[compare], np.float32)[no_keys] == 0).all(), "a query without keys is not 0")
        return out

    # ---- kvcache_conformance.py's hooks ---------------------------------------------------------------------

    def draw(self, paged=False):
        return self.make(paged=paged)

    def case_inputs(self, paged, seqlen_q=2, heads=(4, 2), **options):
        return self.make(seqlen_q=seqlen_q, heads=heads, paged=paged), options

    def page_table_case(self):
        return self.make(paged=True, lengths=[self.capacity, self.page_size + 3, 6, 5, 0]), (1, 1)

    def invalid_page_entries(self):
        # Sequence 0's second page and sequence 2's first are outside the cache.
        q, k, v, lengths, table = self.make(paged=True, lengths=[self.capacity, 7, 6, 5, 0])
        table = table.at[0, 1].set(-5).at[2, 0].set(10**6)
        return (q, k, v, lengths, table), np.array([0, 2]), (np.array([1, 3, 4]),)

    def vmap_parts(self, paged):
        size = self.page_size  # both draw max_pages + 1 pages, so that the paged caches stack
        parts = [
            self.make(paged=paged, extra_pages=0, lengths=lengths)
            for lengths in ([self.capacity, 0, 3], [size + 1, self.capacity - 2 * size, 3])
        ]
        if paged:  # vmapped caches need one page count: both draw the same page total
            self.assertEqual(parts[0][1].shape, parts[1][1].shape)
        return parts

    def attend_inputs(self, inputs, **kwargs):
        q, k, v, lengths, table = inputs
        return self.attend(q, k, v, lengths, page_table=table, **kwargs)

    def traced(self, inputs, **kwargs):
        kwargs = dict(implementation=self.implementation) | kwargs

        def run(q, k, v, lengths, table):
            return ragged_attention_with_kvcache(q, k, v, lengths, page_table=table, **kwargs)

        return run, inputs

    def reference(self, inputs, **options):
        q, k, v, lengths, table = inputs
        return reference_kvcache_attention(q, k, v, lengths, page_table=table, **options)

    def invalid_calls(self, inputs):
        q, k, v, lengths, table = inputs
        return [
            (lambda: ragged_attention_with_kvcache(q[0], k, v, lengths, page_table=table), "q must have rank 4"),
            (lambda: ragged_attention_with_kvcache(q, k, v, lengths[:2], page_table=table), "cache_seqlens must be"),
            (lambda: ragged_attention_with_kvcache(q, k, v, lengths, page_table=table[:2]), "page_table must be"),
            (lambda: ragged_attention_with_kvcache(q, k, v, lengths), "contiguous k_cache"),
            (
                lambda: ragged_attention_with_kvcache(q, k, v.astype(jnp.bfloat16), lengths, page_table=table),
                "share a dtype",
            ),
            (
                lambda: ragged_attention_with_kvcache(q, k, v, lengths.astype(jnp.float32), page_table=table),
                "cache_seqlens must have an integer dtype",
            ),
        ]

    # ---- this layout's own checks ----------------------------------------------------------------------------

    def test_out_of_range_cache_seqlens_read_nan(self):
        # Sequences 0-2 have lengths outside [0, capacity]: their rows read NaN, the others are exact.
        q, k, v, _, _ = self.make(lengths=[self.capacity] * 5)
        lengths = jnp.asarray([self.capacity + 5, -3, 2**31 - 1, 0, self.capacity], jnp.int32)
        out = self.attend(q, k, v, lengths)
        self.assertTrue(np.isnan(np.asarray(out, np.float32)[:3]).all())
        clamped = jnp.clip(lengths, 0, self.capacity)
        assert_close(out[3:], reference_kvcache_attention(q, k, v, clamped)["out"][3:], self.dtype, "out")


class XlaKVCacheTest(KVCacheTest, XlaKVCacheConformance):
    __test__ = True
    implementation = "xla"

    def setUp(self):
        super().setUp()
        # Blocks of 8 rows (2 pages): sequences straddle blocks, and the last block is shifted back.
        self.enter_context(backend_options(block_rows=8))

    def test_one_block_by_default(self):
        with backend_options(block_rows=None):
            self.check(self.make(paged=True, seqlen_q=2))
            self.check(self.make(seqlen_q=2))

    # ---- kvcache_append (implementation-independent: run once, here) --------------------------------------

    def test_append_contiguous(self):
        k = np.zeros((3, 6, 2, 4), np.float32)
        v = np.ones((3, 6, 2, 4), np.float32)
        k_new = self.rng.standard_normal((3, 3, 2, 4)).astype(np.float32)
        v_new = self.rng.standard_normal((3, 3, 2, 4)).astype(np.float32)
        lengths = np.array([0, 4, 9], np.int32)  # 4: the third new row is past the capacity; 9: clamped, none
        k2, v2, _ = kvcache_append(jnp.asarray(k), jnp.asarray(v), jnp.asarray(k_new), jnp.asarray(v_new), lengths)
        want_k, want_v = k.copy(), v.copy()
        want_k[0, 0:3], want_v[0, 0:3] = k_new[0], v_new[0]
        want_k[1, 4:6], want_v[1, 4:6] = k_new[1, :2], v_new[1, :2]
        np.testing.assert_array_equal(k2, want_k)
        np.testing.assert_array_equal(v2, want_v)

    def test_append_paged(self):
        k = np.zeros((5, 2, 1, 3), np.float32)  # 5 pages of 2 rows
        k_new = self.rng.standard_normal((3, 3, 1, 3)).astype(np.float32)
        table = np.array([[4, 1, -1], [0, 99, 2], [3, 3, 3]], np.int32)
        lengths = np.array([1, 2, 5], np.int32)
        k2, v2, _ = kvcache_append(
            jnp.asarray(k), jnp.asarray(k), jnp.asarray(k_new), jnp.asarray(k_new), lengths, page_table=table
        )
        want = k.copy()
        want[4, 1], want[1, 0], want[1, 1] = k_new[0, 0], k_new[0, 1], k_new[0, 2]  # rows 1, 2, 3
        # sequence 1: rows 2, 3 on page 99 (past the cache): not written; row 4 on page 2
        want[2, 0] = k_new[1, 2]
        want[3, 1] = k_new[2, 0]  # sequence 2: row 5 on page 3; rows 6, 7 past the capacity of 6
        np.testing.assert_array_equal(k2, want)
        np.testing.assert_array_equal(v2, want)

    def test_append_then_attend(self):
        q, k, v, lengths, table = self.make(paged=True, lengths=[5, 8, 0, 3, 12])
        k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
        k_new = jnp.asarray(self.rng.standard_normal((5, 2, 2, self.head_dim)), self.dtype)
        # Sequences 1 to 4 need a page they do not have (-1): those rows are not written, and the attention
        # reads NaN for those sequences (a page they use is outside the cache); sequence 0 has its pages.
        k2, v2, _ = kvcache_append(k, v, k_new, k_new, lengths, page_table=table)
        out = ragged_attention_with_kvcache(q, k2, v2, lengths + 2, page_table=table, implementation="xla")
        pages = (
            np.arange(self.max_pages)[None, :]
            < (np.asarray(lengths)[:, None] + 2 + self.page_size - 1) // self.page_size
        )
        missing = (pages & ((np.asarray(table) < 0) | (np.asarray(table) >= k.shape[0]))).any(axis=1)
        np.testing.assert_array_equal(missing, [False, True, True, True, True])
        self.assertTrue(np.isnan(np.asarray(out)[missing]).all())
        keep = ~missing
        expected = reference_kvcache_attention(q, k2, v2, lengths + 2, page_table=table)["out"]
        assert_close(out[keep], expected[keep], self.dtype, "out")

    @parameterized.parameters(False, True)
    def test_append_in_place_when_donated(self, paged):
        k = jnp.zeros((64, 16, 4, 32) if paged else (8, 128, 4, 32), jnp.float32)  # 1 MiB each
        k_new = jnp.ones((8, 1, 4, 32), jnp.float32)
        lengths = jnp.arange(8, dtype=jnp.int32)
        table = jnp.arange(64, dtype=jnp.int32).reshape(8, 8) if paged else None
        step = jax.jit(
            lambda k, v, k_new, lengths, table: kvcache_append(k, v, k_new, k_new, lengths, page_table=table),
            donate_argnums=(0, 1),
        )
        compiled = step.lower(k, k, k_new, lengths, table).compile()
        text = compiled.as_text()
        self.assertIn("input_output_alias", text)
        memory = compiled.memory_analysis()
        cache_bytes = k.size * 4
        self.assertEqual(memory.alias_size_in_bytes, 2 * cache_bytes)  # both caches are the outputs' buffers
        self.assertLess(memory.temp_size_in_bytes, cache_bytes // 4)  # and no copy of either is made
        k2, v2, _ = step(k, jnp.zeros_like(k), k_new, lengths, table)
        self.assertTrue(k.is_deleted())
        self.assertEqual(float(k2.sum()), 8 * 4 * 32)

    def test_append_returns_the_lengths_to_attend_with(self):
        k = jnp.zeros((3, 6, 2, 4), jnp.float32)
        k_new = jnp.ones((3, 2, 2, 4), jnp.float32)
        _, _, after = kvcache_append(k, k, k_new, k_new, jnp.asarray([0, 3, -2], jnp.int32))
        self.assertEqual(after.dtype, jnp.int32)
        np.testing.assert_array_equal(after, [2, 5, 2])  # -2 is clamped to 0, where the new rows are written

    def test_append_chain(self):
        # k, v, lengths = kvcache_append(...) then ragged_attention_with_kvcache(q, k, v, lengths): the lengths
        # after the append, so each query sees its own new row (passing those before would leave it out).
        q, k, v, lengths, _ = self.make(lengths=[5, 8, 0, 3, 12])
        k_new = jnp.asarray(self.rng.standard_normal((5, 2, 2, self.head_dim)), self.dtype)
        v_new = jnp.asarray(self.rng.standard_normal((5, 2, 2, self.head_dim)), self.dtype)
        step = jax.jit(
            lambda k, v, lengths: ragged_attention_with_kvcache(
                q, *kvcache_append(k, v, k_new, v_new, lengths), implementation="xla"
            )
        )
        k2, v2, after = kvcache_append(k, v, k_new, v_new, lengths)
        np.testing.assert_array_equal(after, lengths + 2)
        expected = reference_kvcache_attention(q, k2, v2, lengths + 2)["out"]
        assert_close(ragged_attention_with_kvcache(q, k2, v2, after, implementation="xla"), expected, self.dtype, "out")
        assert_close(step(k, v, lengths), expected, self.dtype, "out under jit")

    # ---- return_overflow -------------------------------------------------------------------------------------

    def test_return_overflow_counts_out_of_range_cache_index(self):
        q, k, v, _, _ = self.make(lengths=[self.capacity] * 5)
        lengths = jnp.asarray([self.capacity + 5, -3, 2, 0, self.capacity], jnp.int32)
        out, overflow = ragged_attention_with_kvcache(q, k, v, lengths, return_overflow=True, implementation="xla")
        # NaN on sequences 0 and 1 in both: equal as arrays.
        np.testing.assert_array_equal(out, ragged_attention_with_kvcache(q, k, v, lengths, implementation="xla"))
        self.assertEqual(tuple(int(x) for x in overflow), (0, 0, 2, 0))  # capacity + 5 and -3
        q, k, v, lengths, table = self.make(paged=True, lengths=[self.capacity, 7, 6, 5, 0])

        def counts(*args, **kwargs):
            return ragged_attention_with_kvcache(
                *args,
                return_overflow=True,
                return_stats=True,
                stats_layout="token_major",
                implementation="xla",
                **kwargs,
            )[2]

        self.assertEqual(int(counts(q, k, v, lengths, page_table=table).invalid_cu_seqlens), 0)  # unused pages
        bad = table.at[0, 1].set(-5).at[2, 0].set(10**6)  # pages sequences 0 and 2 use
        overflow = jax.jit(lambda t: counts(q, k, v, lengths, page_table=t))(bad)
        self.assertEqual(tuple(int(x) for x in overflow), (0, 0, 2, 0))
        out, stats, overflow = ragged_attention_with_kvcache(
            q, k, v, lengths, page_table=table, return_stats=True, return_overflow=True, implementation="xla"
        )
        self.assertEqual(stats.shape, (q.shape[0], q.shape[2], q.shape[1]))
        with self.assertRaisesRegex(ValueError, "return_overflow must be a Python bool"):
            ragged_attention_with_kvcache(q, k, v, lengths, return_overflow=1, implementation="xla")


_FA3_REASON = _fa3.unavailable_reason()
_CUDNN_REASON = jax_ragged_attn.cudnn_unavailable_reason()


@pytest.mark.skipif(_FA3_REASON is not None, reason=f"FlashAttention-3 unavailable: {_FA3_REASON}")
class Fa3KVCacheTest(KVCacheTest):
    __test__ = True
    implementation = "fa3"
    dtype = jnp.bfloat16
    head_dim = 128
    # 40 rows a page (FA3 tiles 128 or 176 keys: pages and tiles straddle), 16 pages: capacity 640, longer
    # than the head / tail route's TAIL, so that route gives FA3 real heads too.
    page_size = 40
    max_pages = 16


@pytest.mark.skipif(_FA3_REASON is not None, reason=f"FlashAttention-3 unavailable: {_FA3_REASON}")
class Fa3HeadTailKVCacheTest(Fa3KVCacheTest):
    """Every case through the head / tail route (pinned), which decode steps no longer take by default."""

    def setUp(self):
        super().setUp()
        self.enter_context(backend_options(route="head_tail"))


@pytest.mark.skipif(_FA3_REASON is not None, reason=f"FlashAttention-3 unavailable: {_FA3_REASON}")
class Fa3KeySplitsKVCacheTest(Fa3KVCacheTest):
    """Every case with FA3's key splits pinned to 3 (its split accumulators and combine kernel): num_splits keeps
    one split at this capacity (16 key tiles a split at least), which long few-sequence decodes leave."""

    def setUp(self):
        super().setUp()
        self.enter_context(backend_options(num_splits=3))


def _fa3_stand_in(q, k_cache, v_cache, lengths, page_table, config, window):
    """FA3's call as fa3_kvcache makes it, computed by the xla path: bottom-right over `lengths` rows with
    FA3's window (is_causal, left, right), -1 for no bound; NaN where it is handed a length or page-table entry
    outside the cache, which FA3 reads unchecked (fa3_emulator.kvcache_reads_unchecked)."""
    is_causal, left, right = window
    config = dataclasses.replace(
        config, is_causal=is_causal, window_left=None if left < 0 else left, window_right=None if right < 0 else right
    )
    out, lse = xla_kvcache.attend(q, k_cache, v_cache, lengths, page_table, config)
    return fa3_emulator.kvcache_reads_unchecked(out, lse, lengths, page_table, config)


# The route takes a contiguous cache as pages of one page per sequence: the fast tier runs the paged cases and one
# contiguous case (the contiguous cache's own gathers stay fast in the xla classes), the slow tier the others.
@slow_cases(
    *(
        f"test_attention_{case}_contiguous"
        for case in ("long_chunk", "mqa_five_queries", "chunked_prefill", "window", "mha")
    )
)
class Fa3OneCallKVCacheTest(KVCacheTest):
    """fa3_kvcache's routes on any backend, the FA3 call replaced by the xla path with FA3's masks: decode-sized
    calls as one call over the full lengths (a contiguous cache read as one page per sequence), the rest
    (long_chunk) through the head / tail split, TAIL small so heads and tails both carry keys."""

    __test__ = True
    implementation = "fa3"
    route = None  # the route fa3_kvcache.route picks

    def setUp(self):
        super().setUp()
        patchers = [
            mock.patch.object(target, name, value)
            for target, name, value in (
                (fa3_kvcache, "_fa3_call", _fa3_stand_in),
                (_fa3, "unavailable_reason", lambda: None),
                (_fa3, "FA3_DTYPES", ("float32",)),
                (_fa3, "FA3_HEAD_DIM", self.head_dim),
            )
        ]
        for patcher in patchers:
            patcher.start()
            self.addCleanup(patcher.stop)
        self.enter_context(backend_options(route=self.route, tail_rows=7))


@pytest.mark.slow  # FA3's decode variants past the one-call route
class Fa3OneCallUnmaskedKVCacheTest(Fa3OneCallKVCacheTest):
    """The one call as on the audited wheel, where the op layer leaves out its mask of queries without keys
    (fa3_kvcache.zeroes_rows_without_keys): the stand-in's out of such a query, probabilities all 0 times value
    rows as FA3 reads them, must come out 0 unmasked, as FA3's does on the GPU (Fa3KVCacheTest)."""

    def setUp(self):
        super().setUp()
        patcher = mock.patch.object(known_issues, "fa3_version", lambda: fa3_kvcache.AUDITED_WHEEL)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_the_one_call_claims_its_zeros_and_the_head_tail_route_does_not(self):
        config = kvcache_config(*self.make()[:4], None, AttentionOptions(is_causal=True))
        self.assertTrue(fa3_kvcache.zeroes_rows_without_keys(config))
        # The head / tail route merges two parts: the op layer masks it.
        with backend_options(route="head_tail"):
            self.assertFalse(fa3_kvcache.zeroes_rows_without_keys(config))


@pytest.mark.slow  # FA3's decode variants past the one-call route
class Fa3SplitKVCacheTest(Fa3OneCallKVCacheTest):
    """Every case through the head / tail split and merge (FA3 never reads a sequence's last TAIL rows)."""

    route = "head_tail"


def test_fa3_routes_by_query_rows():
    config = lambda seqlen_q, heads_q: decode_config(
        batch=4,
        seqlen_q=seqlen_q,
        num_heads_q=heads_q,
        num_heads_kv=8,
        paged=False,
        page_size=2048,
        num_pages=4,
        max_pages=1,
        scale=1.0,
    )
    assert fa3_kvcache.route(config(1, 32)) == "one_call"  # decode, GQA 32/8: 4 rows
    assert fa3_kvcache.route(config(16, 32)) == "one_call"  # 64 rows: FA3 still reads without TMA
    assert fa3_kvcache.route(config(17, 32)) == "head_tail"  # 68: FA3 may take TMA, which reads past lengths
    with backend_options(route="head_tail"):
        assert fa3_kvcache.route(config(1, 32)) == "head_tail"  # pinned
    with pytest.raises(ValueError, match="route must be None or one of"):  # one call where it does not serve
        with backend_options(route="one_call"):
            pass


@pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN path unavailable: {_CUDNN_REASON}")
class CudnnKVCacheTest(KVCacheTest):
    """Contiguous caches through the ragged cuDNN kernel (the route pinned: the paged graph, which serves them
    by default, runs in test_kvcache_cudnn.py)."""

    __test__ = True
    implementation = "cudnn"
    dtype = jnp.bfloat16
    head_dim = 64
    page_size = 64
    max_pages = 4
    contiguous_only = True

    def setUp(self):
        super().setUp()
        self.enter_context(backend_options(route="ragged"))


def test_fa3_splits_fill_one_wave():
    config = lambda batch, capacity: decode_config(
        batch=batch,
        num_heads_q=32,
        num_heads_kv=8,
        paged=False,
        page_size=capacity,
        num_pages=batch,
        max_pages=1,
        scale=1.0,
    )
    assert fa3_kvcache.num_splits(config(8, 32768)) == 2  # 64 tiles: 128 CTAs, one wave of 132 SMs
    assert fa3_kvcache.num_splits(config(2, 32768)) == 8
    assert fa3_kvcache.num_splits(config(2, 256)) == 1  # 2 key tiles: a split holds at least 16
    assert fa3_kvcache.num_splits(config(8, 2048)) == 1  # 16 key tiles: one split (the combine would cost more)
    assert fa3_kvcache.num_splits(config(8, 8192)) == 2
    assert fa3_kvcache.num_splits(config(64, 2048)) == 1  # 512 tiles fill the GPU alone
