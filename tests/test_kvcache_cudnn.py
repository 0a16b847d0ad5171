"""implementation="cudnn" for ragged_attention_with_kvcache: cuDNN's paged SDPA forward (backends/cudnn/paged.py,
ffi/paged_graph.h) and the contiguous cache's two routes, against the float64 reference.

On a GPU, test_kvcache.py's KVCacheTest runs here three more times: paged caches through the paged graph
(`CudnnPagedKVCacheTest`: shuffled page tables, pages of 16 rows so a key tile spans many, page 0 always an
unused all-NaN page, which is where entries outside the cache and unused pages lead), the same with decode
steps' queries padded to 2 rows (`CudnnPaddedQueryKVCacheTest`), and contiguous caches through the paged
graph in their page view (`CudnnContiguousPagedKVCacheTest`); test_kvcache.py's CudnnKVCacheTest pins the
ragged route. Every row and page a sequence does not use is NaN: a
kernel that multiplies a masked probability by such a row's value (0 * NaN) fails them. Elsewhere they skip
with the reason; the pure-Python pieces (attributes, page-table sanitising, lengths, reasons, route pinning)
and the handler's argument checks (tests/native/ffi_call_frame.cc, as test_handler_contract.py) run on a CPU.

    pytest tests/test_kvcache_cudnn.py -k 'CudnnPagedKVCacheTest and test_attention_window_paged'
"""

from __future__ import annotations

import ctypes
import dataclasses
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
from decode_configs import decode_config  # tests/ is on sys.path under pytest
from test_handler_contract import BF16, F16, F32, S32, S64, U8, _array, harness  # noqa: F401 - harness: a fixture
from test_kvcache import KVCacheTest

import jax_ragged_attn
from jax_ragged_attn import ragged_attention_with_kvcache
from jax_ragged_attn.backends.cudnn import kvcache as cudnn_kvcache
from jax_ragged_attn.backends.cudnn import paged
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.backends.xla import kvcache as xla_kvcache
from jax_ragged_attn.config import KVCacheConfig
from jax_ragged_attn.testing import assert_close
from jax_ragged_attn.testing.kvcache_reference import reference_kvcache_attention
from jax_ragged_attn.testing.private_config import backend_options

_CUDNN_REASON = jax_ragged_attn.cudnn_unavailable_reason()
gpu_only = pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN path unavailable: {_CUDNN_REASON}")


def _config(**overrides) -> KVCacheConfig:
    fields = dict(
        batch=3,
        seqlen_q=2,
        head_dim_qk=64,
        head_dim_v=64,
        page_size=16,
        num_pages=10,
        max_pages=4,
        scale=0.125,
    )
    return decode_config(**{**fields, **overrides})


# ---- pure Python: runs everywhere -----------------------------------------------------------------------------


def test_attributes_of_a_paged_call():
    assert paged.attributes(_config(window_left=5)) == dict(
        num_seqs=3,
        seqlen_q=2,
        num_heads_q=8,
        num_heads_kv=2,
        head_dim_qk=64,
        head_dim_v=64,
        num_pages=10,
        page_size=16,
        max_pages=4,
        dtype=0,
        scale=0.125,
        softcap=0.0,
        left_bound=5,
        right_bound=0,
        total_q=0,
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(is_causal=False), dict(left_bound=-1, right_bound=-1)),
        (dict(is_causal=False, window_left=3, window_right=1), dict(left_bound=3, right_bound=1)),
        (dict(window_right=4), dict(left_bound=-1, right_bound=0)),  # causal caps the right side at 0
        (dict(dtype="float16", softcap=2.5), dict(dtype=1, softcap=2.5)),
        (dict(seqlen_q=1), dict(seqlen_q=1)),  # a true decode graph
        (dict(seqlen_q=5), dict(seqlen_q=5)),
        (dict(seqlen_q=7, total_q=30), dict(seqlen_q=7, total_q=30)),  # packed: ragged Q / O, max_seqlen_q rows
        # packed decode rows: a graph of 2 query rows, never 1 (cudnn-frontend#1083's ragged stats, paged.py)
        (dict(seqlen_q=1, total_q=30), dict(seqlen_q=2, total_q=30)),
    ],
)
def test_attributes_carry_masks_dtype_and_padded_queries(overrides, expected):
    got = paged.attributes(_config(**overrides))
    assert {name: got[name] for name in expected} == expected


