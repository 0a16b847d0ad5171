"""Packed queries over a KV cache (ragged_attention_with_kvcache with cu_seqlens_q) and kvcache_append with
cu_seqlens_k_new, against the float64 reference (testing/kvcache_reference.py).

Every case is a random mix drawn from a seed derived from the test's id: prefill chunks, decode rows, empty
sequences, chunks longer than their cache (queries at positions below 0), sequences whose page tables share
prefix pages, NaN in every cache row and page no sequence uses and in q's rows past cu_seqlens_q[-1]. A NaN in
a result proves such a row leaked; padded rows must read exactly 0 (out) and -inf (stats).

`PackedKVCacheTest` draws the mixes and runs kvcache_conformance.py's checks (every case of CASES, jit, vmap,
invalid page entries, check mode, forward only) and this layout's own, through the public API only; each
subclass runs them on one implementation: `XlaPackedTest` on the portable path (tiles of 2 queries and blocks of
8 rows, so sequences straddle both), `Fa3TilesStandInTest` on FA3's tile arithmetic with the kernel call
replaced by the xla path with FA3's masks (any machine), `Fa3PackedTest` on FlashAttention-3 (Hopper GPU with
the flash-attn3-jax wheel; skipped elsewhere with the reason; `pytest -m "not soak" tests/test_kvcache_varlen.py
-k Fa3PackedTest` on the H200); `CudnnPackedStandInTest` on cuDNN's packed paged route with the FFI handler
replaced by its contract in jnp (any machine), `CudnnPackedTest` on cuDNN's graph (a CUDA GPU). The GPU
classes' "two runs differ" check is what caught FA3's split-KV with seqused_q differing run to run
(fa3/kvcache.py _fa3_call).

    pytest tests/test_kvcache_varlen.py -k 'XlaPackedTest and test_attention_window_paged'
"""

from __future__ import annotations

import dataclasses
import math
import zlib
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
from jax_ragged_attn.backends.cudnn import paged
from jax_ragged_attn.backends.fa3 import kvcache as fa3_kvcache
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.backends.shared import cache_attention, extension, known_issues
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.features.checks import RaggedAttentionInputError, RaggedAttentionInputWarning, input_errors
from jax_ragged_attn.index.kvcache import band, query_tiles
from jax_ragged_attn.ops import kvcache as kvcache_inputs
from jax_ragged_attn.testing import assert_close, declines, fa3_emulator
from jax_ragged_attn.testing.kvcache_reference import reference_kvcache_attention_packed
from jax_ragged_attn.testing.private_config import backend_options

# name -> keywords of one case: heads (Hq, Hkv), max_seqlen_q, paged, options.
CASES = {
    "causal": dict(),
    "mqa": dict(heads=(4, 1)),
    "mha": dict(heads=(2, 2)),
    "decode_only": dict(max_seqlen_q=1),
    "window": dict(local_window_size=(3, 0)),
    "non_causal": dict(is_causal=False),
    "window_non_causal": dict(is_causal=False, local_window_size=(2, 1)),
    "sinks": dict(sinks=True),
    "scale": dict(scale=0.3),
    "softcap": dict(softcap=2.0, scale=1.5),
    "softcap_window_sinks": dict(softcap=1.0, local_window_size=(3, 0), sinks=True),
}