def test_a_contiguous_cache_is_viewed_in_power_of_two_pages():
    contiguous = _config(paged=False, page_size=12, num_pages=3, max_pages=1)  # as kvcache_config makes it
    got = paged.attributes(contiguous)
    assert (got["num_pages"], got["page_size"], got["max_pages"]) == (9, 4, 3)  # 12 = 3 pages of 4
    np.testing.assert_array_equal(paged.page_table(None, contiguous), [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    assert [paged.contiguous_page_size(n) for n in (2048, 192, 640, 300, 7)] == [2048, 64, 128, 4, 1]


def test_a_paged_cache_needs_power_of_two_pages():
    assert "powers of 2, got page_size=40" in paged.static_reason(_config(page_size=40))
    assert paged.static_reason(_config(paged=False, page_size=40, num_pages=3, max_pages=1)) is None


def test_padded_query_graphs_when_asked():
    with mock.patch.object(paged, "MIN_SEQLEN_Q", 2):
        assert paged.attributes(_config(seqlen_q=1))["seqlen_q"] == 2


def test_page_table_entries_outside_the_cache_become_page_zero():
    table = jnp.asarray([[3, 9, -1, 10], [2**31 - 1, -(2**31), 0, 5]], jnp.int32)
    np.testing.assert_array_equal(paged.page_table(table, _config(batch=2)), [[3, 9, 0, 0], [0, 0, 0, 5]])


def test_sequences_without_keys_run_no_queries():
    seq_len_q, seq_len_kv = paged.seq_lens(jnp.asarray([5, 0, 1], jnp.int32), _config(seqlen_q=2))
    np.testing.assert_array_equal(seq_len_q, [2, 0, 2])
    np.testing.assert_array_equal(seq_len_kv, [5, 0, 1])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (dict(dtype="float32"), "bfloat16 or float16"),
        (dict(head_dim_qk=20), "Dqk=20"),
        (dict(head_dim_v=264), "Dv=264"),
        (dict(page_size=2**20, max_pages=2**12), "at most 2**31 - 1 rows"),
    ],
)
def test_static_reasons_name_the_cause(overrides, needle):
    assert needle in paged.static_reason(_config(**overrides))


def test_a_servable_shape_has_no_static_reason():
    assert paged.static_reason(_config(head_dim_qk=256, head_dim_v=128, dtype="float16")) is None


@pytest.mark.skipif(_CUDNN_REASON is None, reason="cuDNN is usable here: the missing-GPU reason cannot show")
def test_without_cudnn_the_reason_is_that_first():
    # float32 and head dim 20 would also be declined; where cuDNN cannot run at all, that is what is said.
    for config in (_config(), _config(dtype="float32", head_dim_qk=20)):
        assert cudnn_kvcache.unsupported_reason(config) == _CUDNN_REASON
        assert paged.unsupported_reason(config) == _CUDNN_REASON
    q = jnp.zeros((2, 1, 4, 16), jnp.float32)
    k = jnp.zeros((6, 4, 2, 16), jnp.float32)
    with pytest.raises(NotImplementedError, match="implementation='cudnn' cannot serve this call"):
        ragged_attention_with_kvcache(
            q, k, k, jnp.asarray([3, 0]), page_table=jnp.zeros((2, 3), jnp.int32), implementation="cudnn"
        )


def test_route_pinning():
    """Tests pin a route through cuDNN's options (testing.backend_options)."""
    contiguous = _config(paged=False, page_size=64, num_pages=3, max_pages=1)
    with backend_options(route="paged"):
        assert cudnn_kvcache.route(contiguous) == "paged"
    with backend_options(route="ragged"):
        assert cudnn_kvcache.route(contiguous) == "ragged"
        assert cudnn_kvcache.route(_config()) == "paged"  # a paged cache has one route
    with backend_options(route="head_tail"):
        assert cudnn_kvcache.pinned_route(contiguous) is None  # FA3's
    with pytest.raises(ValueError, match="must be None or one of"):
        with backend_options(route="fast"):
            pass


# ---- the extension: its field list and the handler's checks, on a CPU ----------------------------------------


def _ext():
    try:
        return extension.module()
    except NotImplementedError as error:
        pytest.skip(str(error))


def test_the_extension_declares_the_same_fields():
    ext = _ext()
    assert [name for name, _ in ext.paged_config_fields()] == list(paged.attributes(_config()))
    assert dict(ext.paged_config_fields())["scale"] == "float32"
    assert ext.paged_config_problem(paged.attributes(_config())) == ""
    assert "Hq must be a multiple of Hkv" in ext.paged_config_problem(
        {**paged.attributes(_config()), "num_heads_kv": 3}
    )
    assert "int max_seq_len_kv" in ext.paged_config_problem({**paged.attributes(_config()), "page_size": 2**30})
    with pytest.raises(ValueError, match="unknown paged configuration field"):
        ext.paged_config_problem({**paged.attributes(_config()), "stats_token_major": 0})
    name, stages = paged.TARGET, ext.registrations()[paged.TARGET]
    assert name == ext.targets()["paged_forward"] and type(stages["execute"]).__name__ == "PyCapsule"
    assert name not in (extension.FORWARD_TARGET, extension.BACKWARD_TARGET), "the training handlers stay the two"


B, SQ, HQ, HKV, D, PAGES, PAGE, MAX_PAGES = 2, 2, 4, 2, 64, 6, 16, 3
ATTRIBUTES = paged.attributes(
    _config(
        batch=B,
        seqlen_q=SQ,
        num_heads_q=HQ,
        num_heads_kv=HKV,
        head_dim_qk=D,
        head_dim_v=D,
        num_pages=PAGES,
        page_size=PAGE,
        max_pages=MAX_PAGES,
    )
)
ARGS = [
    (BF16, (B, SQ, HQ, D)),
    (BF16, (PAGES, PAGE, HKV, D)),
    (BF16, (PAGES, PAGE, HKV, D)),
    (S32, (B, MAX_PAGES)),
    (S32, (B,)),
    (S32, (B,)),
    (S32, (0,)),
    (S32, (0,)),
    (S32, (0,)),
]  # dense: no offsets
RESULTS = [(BF16, (B, SQ, HQ, D)), (F32, (B, HQ, SQ)), (U8, (4096,))]
# Packed queries: q, o [T, Hq, D] and stats [T, Hq] at ragged offsets [B + 1] (paged_graph.h).
T = 5
PACKED_ATTRIBUTES = {**ATTRIBUTES, "total_q": T}
PACKED_ARGS = [(BF16, (T, HQ, D)), *ARGS[1:6], (S32, (B + 1,)), (S32, (B + 1,)), (S32, (B + 1,))]
PACKED_RESULTS = [(BF16, (T, HQ, D)), (F32, (T, HQ)), RESULTS[2]]


def _call(harness, args, results, attributes):  # noqa: F811 - harness is the imported fixture
    ext = _ext()
    if ext.cudnn_version():
        pytest.skip("cuDNN is loaded in this process (a GPU run): the contract is checked where it is not")
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype = ctypes.c_void_p
    pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    handler = pointer(ext.registrations()[paged.TARGET]["execute"], None)
    kinds = dict(ext.paged_config_fields())
    attributes = sorted(attributes.items())  # XLA passes them sorted by name
    code = harness.harness_call(
        ctypes.c_void_p(handler),
        len(args),
        _array(ctypes.c_int, [d for d, _ in args]),
        _array(ctypes.c_int, [len(s) for _, s in args]),
        _array(ctypes.c_int64, [x for _, s in args for x in s]),
        len(results),
        _array(ctypes.c_int, [d for d, _ in results]),
        _array(ctypes.c_int, [len(s) for _, s in results]),
        _array(ctypes.c_int64, [x for _, s in results for x in s]),
        len(attributes),
        _array(ctypes.c_char_p, [n.encode() for n, _ in attributes]),
        _array(ctypes.c_int, [F32 if kinds.get(n) == "float32" else S64 for n, _ in attributes]),
        _array(ctypes.c_double, [float(v) for _, v in attributes]),
    )
    return code, harness.harness_message().decode()