class PackedKVCacheTest(KVCacheConformance):
    """Packed [T] queries over the cache: kvcache_conformance.py's hooks for this layout, and its own checks."""

    __test__ = False  # the subclasses run these, each against its implementation
    max_seqlen_q = 7
    test_attention = attention_tests(CASES)

    def mix(self, *, max_seqlen_q=None, heads=(4, 2), paged=True, batch=7, spare_rows=3, share=True):
        """(q [T, Hq, D], k_cache, v_cache, cache_seqlens, cu_seqlens_q, max_seqlen_q, page_table): sequence 0
        a prefill chunk, 1 a decode row, 2 empty, 3 a chunk longer than its cache (positions below 0), 4 a full
        cache, the rest drawn; with `share`, sequences 5 and 6 point at sequence 4's first pages."""
        max_q = self.max_seqlen_q if max_seqlen_q is None else max_seqlen_q
        hq, hkv = heads
        d, rng = self.head_dim, self.rng
        counts = [min(max_q, 5), 1, 0, max_q, min(2, max_q)] + list(rng.integers(0, max_q + 1, batch - 5))
        counts = np.asarray(counts[:batch], np.int64)
        lengths = [
            int(rng.integers(counts[0], self.capacity + 1)),
            int(rng.integers(1, self.capacity + 1)),
            0,
            max(0, max_q - 3),
            self.capacity,
        ] + [int(rng.integers(counts[b], self.capacity + 1)) for b in range(5, batch)]
        lengths = np.asarray(lengths[:batch], np.int64)
        total = int(counts.sum()) + spare_rows
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        q = rng.standard_normal((total, hq, d))
        q[cu[-1] :] = np.nan  # rows past cu_seqlens_q[-1]: never read
        if not paged:
            k = rng.standard_normal((batch, self.capacity, hkv, d))
            v = rng.standard_normal((batch, self.capacity, hkv, d))
            unused = np.arange(self.capacity)[None, :] >= lengths[:, None]
            k[unused], v[unused] = np.nan, np.nan
            table = None
        else:
            used = [math.ceil(n / self.page_size) for n in lengths]
            shared = min(2, used[4]) if share and batch > 6 else 0  # sequence 4's first pages, read by 5 and 6
            if shared:
                for b in (5, 6):
                    lengths[b] = max(lengths[b], shared * self.page_size)
                    used[b] = math.ceil(lengths[b] / self.page_size)
            own = [u - (shared if b in (5, 6) and shared else 0) for b, u in enumerate(used)]
            num_pages = sum(own) + 2
            order = rng.permutation(num_pages)
            k = np.full((num_pages, self.page_size, hkv, d), np.nan)
            v = np.full((num_pages, self.page_size, hkv, d), np.nan)
            table = np.full((batch, self.max_pages), -1, np.int64)
            for b in range(0, batch, 3):  # an entry past the cache on an unused page: never read
                if used[b] < self.max_pages:
                    table[b, -1] = num_pages + 7
            at = 0
            for b, n in enumerate(lengths):
                for p in range(used[b]):
                    if shared and b in (5, 6) and p < shared:
                        table[b, p] = table[4, p]
                        continue
                    page = order[at]
                    at += 1
                    table[b, p] = page
                    rows = min(self.page_size, n - p * self.page_size)
                    k[page, :rows] = rng.standard_normal((rows, hkv, d))
                    v[page, :rows] = rng.standard_normal((rows, hkv, d))
            table = table.astype(np.int32)
        cast = lambda x: jnp.asarray(x, self.dtype)
        return (
            cast(q),
            cast(k),
            cast(v),
            jnp.asarray(lengths, jnp.int32),
            jnp.asarray(cu),
            max_q,
            None if table is None else jnp.asarray(table),
        )

    def attend(self, q, k, v, lengths, cu, max_q, table, **kwargs):
        """The op through self.implementation; a decline testing/declines.py lists is a skip naming the reason,
        any other fails."""
        return declines.call(
            self.implementation,
            ragged_attention_with_kvcache,
            q,
            k,
            v,
            lengths,
            cu_seqlens_q=cu,
            max_seqlen_q=max_q,
            page_table=table,
            implementation=self.implementation,
            skip=self.skipTest,
            **kwargs,
        )

    def check(self, args, *, sinks=None, compare=slice(None), **options):
        """Runs the op twice (bit-identical), both stats layouts, against the reference, on the query rows
        `compare` indexes (all by default)."""
        q, k, v, lengths, cu, max_q, table = args
        if sinks is True:
            sinks = jnp.asarray(self.rng.standard_normal(q.shape[1]), jnp.float32)
        out, stats = self.attend(*args, sinks=sinks, return_stats=True, **options)
        again, token_major = self.attend(*args, sinks=sinks, return_stats=True, stats_layout="token_major", **options)
        pairs = (
            (np.asarray(out, np.float32)[compare], np.asarray(again, np.float32)[compare], "two runs differ"),
            (
                np.asarray(stats)[:, compare],
                np.asarray(token_major).T[:, compare],
                "token_major is not the head-major stats transposed",
            ),
        )
        for first, second, message in pairs:
            if self.bit_reproducible:
                np.testing.assert_array_equal(first, second, message)
            else:
                assert_close(second, first, self.dtype, message)
        expected = reference_kvcache_attention_packed(
            q, k, v, lengths, cu, max_q, page_table=table, sinks=sinks, **options
        )
        self.assertEqual(out.dtype, q.dtype)
        self.assertEqual(out.shape, q.shape[:2] + (v.shape[-1],))
        self.assertEqual(stats.shape, (q.shape[1], q.shape[0]))
        assert_close(out[compare], expected["out"][compare], self.dtype, "out")
        assert_close(stats[:, compare], expected["stats"][:, compare], self.dtype, "stats")
        compared_out, compared_stats = np.asarray(out, np.float32)[compare], np.asarray(stats)[:, compare]
        padding = (np.arange(q.shape[0]) >= int(cu[-1]))[compare]
        self.assertTrue((compared_out[padding] == 0).all(), "a row past cu_seqlens_q[-1] is not 0")
        self.assertTrue(
            np.isneginf(compared_stats[:, padding]).all(),
            "a row past cu_seqlens_q[-1] has stats other than -inf (sinks or not: it is no query)",
        )
        no_keys = np.isneginf(expected["stats"]).T[compare]  # [T, Hq]
        self.assertTrue((compared_out[no_keys] == 0).all(), "a query without keys is not 0")
        return out

    # ---- kvcache_conformance.py's hooks ---------------------------------------------------------------------

    def draw(self, paged=True):
        return self.mix(paged=paged)

    def case_inputs(self, paged, heads=(4, 2), max_seqlen_q=None, **options):
        return self.mix(paged=paged, heads=heads, max_seqlen_q=max_seqlen_q), options

    def page_table_case(self):
        return self.mix(share=False), (4, 0)  # sequence 4: a full cache

    def invalid_page_entries(self):
        q, k, v, lengths, cu, max_q, table = self.mix(share=False)
        table = table.at[0, 0].set(-5)  # sequence 0's first page: outside the cache
        rows = np.arange(q.shape[0]) >= int(cu[1])  # sequence 0's rows read NaN: compare the others
        return (q, k, v, lengths, cu, max_q, table), ~rows, rows

    def vmap_parts(self, paged):
        parts = [self.mix(share=False, batch=7, spare_rows=2, paged=paged) for _ in range(2)]
        pages = max(p[1].shape[0] for p in parts)
        total = max(p[0].shape[0] for p in parts)
        return [
            (
                jnp.pad(q, ((0, total - q.shape[0]), (0, 0), (0, 0))),
                jnp.pad(k, ((0, pages - k.shape[0]),) + ((0, 0),) * 3, constant_values=np.nan),
                jnp.pad(v, ((0, pages - v.shape[0]),) + ((0, 0),) * 3, constant_values=np.nan),
                n,
                cu,
                m,
                t,
            )
            for q, k, v, n, cu, m, t in parts
        ]

    def attend_inputs(self, inputs, **kwargs):
        return self.attend(*inputs, **kwargs)

    def traced(self, inputs, **kwargs):
        q, k, v, lengths, cu, max_q, table = inputs
        kwargs = dict(implementation=self.implementation) | kwargs

        def run(q, k, v, lengths, cu, table):
            return ragged_attention_with_kvcache(
                q, k, v, lengths, cu_seqlens_q=cu, max_seqlen_q=max_q, page_table=table, **kwargs
            )

        return run, (q, k, v, lengths, cu, table)

    def reference(self, inputs, **options):
        q, k, v, lengths, cu, max_q, table = inputs
        return reference_kvcache_attention_packed(q, k, v, lengths, cu, max_q, page_table=table, **options)

    def queries(self, inputs, out):
        return out[: int(inputs[4][-1])]

    def invalid_calls(self, inputs):
        q, k, v, lengths, cu, max_q, table = inputs
        packed = dict(cu_seqlens_q=cu, max_seqlen_q=max_q, page_table=table)
        return [
            (
                lambda: ragged_attention_with_kvcache(q, k, v, lengths, cu_seqlens_q=cu, page_table=table),
                "max_seqlen_q",
            ),
            (lambda: ragged_attention_with_kvcache(q[None], k, v, lengths, **packed), "q must have rank 3"),
            (lambda: ragged_attention_with_kvcache(q, k, v, lengths[:3], **packed), "cache_seqlens must be"),
            (
                lambda: ragged_attention_with_kvcache(
                    q, k, v, lengths, cu_seqlens_q=cu[:4], max_seqlen_q=max_q, page_table=table
                ),
                "cu_seqlens_q must be",
            ),
            (
                lambda: ragged_attention_with_kvcache(
                    q, k, v, lengths, cu_seqlens_q=cu, max_seqlen_q=0, page_table=table
                ),
                "max_seqlen_q",
            ),
            (
                lambda: ragged_attention_with_kvcache(
                    q, k, v, lengths, cu_seqlens_q=cu.astype(jnp.float32), max_seqlen_q=max_q, page_table=table
                ),
                "cu_seqlens_q must have an integer dtype",
            ),
        ]

    # ---- attention -------------------------------------------------------------------------------------------

    def test_random_mixes(self):
        for _ in range(3):
            batch = int(self.rng.integers(7, 12))
            self.check(self.mix(batch=batch, spare_rows=int(self.rng.integers(0, 5))))

    def test_slots_longer_than_max_seqlen_q_read_nan(self):
        # A slot of 6 rows with max_seqlen_q = 4: all 6 rows read NaN, as ragged_attention's do past
        # max_seqlen; the other sequences are exact.
        q, k, v, lengths, _, _, table = self.mix(max_seqlen_q=6, batch=7)
        cu = jnp.asarray([0, 6, 7, 7, 9, 10, 12, 12], jnp.int32)
        out, stats = self.attend(q, k, v, lengths, cu, 4, table, return_stats=True)
        rows = np.arange(q.shape[0]) < 6
        self.assertTrue(
            np.isnan(np.asarray(out, np.float32)[rows]).all() and np.isnan(np.asarray(stats)[:, rows]).all()
        )
        expected = reference_kvcache_attention_packed(q, k, v, lengths, cu, 4, page_table=table)
        assert_close(np.asarray(out)[~rows], expected["out"][~rows], self.dtype, "out")
        assert_close(np.asarray(stats)[:, ~rows], expected["stats"][:, ~rows], self.dtype, "stats")

    def test_max_seqlen_q_past_the_token_count_is_the_token_count(self):
        # No sequence can have more than T queries: a looser static bound serves the same call (the tiles a
        # backend cuts stay bounded by T instead of growing with the bound).
        q, k, v, lengths, cu, _, table = self.mix()
        loose = self.check((q, k, v, lengths, cu, 1000 * q.shape[0], table))
        tight = self.check((q, k, v, lengths, cu, q.shape[0], table))
        np.testing.assert_array_equal(np.asarray(loose, np.float32), np.asarray(tight, np.float32))
        config = kvcache_inputs.kvcache_config(
            q,
            k,
            v,
            lengths,
            table,
            AttentionOptions(is_causal=True),
            None,
            cu_seqlens_q=cu,
            max_seqlen_q=1000 * q.shape[0],
        )
        self.assertEqual(config.seqlen_q, q.shape[0], "max_seqlen_q is not clamped to the token count")

    # ---- check mode ------------------------------------------------------------------------------------------

    def test_check_names_the_argument_sequence_and_value(self):
        q, k, v, lengths, cu, max_q, table = self.mix(share=False)
        self.attend(q, k, v, lengths, cu, max_q, table, check=True)  # valid: no error
        for bad, message in [
            (dict(cu=cu.at[2].set(cu[1] - 1)), r"cu_seqlens_q is invalid.*decreases at index 2"),
            (dict(cu=cu.at[-1].set(q.shape[0] + 1)), rf"cu_seqlens_q\[7\] = {q.shape[0] + 1} is past the capacity"),
            (dict(max_q=max_q - 1), rf"sequence 3 has {max_q} tokens .* more than max_seqlen_q = {max_q - 1}"),
            (dict(lengths=lengths.at[1].set(self.capacity + 2)), rf"cache_seqlens\[1\] = {self.capacity + 2}"),
            (dict(table=table.at[4, 0].set(-2)), r"page_table\[4, 0\] = -2"),
        ]:
            call = {**dict(cu=cu, max_q=max_q, lengths=lengths, table=table), **bad}
            with self.assertRaisesRegex(RaggedAttentionInputError, message):
                self.attend(q, k, v, call["lengths"], call["cu"], call["max_q"], call["table"], check=True)
        run = jax.jit(
            lambda cu: ragged_attention_with_kvcache(
                q,
                k,
                v,
                lengths,
                cu_seqlens_q=cu,
                max_seqlen_q=max_q,
                page_table=table,
                check=True,
                implementation=self.implementation,
            )
        )
        with self.assertRaisesRegex(RaggedAttentionInputError, r"cu_seqlens_q"), input_errors():
            jax.block_until_ready(run(cu.at[2].set(cu[1] - 1)))
        jax.block_until_ready(run(cu))