def test_the_handler_passes_every_check_of_a_valid_call(harness):  # noqa: F811
    for args, results, attributes in ((ARGS, RESULTS, ATTRIBUTES), (PACKED_ARGS, PACKED_RESULTS, PACKED_ATTRIBUTES)):
        code, message = _call(harness, args, results, attributes)
        assert code != 0 and "cuDNN is not loaded" in message, (code, message)
    traits = harness.harness_traits(
        ctypes.c_void_p(ctypes.pythonapi.PyCapsule_GetPointer(_ext().registrations()[paged.TARGET]["execute"], None))
    )
    assert traits & 1, "XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE"


@pytest.mark.parametrize(
    "args, results, attributes, message",
    [
        ([(BF16, (B, 1, HQ, D)), *ARGS[1:]], RESULTS, ATTRIBUTES, "q is [2, 1, 4, 64]"),
        ([ARGS[0], (F16, (PAGES, PAGE, HKV, D)), *ARGS[2:]], RESULTS, ATTRIBUTES, "k_cache is"),
        ([*ARGS[:2], (BF16, (PAGES, PAGE, HKV, 32)), *ARGS[3:]], RESULTS, ATTRIBUTES, "v_cache is [6, 16, 2, 32]"),
        ([*ARGS[:3], (S32, (B, MAX_PAGES + 1)), *ARGS[4:]], RESULTS, ATTRIBUTES, "page_table is [2, 4]"),
        ([*ARGS[:4], (S32, (B + 1,)), *ARGS[5:]], RESULTS, ATTRIBUTES, "seq_len_q is [3]"),
        ([*ARGS[:6], (S32, (B + 1,)), *ARGS[7:]], RESULTS, ATTRIBUTES, "offset_q is [3]"),  # dense: offsets unused
        ([(BF16, (T + 1, HQ, D)), *PACKED_ARGS[1:]], PACKED_RESULTS, PACKED_ATTRIBUTES, "q is [6, 4, 64]"),
        (ARGS, RESULTS, PACKED_ATTRIBUTES, "q is [2, 2, 4, 64]"),  # packed attributes, dense buffers
        ([*PACKED_ARGS[:7], (S32, (B,)), PACKED_ARGS[8]], PACKED_RESULTS, PACKED_ATTRIBUTES, "offset_o is [2]"),
        ([*PACKED_ARGS[:8], (S32, (B + 2,))], PACKED_RESULTS, PACKED_ATTRIBUTES, "offset_stats is [4]"),
        (PACKED_ARGS, [PACKED_RESULTS[0], (F32, (B, HQ, SQ)), RESULTS[2]], PACKED_ATTRIBUTES, "stats is [2, 4, 2]"),
        (PACKED_ARGS, [(BF16, (T, HQ, 32)), *PACKED_RESULTS[1:]], PACKED_ATTRIBUTES, "o is [5, 4, 32]"),
        (PACKED_ARGS, PACKED_RESULTS, {**PACKED_ATTRIBUTES, "total_q": -1}, "total_q must be 0"),
        (ARGS, [RESULTS[0], (F32, (B, SQ, HQ)), RESULTS[2]], ATTRIBUTES, "stats is [2, 2, 4]"),
        (ARGS, RESULTS, {**ATTRIBUTES, "dtype": 2}, "dtype must be 0 (bfloat16) or 1 (float16)"),
        (ARGS, RESULTS, {**ATTRIBUTES, "left_bound": -3}, "left_bound and right_bound"),
    ],
    ids=[
        "q",
        "k-dtype",
        "v-dim",
        "table",
        "seq_len_q",
        "dense-offsets",
        "packed-q",
        "packed-attributes",
        "packed-offset-o",
        "packed-offset-stats",
        "packed-dense-stats",
        "packed-o",
        "total-q",
        "stats-layout",
        "dtype",
        "bounds",
    ],
)
def test_the_handler_names_what_is_wrong(harness, args, results, attributes, message):  # noqa: F811
    code, got = _call(harness, args, results, attributes)
    assert code != 0 and message in got, (code, got)


# ---- on a GPU: the shared cases against the reference ---------------------------------------------------------


class _CudnnKVCacheCases(KVCacheTest):
    implementation = "cudnn"
    dtype = jnp.bfloat16
    head_dim = 64
    page_size = 16  # a key tile of 64 or 128 rows spans several pages, the unused ones among them
    # capacity 640: past cudnn_kvcache.TAIL (256), so the paged graph reads heads of several tiles, and
    # short sequences go to the xla tail alone; contiguous: 5 pages of 128 rows a sequence
    max_pages = 40
    route = None  # the route cudnn_kvcache.route picks
    bit_reproducible = False  # decode graphs (s_q = 1): stats one float32 ulp apart between two H200 runs

    def setUp(self):
        super().setUp()
        self.enter_context(backend_options(route=self.route))

    def make(self, **kwargs):
        """As KVCacheTest.make, with page 0 an unused, all-NaN page wherever one exists: entries outside the
        cache and a tile's pages past a sequence's end read page 0, so a leak of its rows shows as NaN."""
        q, k, v, lengths, table = super().make(**kwargs)
        if table is None:
            return q, k, v, lengths, table
        page_rows = np.isnan(np.asarray(k, np.float32)).reshape(k.shape[0], -1).all(axis=1)
        spare = np.flatnonzero(page_rows)
        if spare.size == 0 or page_rows[0]:
            return q, k, v, lengths, table
        other = int(spare[0])
        swap = np.arange(k.shape[0])
        swap[[0, other]] = [other, 0]
        remap = jnp.where((table == 0) | (table == other), jnp.where(table == 0, other, 0), table)
        return q, k[swap], v[swap], lengths, remap.astype(jnp.int32)


@gpu_only
class CudnnPagedKVCacheTest(_CudnnKVCacheCases):
    __test__ = True

    def test_page_zero_is_poisoned(self):
        _, k, _, _, table = self.make(paged=True)
        self.assertTrue(np.isnan(np.asarray(k[0], np.float32)).all(), "page 0 must be an unused, all-NaN page")

    def test_the_paged_graph_reads_heads(self):
        # Long sequences: the paged graph serves all but each one's last TAIL rows.
        q, k, v, lengths, table = self.make(paged=True, seqlen_q=3, lengths=[640, 600, 300, 257, 256, 10])
        with mock.patch.object(paged, "attend", wraps=paged.attend) as spy:
            self.check((q, k, v, lengths, table))
        self.assertTrue(spy.called)

    def test_the_paged_graph_runs(self):
        config = _config(page_size=self.page_size, max_pages=self.max_pages, num_pages=40)
        self.assertIsNone(cudnn_kvcache.unsupported_reason(config))
        self.assertEqual(cudnn_kvcache.route(config), "paged")
        self.assertGreaterEqual(paged.graph_info(config)["workspace_bytes"], 0)

    def test_half_precision_and_wide_heads(self):
        for dtype, head_dim in ((jnp.float16, 128), (jnp.bfloat16, 256)):
            with mock.patch.object(self, "dtype", dtype), mock.patch.object(self, "head_dim", head_dim):
                self.check(self.make(paged=True, seqlen_q=3, heads=(8, 2)), local_window_size=(20, 0))

    def test_long_sequences_over_many_tiles(self):
        # capacity 1024 rows: tiles in the middle of a sequence, and its end anywhere inside a page
        with mock.patch.object(self, "max_pages", 64):
            self.check(self.make(paged=True, seqlen_q=2, lengths=[1024, 1000, 517, 129, 3, 0]))
            self.check(
                self.make(paged=True, seqlen_q=4, lengths=[1024, 1000, 517, 129, 3, 0]), local_window_size=(300, 0)
            )  # a window that reaches the head: shifted bounds


@gpu_only
class CudnnPaddedQueryKVCacheTest(_CudnnKVCacheCases):
    """The same cases with decode steps' queries padded to 2 rows (paged.MIN_SEQLEN_Q = 2), as the ragged
    graphs do (graphs.py): the fallback if a cuDNN release's s_q = 1 graphs go wrong."""

    __test__ = True

    bit_reproducible = True  # observed in every run so far (cuDNN 9.19, H200)

    def setUp(self):
        super().setUp()
        patcher = mock.patch.object(paged, "MIN_SEQLEN_Q", 2)
        patcher.start()
        self.addCleanup(patcher.stop)