# The xla path's extra mixes, dtypes and vmap run in the slow tier; every case, the appends and the tiles'
# arithmetic stay fast.
@slow_cases(
    "test_random_mixes",
    "test_half_precision0",
    "test_half_precision1",
    "test_vmap0",
    "test_vmap1",
    "test_sinks_gradient",
)
class XlaPackedTest(PackedKVCacheTest, XlaKVCacheConformance):
    __test__ = True
    implementation = "xla"

    def setUp(self):
        super().setUp()
        # Tiles of 2 queries and blocks of 8 rows (2 pages): chunks straddle tiles, sequences straddle blocks.
        self.enter_context(backend_options(query_tile=2, block_rows=8))

    @pytest.mark.slow
    def test_default_tiles_and_blocks(self):
        with backend_options(query_tile=None, block_rows=None):  # cache_attention.QUERY_TILE, the budget's rows
            self.check(self.mix())
            self.check(self.mix(paged=False))

    def test_return_overflow_counts_what_the_warning_names(self):
        # The warning for NumPy cu_seqlens_q recommends return_overflow=True: it counts the cut rows.
        q, k, v, lengths, _, _, table = self.mix(max_seqlen_q=6, batch=7)
        cu = np.asarray([0, 6, 7, 7, 9, 10, 12, 12], np.int32)  # sequence 0: 6 rows, 2 past max_seqlen_q = 4
        with pytest.warns(RaggedAttentionInputWarning, match=r"sequence 0 has 6 tokens.*return_overflow=True"):
            out, overflow = self.attend(q, k, v, lengths, np.asarray(cu), 4, table, return_overflow=True)
        self.assertEqual(tuple(int(x) for x in overflow), (2, 0, 0, 0))
        # Sequence 0's rows read NaN in both: equal as arrays.
        np.testing.assert_array_equal(
            np.asarray(out, np.float32),
            np.asarray(self.attend(q, k, v, lengths, jnp.asarray(cu), 4, table), np.float32),
        )
        bad = jnp.asarray(cu).at[3].set(5)  # below an earlier entry
        overflow = jax.jit(
            lambda cu: self.attend(q, k, v, lengths, cu, 4, table, return_overflow=True, return_stats=True)[2]
        )(bad)
        self.assertEqual(int(overflow.invalid_cu_seqlens), 1)