@gpu_only
class CudnnContiguousPagedKVCacheTest(_CudnnKVCacheCases):
    """Contiguous caches through the paged graph, in its page view (the route pinned)."""

    __test__ = True
    contiguous_only = True
    route = "paged"

    def test_the_route_is_the_paged_graph(self):
        q, k, v, lengths, _ = self.make()
        with mock.patch.object(paged, "attend", wraps=paged.attend) as spy:
            self.check((q, k, v, lengths, None))
        self.assertTrue(spy.called)


@gpu_only
def test_contiguous_routes_agree():
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((4, 2, 8, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((4, 96, 2, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((4, 96, 2, 64)), jnp.bfloat16)
    lengths = jnp.asarray([96, 50, 1, 0], jnp.int32)  # L = 96: the paged view takes pages of 32
    outs = {}
    for route in ("ragged", "paged"):
        with backend_options(route=route):
            outs[route] = ragged_attention_with_kvcache(q, k, v, lengths, implementation="cudnn", return_stats=True)
    expected = reference_kvcache_attention(q, k, v, lengths)
    for route, (out, stats) in outs.items():
        assert_close(out, expected["out"], jnp.bfloat16, f"out ({route})")
        assert_close(stats, expected["stats"], jnp.bfloat16, f"stats ({route})")


# ---- the paged route's head / tail split on any backend -------------------------------------------------------


def _paged_stand_in(q, k_cache, v_cache, lengths, page_table, config, bounds=None):
    """paged.attend as cudnn_kvcache calls it, computed by the xla path over the same page view and table:
    bottom-right over `lengths` rows with `bounds` (left, right)."""
    left, right = (config.left_bound, config.right_bound) if bounds is None else bounds
    k_cache, v_cache = paged.cache_view(k_cache, v_cache, config)
    table = paged.page_table(page_table, config)
    masks = dataclasses.replace(paged.as_paged(config), is_causal=False, window_left=left, window_right=right)
    return xla_kvcache.attend(q, k_cache, v_cache, lengths, table, masks)


@pytest.mark.slow  # every KV-cache case through cuDNN's paged route on a stand-in
class CudnnPagedRouteStandInTest(KVCacheTest):
    """cudnn_kvcache's paged route with the graph replaced by the xla path over the same page view, TAIL small
    so heads and tails both carry keys: the split, its shifted masks, the merge and the contiguous view."""

    __test__ = True
    implementation = "cudnn"
    page_size = 4  # a power of 2, as cuDNN takes; contiguous: capacity 24 is 3 pages of 8

    def setUp(self):
        super().setUp()
        patchers = [
            mock.patch.object(target, name, value)
            for target, name, value in (
                (paged, "attend", _paged_stand_in),
                (extension, "cudnn_unavailable_reason", lambda: None),
                (paged, "unsupported_reason", lambda config, bounds=None: paged.static_reason(config)),
                (paged, "CUDNN_DTYPES", ("float32",)),
            )
        ]
        for patcher in patchers:
            patcher.start()
            self.addCleanup(patcher.stop)
        self.enter_context(backend_options(route="paged", tail_rows=7))

    def test_the_stand_in_is_what_runs(self):
        q, k, v, lengths, table = self.make(paged=True, seqlen_q=2)
        with mock.patch.object(paged, "attend", wraps=_paged_stand_in) as spy:
            self.check((q, k, v, lengths, table))
        self.assertTrue(spy.called)
        heads = np.asarray(spy.call_args.args[3])  # the rows the graph reads: all but the tail of 7 (tail_rows)
        self.assertTrue((heads > 0).any(), f"no sequence reached the graph (heads {heads})")


def test_contiguous_caches_take_the_paged_route_where_it_serves():
    contiguous = _config(paged=False, page_size=8192, num_pages=3, max_pages=1)
    with mock.patch.object(paged, "unsupported_reason", return_value=None):
        assert cudnn_kvcache.route(contiguous) == "paged"
    with (
        mock.patch.object(paged, "unsupported_reason", return_value="no graph"),
        mock.patch.object(cudnn_kvcache.cudnn, "unsupported_reason", return_value=None),
    ):
        assert cudnn_kvcache.route(contiguous) == "ragged"
    with mock.patch.object(cudnn_kvcache.cudnn, "unsupported_reason", return_value=None):  # the window: ragged
        assert cudnn_kvcache.route(dataclasses.replace(contiguous, seqlen_q=5, window_left=253)) == "ragged"