def _fa3_tile_stand_in(q, k_cache, v_cache, lengths, page_table, config, window, used_q=None):
    """FA3's call as fa3_kvcache makes it for packed tiles, computed by the xla path: batch mode, each tile's
    first used_q rows aligned bottom-right on its `lengths` rows, FA3's window (is_causal, left, right); NaN
    where it is handed a length or entry outside the cache (fa3_emulator.kvcache_reads_unchecked)."""
    is_causal, left, right = window
    config = dataclasses.replace(
        config, is_causal=is_causal, window_left=None if left < 0 else left, window_right=None if right < 0 else right
    )
    used = jnp.full((q.shape[0],), q.shape[1], jnp.int32) if used_q is None else used_q
    position = lengths[:, None] - used[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    first, last = band(position, lengths[:, None], config)
    last = jnp.where(jnp.arange(q.shape[1])[None, :] < used[:, None], last, -1)
    out, lse = cache_attention._blocked(
        q, k_cache, v_cache, lengths, first, last, page_table, config, cache_attention.block_rows(config)
    )
    out, lse = fa3_emulator.kvcache_reads_unchecked(out, lse, lengths, page_table, config)
    return out, jnp.where(jnp.isneginf(lse), jnp.inf, lse)  # FA3's lse of a query without keys


@pytest.mark.slow  # FA3's tiles on a stand-in
class Fa3TilesStandInTest(PackedKVCacheTest):
    """fa3_kvcache.attend_packed on any backend: the tiles, seqused_q / seqused_k and masks it hands FA3, the
    kernel call replaced by _fa3_tile_stand_in; tiles of 2 query rows (packed_tile_rows 4, group 2), so chunks
    span several."""

    __test__ = True
    implementation = "fa3"

    def setUp(self):
        super().setUp()
        patchers = [
            mock.patch.object(target, name, value)
            for target, name, value in (
                (fa3_kvcache, "_fa3_call", _fa3_tile_stand_in),
                (_fa3, "unavailable_reason", lambda: None),
                (_fa3, "FA3_DTYPES", ("float32",)),
                (_fa3, "FA3_HEAD_DIM", self.head_dim),
            )
        ]
        for patcher in patchers:
            patcher.start()
            self.addCleanup(patcher.stop)
        self.enter_context(backend_options(packed_tile_rows=4))

    @parameterized.parameters(False, True)
    def test_non_causal_one_tile_per_sequence(self, paged):
        # Keys right of the diagonal: each sequence one tile of max_seqlen_q queries (2 x group 2 = 4 rows).
        args = self.mix(max_seqlen_q=2, paged=paged)
        self.check(args, is_causal=False)
        self.check(args, is_causal=False, local_window_size=(2, 1))


@pytest.mark.gpu
@pytest.mark.skipif(
    _fa3.unavailable_reason() is not None, reason=f"FlashAttention-3 unavailable: {_fa3.unavailable_reason()}"
)
class Fa3PackedTest(PackedKVCacheTest):
    """FA3's kernel (one call over tiles of 128 / group queries); pages of 40 rows (FA3 key tiles of 128 and
    pages straddle), unused rows and pages NaN, chunks of up to 70 queries (several tiles with GQA 4)."""

    __test__ = True
    implementation = "fa3"
    dtype = jnp.bfloat16
    head_dim = 128
    page_size = 40
    max_pages = 16
    max_seqlen_q = 70


class Fa3PackedWholeTilePagesTest(Fa3PackedTest):
    """The same with pages of 128 rows, a multiple of FA3's key tile: the pages where FA3 would take its TMA
    loader (which loads whole key tiles, unused rows included) if a packed tile held more query rows than its
    query tile (fa3/kvcache.py zero_fill_rows); unused rows and pages NaN."""

    page_size = 128
    max_pages = 6


def _paged_handler_stand_in(
    q, k_cache, v_cache, table, seq_len_q, seq_len_kv, offset_q, offset_o, offset_stats, *, types, **attributes
):
    """What ffi/paged_handler.cc promises for packed queries, in jnp: the buffer contract it checks (shapes,
    offsets [B + 1], total_q), then sequence b's seq_len_q[b] queries at rows offset_q[b] / (Hq * Dqk) on, over
    rows [0, seq_len_kv[b]) of its pages, query i on diagonal seq_len_kv[b] - seq_len_q[b] + i with the bounds,
    stats token-major [T, Hq]. Rows cuDNN does not write (no keys, no query) hold NaN: the callers must mask
    them. The spare rows past the last query (paged.PACKED_SPARE_ROWS) must be there and zero in q."""
    batch, heads_q, dqk = attributes["num_seqs"], attributes["num_heads_q"], attributes["head_dim_qk"]
    rows, dv, total = attributes["seqlen_q"], attributes["head_dim_v"], attributes["total_q"]
    assert total == q.shape[0] > paged.PACKED_SPARE_ROWS and q.shape[1:] == (heads_q, dqk), (q.shape, attributes)
    assert offset_q.shape == offset_o.shape == offset_stats.shape == (batch + 1,)
    assert table.shape == (batch, attributes["max_pages"])
    assert [t.shape for t in types][:2] == [(total, heads_q, dv), (total, heads_q)]
    cu = offset_q // (heads_q * dqk)
    if not isinstance(cu, jax.core.Tracer):  # the values' contract, where they are known (not under jit)
        np.testing.assert_array_equal(np.asarray(offset_o), np.asarray(cu * heads_q * dv))
        np.testing.assert_array_equal(np.asarray(offset_stats), np.asarray(cu * heads_q))
        real = total - paged.PACKED_SPARE_ROWS
        assert bool(jnp.all(seq_len_q <= cu[1:] - cu[:-1])) and bool(jnp.all((cu >= 0) & (cu <= real)))
        assert not np.asarray(q[real:], np.float32).any(), "the spare rows are not zero"
    slot = jnp.arange(rows, dtype=jnp.int32)
    live = slot[None, :] < seq_len_q[:, None]  # [B, Sq]
    q_rows = jnp.clip(cu[:-1, None] + slot[None, :], 0, total - 1)
    pages = k_cache.shape[1]
    key_row = jnp.arange(table.shape[1] * pages, dtype=jnp.int32)
    k = k_cache[table].reshape(batch, -1, *k_cache.shape[2:])  # [B, capacity, Hkv, D]
    v = v_cache[table].reshape(batch, -1, *v_cache.shape[2:])
    group = heads_q // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = (
        jnp.einsum(
            "bqhd,bkhd->bhqk", q[q_rows].astype(jnp.float32), k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
        * attributes["scale"]
    )
    if attributes["softcap"] > 0:  # before the masks, as the graph's score modifier caps
        s = attributes["softcap"] * jnp.tanh(s / attributes["softcap"])
    position = seq_len_kv[:, None] - seq_len_q[:, None] + slot[None, :]  # [B, Sq]
    keep = key_row[None, None, :] < seq_len_kv[:, None, None]
    if attributes["left_bound"] >= 0:
        keep &= key_row[None, None, :] >= position[:, :, None] - attributes["left_bound"]
    if attributes["right_bound"] >= 0:
        keep &= key_row[None, None, :] <= position[:, :, None] + attributes["right_bound"]
    s = jnp.where(keep[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, Hq, Sq]
    written = live & jnp.any(keep, axis=-1)  # [B, Sq]
    p = jnp.where(keep[:, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    v = jnp.where(key_row[None, :, None, None] < seq_len_kv[:, None, None, None], v, 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    o = jnp.full((total, heads_q, dv), jnp.nan, q.dtype)
    o = o.at[jnp.where(written, q_rows, total)].set(out.astype(q.dtype), mode="drop")
    stats = jnp.full((total, heads_q), jnp.nan, jnp.float32)
    stats = stats.at[jnp.where(written, q_rows, total)].set(lse.transpose(0, 2, 1), mode="drop")
    return o, stats, jnp.zeros(types[2].shape, jnp.uint8)


# The route takes a contiguous cache as pages of one page per sequence: the fast tier runs the paged cases and one
# contiguous case, the slow tier the other contiguous ones, the random mixes, vmap and check mode (which the xla
# classes run fast).
@slow_cases(
    "test_random_mixes",
    "test_jit0",
    "test_vmap0",
    "test_vmap1",
    "test_check_names_cache_seqlens",
    "test_check_names_page_table",
    *(
        f"test_attention_{case}_contiguous"
        for case in ("causal", "mqa", "sinks", "mha", "non_causal", "scale", "softcap")
    ),
)
class CudnnPackedStandInTest(PackedKVCacheTest):
    """cudnn_kvcache.attend_packed on any machine: paged.attend_packed's offsets, seq_len_q and stats gather,
    the head / tail split per row and its merge, the contiguous cache's page view; the FFI handler replaced by
    _paged_handler_stand_in (its buffer contract asserted), TAIL small so heads and tails both carry keys."""

    __test__ = True
    implementation = "cudnn"

    def setUp(self):
        super().setUp()
        real_ffi_call = jax.ffi.ffi_call

        def ffi_call(target, types, **kwargs):
            if target != paged.TARGET:
                return real_ffi_call(target, types, **kwargs)
            return lambda *args, **attributes: _paged_handler_stand_in(*args, types=types, **attributes)

        patchers = [
            mock.patch.object(target, name, value)
            for target, name, value in (
                (jax.ffi, "ffi_call", ffi_call),
                (paged, "graph_info", lambda config, bounds=None: {"workspace_bytes": 16}),
                (paged, "ffi_kwargs", paged.attributes),
                (extension, "cudnn_unavailable_reason", lambda: None),
                (paged, "unsupported_reason", lambda config, bounds=None: paged.static_reason(config)),
                (paged, "CUDNN_DTYPES", ("float32",)),
                (known_issues, "fence", lambda *args, **kwargs: None),
            )
        ]
        for patcher in patchers:
            patcher.start()
            self.addCleanup(patcher.stop)
        self.enter_context(backend_options(tail_rows=7))

    def test_the_stand_in_is_what_runs(self):
        with mock.patch.object(paged, "attend_packed", wraps=paged.attend_packed) as spy:
            self.check(self.mix())
        self.assertTrue(spy.called)
        heads = np.asarray(spy.call_args.args[3])  # the rows the graph reads: all but the tail of 7 (tail_rows)
        self.assertTrue((heads > 0).any(), f"no sequence reached the graph (heads {heads})")


@pytest.mark.gpu
@pytest.mark.skipif(
    jax_ragged_attn.cudnn_unavailable_reason() is not None,
    reason=f"cuDNN path unavailable: {jax_ragged_attn.cudnn_unavailable_reason()}",
)
class CudnnPackedTest(PackedKVCacheTest):
    """cuDNN's paged graph with ragged Q / O (ffi/paged_graph.h), bf16, head dim 128; pages of 32 rows, so the
    kernel's key tiles straddle pages; unused rows and pages NaN; chunks of up to 70 queries."""

    __test__ = True
    implementation = "cudnn"
    dtype = jnp.bfloat16
    head_dim = 128
    page_size = 32
    max_pages = 24
    max_seqlen_q = 70
    bit_reproducible = False  # the paged graphs' stats once differed by a float32 ulp between runs (paged.py)


def test_fa3_declines_what_one_tile_per_sequence_cannot_hold():
    config = decode_config(
        batch=4,
        seqlen_q=64,
        num_heads_q=32,
        num_heads_kv=8,
        page_size=256,
        num_pages=64,
        scale=1.0,
        is_causal=False,
        total_q=100,
    )
    with mock.patch.object(known_issues, "fa3_version", lambda: fa3_kvcache.AUDITED_WHEEL):
        assert "max_seqlen_q x (Hq / Hkv) <= 128" in fa3_kvcache.packed_reason(config)
        assert fa3_kvcache.packed_reason(dataclasses.replace(config, is_causal=True)) is None
        assert fa3_kvcache.packed_tile(dataclasses.replace(config, is_causal=True)) == 32  # 128 rows / group 4
        assert fa3_kvcache.packed_reason(dataclasses.replace(config, seqlen_q=32)) is None


@pytest.mark.parametrize("version, rows", [((0, 2, 3), 128), ((0, 2, 4), 64), ((0, 3, 0), 64), (None, 64)])
def test_fa3_tiles_hold_128_query_rows_only_on_the_audited_wheel(version, rows):
    """Up to 128 query rows keep FA3 off TMA (its zero-filling loader) only where its head-dim-128 query tile is
    128 rows, as in flash-attn3-jax 0.2.3; upstream FA3 also has a 64-row tile, so any other wheel gets 64."""
    config = decode_config(
        batch=4,
        seqlen_q=64,
        num_heads_q=32,
        num_heads_kv=8,
        page_size=256,
        num_pages=64,
        scale=1.0,
        total_q=100,
    )
    with mock.patch.object(known_issues, "fa3_version", lambda: version):
        assert fa3_kvcache.zero_fill_rows() == rows
        assert fa3_kvcache.packed_tile(config) == rows // 4
        assert fa3_kvcache.route(dataclasses.replace(config, total_q=0, seqlen_q=16)) == "one_call"  # 64 rows
        assert fa3_kvcache.route(dataclasses.replace(config, total_q=0, seqlen_q=17)) == "head_tail"


def test_query_tiles_cover_every_query_once():
    rng = np.random.default_rng(0)
    batch, max_q, total = 6, 7, 44  # one shape for every draw: the op-by-op arithmetic compiles once per size
    config = decode_config(
        batch=batch,
        seqlen_q=max_q,
        num_heads_q=2,
        num_heads_kv=1,
        head_dim_qk=8,
        head_dim_v=8,
        dtype="float32",
        paged=False,
        page_size=50,
        num_pages=batch,
        max_pages=1,
        scale=1.0,
        total_q=total,
    )
    for size in (1, 2, 3, 7):
        for _ in range(3):
            counts = rng.integers(0, max_q + 1, batch)
            cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            lengths = rng.integers(0, 50, batch).astype(np.int32)
            tiles = query_tiles(jnp.asarray(cu), jnp.asarray(lengths), config, size)
            used, rows, positions = (np.asarray(x) for x in (tiles.slot_used(), tiles.rows(), tiles.positions()))
            np.testing.assert_array_equal(np.sort(rows[used]), np.arange(cu[-1]))  # every query row once
            sequence = np.asarray(tiles.sequence)
            for n, i in zip(*np.nonzero(used)):
                b = sequence[n]
                assert cu[b] <= rows[n, i] < cu[b + 1]
                assert positions[n, i] == lengths[b] - counts[b] + rows[n, i] - cu[b]


# ---- kvcache_append with cu_seqlens_k_new (implementation-independent) -----------------------------------------


class PackedAppendTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.rng = np.random.default_rng(zlib.crc32(self.id().encode()))

    def expected(self, k, k_new, lengths, cu, table=None):
        """The NumPy append: row t of sequence b to cache row lengths[b] + t - cu[b] where that row exists."""
        want = k.copy()
        for b in range(len(cu) - 1):
            for t in range(cu[b], cu[b + 1]):
                row = lengths[b] + t - cu[b]
                if table is None:
                    if row < k.shape[1]:
                        want[b, row] = k_new[t]
                else:
                    page_size = k.shape[1]
                    if row < table.shape[1] * page_size and 0 <= table[b, row // page_size] < k.shape[0]:
                        want[table[b, row // page_size], row % page_size] = k_new[t]
        return want

    def test_contiguous(self):
        k = self.rng.standard_normal((3, 6, 2, 4)).astype(np.float32)
        k_new = self.rng.standard_normal((9, 2, 4)).astype(np.float32)
        lengths = np.array([0, 4, 5], np.int32)  # 4 + 3 rows: the last past the capacity of 6
        cu = np.array([0, 3, 6, 8], np.int32)  # row 8: past cu[-1], never written
        k2, v2, _ = kvcache_append(
            jnp.asarray(k), jnp.asarray(-k), jnp.asarray(k_new), jnp.asarray(-k_new), lengths, cu_seqlens_k_new=cu
        )
        want = self.expected(k, k_new, lengths, cu)
        np.testing.assert_array_equal(k2, want)
        np.testing.assert_array_equal(v2, -want)

    def test_paged_overflow_and_bad_entries_are_never_written(self):
        k = self.rng.standard_normal((6, 2, 1, 3)).astype(np.float32)  # 6 pages of 2 rows
        k_new = self.rng.standard_normal((10, 1, 3)).astype(np.float32)
        table = np.array([[4, 1, -1], [0, 99, 2], [3, 5, 5]], np.int32)
        lengths = np.array([1, 2, 5], np.int32)
        cu = np.array([0, 3, 6, 9], np.int32)
        # sequence 0: rows 1-3 on pages 4, 1, 1; sequence 1: rows 2-3 on page 99 (outside: dropped), row 4 on
        # page 2; sequence 2: row 5 on page 5, rows 6-7 past its capacity of 6 (dropped).
        k2, _, _ = kvcache_append(
            jnp.asarray(k),
            jnp.asarray(k),
            jnp.asarray(k_new),
            jnp.asarray(k_new),
            lengths,
            cu_seqlens_k_new=cu,
            page_table=table,
        )
        want = self.expected(k, k_new, lengths, cu, table)
        np.testing.assert_array_equal(k2, want)
        untouched = [p for p in range(6) if p not in (4, 1, 2, 5)]
        np.testing.assert_array_equal(np.asarray(k2)[untouched], k[untouched])  # no other page changes

    def test_random_appends_then_attend(self):
        page_size, max_pages = 4, 5
        batch = 6
        counts = self.rng.integers(0, 6, batch)
        lengths = self.rng.integers(0, 18, batch).astype(np.int32)
        num_pages = batch * max_pages
        table = self.rng.permutation(num_pages).reshape(batch, max_pages).astype(np.int32)
        k = self.rng.standard_normal((num_pages, page_size, 2, 8)).astype(np.float32)
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        k_new = self.rng.standard_normal((int(cu[-1]) + 2, 2, 8)).astype(np.float32)
        k2, v2, _ = kvcache_append(
            jnp.asarray(k),
            jnp.asarray(k),
            jnp.asarray(k_new),
            jnp.asarray(k_new),
            lengths,
            cu_seqlens_k_new=cu,
            page_table=table,
        )
        np.testing.assert_array_equal(k2, self.expected(k, k_new, lengths, cu, table))
        q = jnp.asarray(self.rng.standard_normal((k_new.shape[0], 4, 8)), jnp.float32)
        out = ragged_attention_with_kvcache(
            q, k2, v2, lengths + counts, cu_seqlens_q=cu, max_seqlen_q=6, page_table=table, implementation="xla"
        )
        expected = reference_kvcache_attention_packed(q, k2, v2, lengths + counts, cu, 6, page_table=table)
        assert_close(out, expected["out"], jnp.float32, "out after the append")

    def test_returns_the_lengths_after(self):
        k = jnp.zeros((3, 6, 1, 2), jnp.float32)
        k_new = jnp.ones((6, 1, 2), jnp.float32)
        cu = jnp.asarray([0, 3, 3, 9], jnp.int32)  # 9 is clamped to the 6 rows: sequence 2 has 3 new ones
        _, _, after = kvcache_append(k, k, k_new, k_new, jnp.asarray([1, 2, -4], jnp.int32), cu_seqlens_k_new=cu)
        np.testing.assert_array_equal(after, [4, 2, 3])  # -4 is clamped to 0, where its new rows are written

    def test_check_names_the_rows_never_written(self):
        k = jnp.zeros((6, 2, 1, 3), jnp.float32)
        k_new = jnp.ones((9, 1, 3), jnp.float32)
        table = jnp.asarray([[4, 1, -1], [0, 99, 2], [3, 5, 5]], jnp.int32)
        cu = jnp.asarray([0, 3, 6, 8], jnp.int32)
        kvcache_append(
            k,
            k,
            k_new,
            k_new,
            jnp.asarray([1, 2, 2], jnp.int32),
            cu_seqlens_k_new=cu,
            page_table=table.at[1, 1].set(3),
            check=True,
        )  # valid
        for lengths, bad_table, message in [
            ([1, 2, 2], table, r"page_table\[1, 1\] = 99.*sequence 1"),
            ([1, 2, 5], table.at[1, 1].set(3), r"sequence 2.*cache_seqlens\[2\] = 5.*2 new rows.*capacity 6"),
        ]:
            with self.assertRaisesRegex(RaggedAttentionInputError, message):
                kvcache_append(
                    k,
                    k,
                    k_new,
                    k_new,
                    jnp.asarray(lengths, jnp.int32),
                    cu_seqlens_k_new=cu,
                    page_table=bad_table,
                    check=True,
                )
        with self.assertRaisesRegex(RaggedAttentionInputError, r"cu_seqlens_k_new"):
            kvcache_append(
                k,
                k,
                k_new,
                k_new,
                jnp.asarray([1, 2, 2], jnp.int32),
                cu_seqlens_k_new=cu.at[1].set(7),
                page_table=table.at[1, 1].set(3),
                check=True,
            )

    def test_validation_names_the_argument(self):
        k = jnp.zeros((3, 6, 2, 4), jnp.float32)
        lengths = jnp.zeros(3, jnp.int32)
        for call, message in [
            (
                lambda: kvcache_append(k, k, jnp.zeros((5, 2, 4), k.dtype), jnp.zeros((5, 2, 4), k.dtype), lengths),
                "k_new must have rank 4",
            ),
            (
                lambda: kvcache_append(
                    k,
                    k,
                    jnp.zeros((5, 2, 4), k.dtype),
                    jnp.zeros((5, 2, 4), k.dtype),
                    lengths,
                    cu_seqlens_k_new=jnp.zeros(3, jnp.int32),
                ),
                "cu_seqlens_k_new must be",
            ),
            (
                lambda: kvcache_append(
                    k,
                    k,
                    jnp.zeros((5, 3, 4), k.dtype),
                    jnp.zeros((5, 3, 4), k.dtype),
                    lengths,
                    cu_seqlens_k_new=jnp.zeros(4, jnp.int32),
                ),
                "k_new must be",
            ),
        ]:
            with self.assertRaisesRegex(ValueError, message):
                call()

    @parameterized.parameters(False, True)
    def test_in_place_when_donated(self, paged):
        k = jnp.zeros((64, 16, 4, 32) if paged else (8, 128, 4, 32), jnp.float32)  # 1 MiB each
        k_new = jnp.ones((12, 4, 32), jnp.float32)
        lengths = jnp.arange(8, dtype=jnp.int32)
        cu = jnp.asarray([0, 1, 1, 3, 4, 8, 9, 10, 10], jnp.int32)
        table = jnp.arange(64, dtype=jnp.int32).reshape(8, 8) if paged else None
        step = jax.jit(
            lambda k, v, k_new, lengths, cu, table: kvcache_append(
                k, v, k_new, k_new, lengths, cu_seqlens_k_new=cu, page_table=table
            ),
            donate_argnums=(0, 1),
        )
        compiled = step.lower(k, k, k_new, lengths, cu, table).compile()
        memory = compiled.memory_analysis()
        cache_bytes = k.size * 4
        self.assertEqual(memory.alias_size_in_bytes, 2 * cache_bytes)  # both caches are the outputs' buffers
        self.assertLess(memory.temp_size_in_bytes, cache_bytes // 4)  # and no copy of either is made
        k2, _, _ = step(k, jnp.zeros_like(k), k_new, lengths, cu, table)
        self.assertTrue(k.is_deleted())
        self.assertEqual(float(k2.sum()), 10 * 4 * 32)  # the 10 rows of cu[-1], each written once
