"""backends/shared/known_issues.py: the table's logic on a CPU, and on a GPU one reproducer per entry.

Each reproducer skips (with the reason) unless the loaded library is in its entry's range. In range, it runs the
affected feature with the fence lifted and asserts that the bug shows (a reproducer that no longer fails there
means the entry should be narrowed or dropped), then with the fence on asserts that cuDNN declines naming the
report and that implementation=None serves the call correctly. A worked-around entry whose bug this package's
graphs did not show on an affected release (cudnn-frontend#1083) names instead a test of its workaround, run on
every cuDNN; a fence whose bug did not show in this package's forms (TransformerEngine#2344) names a test of the
fence, and benchmarks/cudnn_bug_probe.py holds the forms tried. docs/CUDNN_VERSIONS.md brings a given cuDNN to
the GPU host and runs them:

    pytest -m gpu tests/test_known_issues.py -rs
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_configs import decode_config  # tests/ is on sys.path under pytest

from jax_ragged_attn import ragged_attention, ragged_attention_with_kvcache
from jax_ragged_attn.backends.cudnn import graphs
from jax_ragged_attn.backends.cudnn import kvcache as cudnn_kvcache
from jax_ragged_attn.backends.cudnn import paged as cudnn_paged
from jax_ragged_attn.backends.shared import extension, known_issues
from jax_ragged_attn.backends.shared.known_issues import TABLE, Versions
from jax_ragged_attn.config import AttentionOptions, KVCacheConfig, make_config
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked
from jax_ragged_attn.testing import assert_close, reference_attention
from jax_ragged_attn.testing.kvcache_reference import reference_kvcache_attention, reference_kvcache_attention_packed
from jax_ragged_attn.testing.private_config import backend_options

_CUDNN_REASON = extension.cudnn_unavailable_reason()
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _issue(key: str, op: str) -> known_issues.KnownIssue:
    return next(issue for issue in TABLE if issue.key == key and op in issue.ops)


def _kv_config(**overrides) -> KVCacheConfig:
    fields = dict(
        batch=4,
        page_size=16,
        num_pages=80,
        max_pages=32,
        scale=0.088,
    )
    return decode_config(**{**fields, **overrides})


def _packed_kv_config(**overrides) -> KVCacheConfig:
    """A packed decode step (4 sequences, one query each, grouped heads): what cudnn-frontend#1083's fence takes."""
    return _kv_config(**{"total_q": 4, **overrides})


def _ragged_config(seqlens_kv=(40, 300), max_q=64, heads=(8, 2), **options):
    total = sum(seqlens_kv)
    q = jax.ShapeDtypeStruct((max_q * len(seqlens_kv), heads[0], 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((total, heads[1], 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((len(seqlens_kv) + 1,), jnp.int32)
    return make_config(
        q, kv, kv, cu, cu, AttentionOptions(**options), max_seqlen_q=max_q, max_seqlen_kv=max(seqlens_kv)
    )


# ---- the table's logic: everywhere --------------------------------------------------------------------------


def test_every_entry_is_complete():
    names = {name for name, value in globals().items() if name.startswith("test_")}
    for issue in TABLE:
        assert issue.library in known_issues.LIBRARIES and set(issue.ops) <= set(known_issues.OPS), issue.key
        if issue.key.startswith("jax_ragged_attn#"):  # found here: the report is a section of the versions page
            section = issue.key.split("#")[1]
            assert issue.report == f"docs/CUDNN_VERSIONS.md#{section}", issue.key
            assert f'<a id="{section}"></a>' in (ROOT / "docs/CUDNN_VERSIONS.md").read_text(), issue.key
        else:
            assert issue.report.startswith("https://github.com/") and issue.key.split("#")[1] in issue.report, issue.key
        assert issue.first_affected is None or issue.first_fixed is None or issue.first_affected < issue.first_fixed
        path, _, test = issue.reproducer.partition("::")
        assert path == "tests/test_known_issues.py" and test in names, f"{issue.key}: no test {issue.reproducer}"
        assert issue.installable and issue.description and issue.feature, issue.key


@pytest.mark.parametrize(
    "version, affected",
    [
        ((9, 25, 1), False),
        ((9, 26, 0), True),
        ((9, 27, 0), True),
        ((9, 27, 99), True),
        ((9, 28, 0), True),
        ((9, 28, 1), False),
        (None, False),
    ],
)
def test_version_range_is_half_open(version, affected):
    assert _issue("cudnn-frontend#1083", "kvcache").affects(Versions(cudnn=version)) is affected


def test_an_open_start_covers_every_older_release():
    issue = _issue("cudnn-frontend#462", "ragged")
    assert issue.affects(Versions(cudnn_frontend=(1, 0, 0))) and issue.affects(Versions(cudnn_frontend=(1, 27, 0)))
    assert not issue.affects(Versions(cudnn_frontend=(1, 28, 0)))
    assert not issue.affects(Versions(cudnn=(9, 10, 0)))  # another library's version does not count


def test_architectures_narrow_an_entry():
    hopper_only = dataclasses.replace(_issue("TransformerEngine#1937", "ragged"), archs=frozenset({90}))
    assert hopper_only.affects(Versions(cudnn=(9, 10, 1), arch=90))
    assert not hopper_only.affects(Versions(cudnn=(9, 10, 1), arch=100))
    assert not hopper_only.affects(Versions(cudnn=(9, 10, 1), arch=None))


def test_a_workaround_runs_where_the_loaded_versions_need_it():
    key = known_issues.NO_QUERY_SEQUENCES
    assert known_issues.worked_around(key, Versions(cudnn=(9, 14, 0), arch=90))
    assert known_issues.worked_around(key, Versions(cudnn=(9, 18, 1), arch=100))
    assert not known_issues.worked_around(key, Versions(cudnn=(9, 19, 0), arch=90))
    assert not known_issues.worked_around(key, Versions())  # no cuDNN loaded: no cuDNN backward to mend
    with known_issues.lifted(key):  # a reproducer's switch
        assert not known_issues.worked_around(key, Versions(cudnn=(9, 14, 0), arch=90))
    with pytest.raises(ValueError, match="TransformerEngine#2344"):  # a fence is not a workaround
        known_issues.worked_around("TransformerEngine#2344", Versions(cudnn=(9, 14, 0)))


def test_a_worked_around_entry_declines_nothing_and_is_listed():
    versions = Versions(cudnn=(9, 14, 0), arch=90)
    assert known_issues.fence("cudnn", "ragged", _ragged_config(), versions) is None
    lines = known_issues.summary_lines(versions)
    assert any(known_issues.NO_QUERY_SEQUENCES in line and "worked around" in line for line in lines), lines


def test_transformer_engine_2185_takes_hopper_unequal_head_dims_and_the_widened_stats_backward(monkeypatch):
    from jax_ragged_attn.backends.cudnn import launch

    hopper_914 = Versions(cudnn=(9, 14, 0), arch=90)
    unequal = dataclasses.replace(_ragged_config(), head_dim_v=144)
    assert "TransformerEngine#2185" in known_issues.fence("cudnn", "ragged", unequal, hopper_914)
    for dims in ((64, 144), (128, 208), (256, 128)):  # 128 < Dv < 256 above Dqk, or the report's condition
        config = dataclasses.replace(_ragged_config(), head_dim_qk=dims[0], head_dim_v=dims[1])
        assert "TransformerEngine#2185" in known_issues.fence("cudnn", "ragged", config, hopper_914), dims
    # Neither: right on 9.14 (the widened 32 / 48 and 64 / 80 too), or outside both rules.
    for dims in ((192, 128), (128, 64), (64, 128), (32, 48), (64, 80), (128, 128), (96, 96), (256, 256)):
        config = dataclasses.replace(_ragged_config(), head_dim_qk=dims[0], head_dim_v=dims[1])
        assert known_issues.fence("cudnn", "ragged", config, hopper_914) is None, dims
    assert known_issues.fence("cudnn", "ragged", unequal, Versions(cudnn=(9, 14, 0), arch=100)) is None
    assert known_issues.fence("cudnn", "ragged", unequal, Versions(cudnn=(9, 19, 0), arch=90)) is None
    # A stats cotangent's backward runs Dv + 16 = 144 on Dqk 128: fenced there, not in the forward.
    monkeypatch.setattr(known_issues, "loaded_versions", lambda: hopper_914)
    assert "TransformerEngine#2185" in launch.stats_gradient_unsupported(_ragged_config())
    monkeypatch.setattr(known_issues, "loaded_versions", lambda: Versions(cudnn=(9, 19, 0), arch=90))
    assert launch.stats_gradient_unsupported(_ragged_config()) is None


def test_the_no_query_mask_keeps_exactly_the_key_rows_of_sequences_with_queries():
    from jax_ragged_attn.backends.cudnn.launch import _key_rows_of_sequences_with_queries

    config = dataclasses.replace(_ragged_config(seqlens_kv=(3, 2, 4, 2), max_q=4), capacity_kv=13, capacity_q=9)
    cu_q = jnp.asarray([0, 2, 2, 5, 7], jnp.int32)  # sequence 1 has no query rows
    cu_kv = jnp.asarray([0, 3, 5, 9, 11], jnp.int32)  # 2 rows of capacity padding
    expected = [1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
    got = _key_rows_of_sequences_with_queries(cu_q, cu_kv, config, (None, None))
    assert np.asarray(got).astype(int).tolist() == expected
    seqused_q = jnp.asarray([2, 0, 3, 0], jnp.int32)  # seqused_q = 0 takes sequence 3's queries away too
    got = _key_rows_of_sequences_with_queries(cu_q, cu_kv, config, (seqused_q, None))
    assert np.asarray(got).astype(int).tolist() == expected[:9] + [0, 0, 0, 0]


def _long_window():
    """A ragged call TransformerEngine#2344's fence takes on cuDNN 9.14 (a left window over 1500 keys)."""
    return _ragged_config(seqlens_kv=(40, 1500), local_window_size=(64, 64))


def test_the_fence_names_the_report_and_the_fixed_release():
    reason = known_issues.fence("cudnn", "ragged", _long_window(), Versions(cudnn=(9, 14, 0)))
    assert "TransformerEngine#2344" in reason and "https://github.com/NVIDIA/TransformerEngine/pull/2344" in reason
    assert "cuDNN 9.14.0" in reason and "fixed in cuDNN 9.15.0" in reason


@pytest.mark.parametrize(
    "overrides",
    [dict(total_q=0), dict(num_heads_q=2), dict(num_heads_kv=8)],
    ids=["fixed_form_decode", "mha_2", "mha_8"],
)
def test_the_packed_entry_reads_the_feature(overrides):
    issue = _issue("cudnn-frontend#1083", "kvcache")
    assert issue.applies("kvcache", _packed_kv_config())
    assert not issue.applies("kvcache", _packed_kv_config(**overrides))
    assert not issue.applies("ragged", _ragged_config(max_q=1))  # the ragged site is the other entry's


def test_the_fence_reads_the_backend_and_version():
    assert known_issues.fence("fa3", "ragged", _long_window(), Versions(cudnn=(9, 14, 0))) is None
    assert known_issues.fence("cudnn", "ragged", _long_window(), Versions(cudnn=(9, 19, 0))) is None


def test_the_window_entry():
    window = _ragged_config(seqlens_kv=(40, 1500), local_window_size=(64, 64))
    assert "TransformerEngine#2344" in known_issues.fence("cudnn", "ragged", window, Versions(cudnn=(9, 14, 0)))
    assert known_issues.fence("cudnn", "ragged", window, Versions(cudnn=(9, 15, 0))) is None
    short = _ragged_config(seqlens_kv=(40, 1000), local_window_size=(64, 64))
    assert known_issues.fence("cudnn", "ragged", short, Versions(cudnn=(9, 14, 0))) is None
    no_window = _ragged_config(seqlens_kv=(40, 1500), is_causal=True)
    assert known_issues.fence("cudnn", "ragged", no_window, Versions(cudnn=(9, 14, 0))) is None
    paged = _kv_config(window_left=300, max_pages=128, num_pages=600)  # capacity 2048
    assert "TransformerEngine#2344" in known_issues.fence("cudnn", "kvcache", paged, Versions(cudnn=(9, 14, 0)))


def test_the_blanket_entry_takes_every_call():
    for config, op in ((_ragged_config(), "ragged"), (_kv_config(seqlen_q=3, num_heads_q=2), "kvcache")):
        assert "TransformerEngine#1937" in known_issues.fence("cudnn", op, config, Versions(cudnn=(9, 10, 1)))
        assert known_issues.fence("cudnn", op, config, Versions(cudnn=(9, 10, 2))) is None


def test_worked_around_entries_decline_nothing_but_are_listed():
    config = _ragged_config(max_q=1)  # one query row, grouped heads, head-major stats: both workarounds apply
    versions = Versions(cudnn=(9, 27, 0), cudnn_frontend=(1, 27, 0))
    assert known_issues.fence("cudnn", "ragged", config, versions) is None
    assert known_issues.fence("cudnn", "kvcache", _packed_kv_config(), versions) is None
    listed = known_issues.summary_lines(versions)
    assert any("cudnn-frontend#462" in line and "worked around" in line for line in listed), listed
    ours = [line for line in listed if "cudnn-frontend#1083" in line]
    assert len(ours) == 2 and all("worked around" in line for line in ours), listed


def test_lifted_turns_a_fence_off_for_the_block_only():
    versions = Versions(cudnn=(9, 14, 0))
    with known_issues.lifted("TransformerEngine#2344"):
        assert known_issues.fence("cudnn", "ragged", _long_window(), versions) is None
        with known_issues.lifted("TransformerEngine#2344"):
            pass
        assert known_issues.fence("cudnn", "ragged", _long_window(), versions) is None  # the inner exit kept it
    assert known_issues.fence("cudnn", "ragged", _long_window(), versions) is not None
    with pytest.raises(ValueError, match="keys of known_issues.TABLE"):
        with known_issues.lifted("cudnn-frontend#0"):
            pass


def test_cudnn_version_encoding():
    assert known_issues.cudnn_version_tuple(92701) == (9, 27, 1)
    assert known_issues.cudnn_version_tuple(91900) == (9, 19, 0)
    assert known_issues.cudnn_version_tuple(0) is None


def test_the_warning_names_the_fenced_features_once(monkeypatch):
    monkeypatch.setattr(
        known_issues, "loaded_versions", lambda: Versions(cudnn=(9, 14, 0), cudnn_frontend=(1, 27, 0), arch=90)
    )
    monkeypatch.setattr(known_issues, "_warned", False)
    with pytest.warns(known_issues.KnownIssueWarning) as caught:
        known_issues.warn_once()
    text = str(caught[0].message)
    assert "cuDNN 9.14.0" in text and "TransformerEngine#2344" in text and "fixed in cuDNN 9.15.0" in text, text
    assert "cudnn-frontend#462" not in text  # worked around: nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        known_issues.warn_once()  # once a process


@pytest.mark.parametrize("version", [(9, 19, 0), (9, 27, 0)])  # 9.27: cudnn-frontend#1083 is worked around
def test_no_warning_where_nothing_is_fenced(monkeypatch, version):
    monkeypatch.setattr(known_issues, "loaded_versions", lambda: Versions(cudnn=version, arch=90))
    monkeypatch.setattr(known_issues, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        known_issues.warn_once()


def test_cudnn_backends_consult_the_fence(monkeypatch):
    """The ragged backend's unsupported_reason and the KV-cache one's paged route return the fence's reason
    before they ask cuDNN anything (so this runs on a CPU)."""
    monkeypatch.setattr(extension, "cudnn_unavailable_reason", lambda: None)
    monkeypatch.setattr(known_issues, "loaded_versions", lambda: Versions(cudnn=(9, 10, 1)))
    assert "TransformerEngine#1937" in graphs.unsupported_reason(_ragged_config())
    monkeypatch.setattr(known_issues, "loaded_versions", lambda: Versions(cudnn=(9, 14, 0)))
    paged_window = _kv_config(window_left=300, max_pages=128, num_pages=600)  # capacity 2048
    assert "TransformerEngine#2344" in cudnn_kvcache.unsupported_reason(paged_window)


def test_loaded_versions_on_this_machine():
    versions = known_issues.loaded_versions()
    if _CUDNN_REASON is not None:
        assert versions.cudnn is None
    else:
        assert versions.cudnn >= (9, 6, 0) and versions.arch is not None


# ---- the reproducers: on a GPU with an affected release ------------------------------------------------------

gpu = pytest.mark.gpu


def _need_cudnn() -> None:
    if _CUDNN_REASON is not None:
        pytest.skip(f"cuDNN path unavailable: {_CUDNN_REASON}")


def _need(issue: known_issues.KnownIssue) -> None:
    _need_cudnn()
    versions = known_issues.loaded_versions()
    if not issue.affects(versions):
        start = known_issues.format_version(issue.first_affected) if issue.first_affected else "any"
        pytest.skip(
            f"{issue.key} reproduces on {issue.library} [{start}, "
            f"{known_issues.format_version(issue.first_fixed)}), loaded: "
            f"{known_issues.format_version(versions.of(issue.library))} (docs/CUDNN_VERSIONS.md)"
        )


def _paged_decode(rng, lengths=(512, 300, 400, 280), heads=(8, 2), d=128, page=16, max_pages=32):
    """q [B, 1, Hq, d] and a paged cache (pages shuffled, unused ones NaN) whose sequences pass cuDNN's tail."""
    used = [math.ceil(n / page) for n in lengths]
    order = rng.permutation(sum(used))
    k, v = (np.full((len(order), page, heads[1], d), np.nan) for _ in range(2))
    table = np.full((len(lengths), max_pages), -1, np.int32)
    at = 0
    for b, n in enumerate(lengths):
        for p in range(used[b]):
            table[b, p], at = order[at], at + 1
            rows = min(page, n - p * page)
            k[table[b, p], :rows], v[table[b, p], :rows] = rng.standard_normal((2, rows, heads[1], d))
    q = rng.standard_normal((len(lengths), 1, heads[0], d))
    cast = lambda x: jnp.asarray(x, jnp.bfloat16)
    return cast(q), cast(k), cast(v), jnp.asarray(lengths, jnp.int32), jnp.asarray(table)


@gpu
def test_one_query_paged_decode_stats_are_right_on_every_cudnn():
    """The fixed form's decode (s_q = 1, grouped heads) writes dense stats, which cudnn-frontend#1083 does not
    reach (right on 9.27.0, an affected release, on the H200): so it is not fenced, and this checks it on every
    cuDNN the suite runs on."""
    _need_cudnn()
    q, k, v, lengths, table = _paged_decode(np.random.default_rng(1083))
    expected = reference_kvcache_attention(q, k, v, lengths, page_table=table)
    out, stats = ragged_attention_with_kvcache(
        q, k, v, lengths, page_table=table, return_stats=True, implementation="cudnn"
    )
    assert_close(out, expected["out"], jnp.bfloat16, "out")
    assert_close(stats, expected["stats"], jnp.bfloat16, "stats")


@gpu
def test_cudnn_frontend_1083_packed_decode_workaround():
    """cudnn-frontend#1083's packed site: a decode-only packed step (one query per sequence, grouped heads) is a
    set of one-query sequences with ragged stats, which the paged route's merge reads. Its graphs take at least
    paged.PACKED_MIN_SEQLEN_Q = 2 rows on every cuDNN; with them the step must be right on whatever cuDNN is
    loaded (with one row it was wrong on 9.19; on 9.27.0, in the report's range, right either way: the entry)."""
    _need_cudnn()
    assert cudnn_paged.PACKED_MIN_SEQLEN_Q >= 2
    q, k, v, lengths, table = _paged_decode(np.random.default_rng(10833))
    q = q[:, 0]  # [T = B, Hq, D]: one query row per sequence
    cu_q = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    expected = reference_kvcache_attention_packed(q, k, v, lengths, cu_q, 1, page_table=table)
    out, stats = ragged_attention_with_kvcache(
        q, k, v, lengths, cu_seqlens_q=cu_q, max_seqlen_q=1, page_table=table, return_stats=True, implementation="cudnn"
    )
    assert_close(out, expected["out"], jnp.bfloat16, "out (2-row packed graphs)")
    assert_close(stats, expected["stats"], jnp.bfloat16, "stats (2-row packed graphs)")


@gpu
def test_cudnn_frontend_1083_ragged_workaround():
    """The ragged site: one query row per sequence with grouped heads, through graphs of at least
    graphs.MIN_GRAPH_SEQLEN = 2 rows on every cuDNN (s_q = 1 graphs wrote wrong or NaN stats on 9.19; on 9.27.0
    they were right: the entry)."""
    _need_cudnn()
    assert graphs.MIN_GRAPH_SEQLEN >= 2
    rng = np.random.default_rng(10831)
    lengths_kv = (40, 300, 7)
    q = jnp.asarray(rng.standard_normal((3, 8, 128)), jnp.bfloat16)  # one query row per sequence
    k, v = (jnp.asarray(rng.standard_normal((sum(lengths_kv), 2, 128)), jnp.bfloat16) for _ in range(2))
    cu_q, cu_kv = jnp.arange(4, dtype=jnp.int32), jnp.asarray(np.cumsum((0,) + lengths_kv), jnp.int32)
    expected = reference_attention(
        q, k, v, cu_q, cu_kv, max_seqlen_q=1, max_seqlen_kv=300, is_causal=True, diagonal_alignment="bottom_right"
    )
    out, stats = ragged_attention(
        q,
        k,
        v,
        cu_q,
        cu_kv,
        max_seqlen_q=1,
        max_seqlen_kv=300,
        is_causal=True,
        diagonal_alignment="bottom_right",
        return_stats=True,
        implementation="cudnn",
    )
    assert_close(out, expected["out"], jnp.bfloat16, "out (s_q >= 2 graphs)")
    assert_close(np.asarray(stats).T, expected["stats"], jnp.bfloat16, "stats (s_q >= 2 graphs)")


def _nan_padded(rng, rows: int, heads: int, dim: int = 128) -> jax.Array:
    """bfloat16 [rows + 3, heads, dim]: random rows, then 3 rows of NaN capacity padding."""
    return jnp.asarray(
        np.concatenate([rng.standard_normal((rows, heads, dim)), np.full((3, heads, dim), np.nan)]), jnp.bfloat16
    )


def _window_batch(rng, lengths=(1500, 37)):
    q, k, v = (_nan_padded(rng, sum(lengths), 2) for _ in range(3))
    cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
    return q, k, v, cu, max(lengths)


@gpu
def test_transformer_engine_2344_fence():
    """The fence on its release: cuDNN declines naming the report, implementation=None serves the call right.
    The bug itself does not show on 9.14.0 in this package's forms (H100, the entry's comment): the
    lifted runs live in benchmarks/cudnn_bug_probe.py, where a form that shows it would be added."""
    issue = _issue("TransformerEngine#2344", "ragged")
    _need(issue)
    q, k, v, cu, longest = _window_batch(np.random.default_rng(2344))
    options = dict(max_seqlen_q=longest, max_seqlen_kv=longest, local_window_size=(64, 64))
    expected = reference_attention(q, k, v, cu, cu, **options)
    with pytest.raises(NotImplementedError, match="TransformerEngine#2344"):
        ragged_attention(q, k, v, cu, cu, implementation="cudnn", **options)
    assert_close(ragged_attention(q, k, v, cu, cu, **options), expected["out"], jnp.bfloat16, "out (fence on)")


@gpu
def test_reproduces_transformer_engine_2185_unequal_head_dims():
    """Dqk 128 / Dv 144 (the stats cotangent's widened backward) over sequences past one 128-row tile."""
    issue = _issue("TransformerEngine#2185", "ragged")
    _need(issue)
    rng = np.random.default_rng(2185)
    lengths = (300, 200, 129)
    cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
    rows = slice(0, sum(lengths))
    q, k, v, d_out = (_nan_padded(rng, sum(lengths), 4, dim) for dim in (128, 128, 144, 144))
    options = dict(max_seqlen_q=300, max_seqlen_kv=300, is_causal=True)
    expected = reference_attention(q[rows], k[rows], v[rows], cu, cu, d_out=d_out[rows], **options)

    def grads(**kwargs):
        _, vjp = jax.vjp(lambda q, k, v: ragged_attention(q, k, v, cu, cu, **options, **kwargs), q, k, v)
        return dict(zip(("dq", "dk", "dv"), (np.asarray(g, np.float64)[rows] for g in vjp(d_out))))

    with known_issues.lifted(issue.key):
        lifted = grads(implementation="cudnn")
    wrong = []
    for name, got in lifted.items():
        try:
            assert_close(got, expected[name], jnp.bfloat16, name)
        except AssertionError as error:
            wrong.append(str(error)[:120])
    assert wrong, f"{issue.key} did not reproduce on this cuDNN: every gradient was right"
    with pytest.raises(NotImplementedError, match="TransformerEngine#2185"):
        grads(implementation="cudnn")
    for name, got in grads().items():  # implementation=None: a backend that serves it
        assert_close(got, expected[name], jnp.bfloat16, f"{name} (fence on)")
    # The stats cotangent widens Dv 128 to 144: that backward is fenced too, the forward is not.
    loss = lambda q: jnp.sum(ragged_attention(q, k, k, cu, cu, return_stats=True, implementation="cudnn", **options)[1])
    loss(q)
    with pytest.raises(NotImplementedError, match="TransformerEngine#2185"):
        jax.grad(loss)(q)


def _no_query_grads(seed: int, packing: str = "none"):
    """(grads of q, k, v, the float64 reference's, the rows each holds) of 3 sequences whose middle one has 700
    keys and no query rows, with NaN capacity padding, through cuDNN with every output NaN-filled before the graph
    runs (poison_outputs): a row the graph owns but does not write reads NaN, whatever the allocator held.
    packing "kv": k and v in one [T, 2, H, D] buffer, whose gradient has a mask per part."""
    rng = np.random.default_rng(seed)
    slots_q, slots_kv = (5, 0, 12), (40, 700, 33)
    cu_q, cu_kv = (jnp.asarray(np.cumsum((0,) + s), jnp.int32) for s in (slots_q, slots_kv))
    q, d_out = (_nan_padded(rng, sum(slots_q), 8) for _ in range(2))
    k, v = (_nan_padded(rng, sum(slots_kv), 2) for _ in range(2))
    options = dict(max_seqlen_q=12, max_seqlen_kv=700, is_causal=True, diagonal_alignment="bottom_right")
    rows_q, rows_kv = slice(0, sum(slots_q)), slice(0, sum(slots_kv))
    expected = reference_attention(q[rows_q], k[rows_kv], v[rows_kv], cu_q, cu_kv, d_out=d_out[rows_q], **options)
    if packing == "kv":

        def attention(q, k, v):
            return ragged_attention_kvpacked(
                q, jnp.stack([k, v], axis=1), cu_q, cu_kv, implementation="cudnn", **options
            )
    else:

        def attention(q, k, v):
            return ragged_attention(q, k, v, cu_q, cu_kv, implementation="cudnn", **options)

    with backend_options(poison_outputs=True):
        _, vjp = jax.vjp(attention, q, k, v)
        grads = vjp(d_out)
    return [np.asarray(g, np.float64) for g in grads], expected, (rows_q, rows_kv)


@gpu
def test_reproduces_no_query_sequences():
    """The sequence without query rows (rows 40..739 of k and v) must get dK = dV = 0."""
    issue = _issue(known_issues.NO_QUERY_SEQUENCES, "ragged")
    _need(issue)
    with known_issues.lifted(issue.key):
        (_, dk, dv), _, _ = _no_query_grads(1914)
    rows = slice(40, 740)  # the sequence without query rows: cu_seqlens_kv [0, 40, 740, 773]
    unwritten = ~np.isfinite(dk[rows]).all(axis=(1, 2)) | ~np.isfinite(dv[rows]).all(axis=(1, 2))
    assert unwritten.any(), f"{issue.key} did not reproduce on this cuDNN: cuDNN wrote every no-query row"
    _check_no_query_grads(1915)


@gpu
@pytest.mark.parametrize("packing", ["none", "kv"])
def test_no_query_sequences_get_zero_key_gradients_on_every_cudnn(packing):
    """What the entry's workaround gives on its releases, cuDNN itself on the others (poisoned outputs)."""
    _need_cudnn()
    _check_no_query_grads(1919, packing)


def _check_no_query_grads(seed: int, packing: str = "none") -> None:
    grads, expected, (rows_q, rows_kv) = _no_query_grads(seed, packing)
    for name, got, rows in zip(("dq", "dk", "dv"), grads, (rows_q, rows_kv, rows_kv)):
        assert_close(got[rows], expected[name], jnp.bfloat16, f"{name} ({packing})")


@gpu
def test_reproduces_transformer_engine_1937_deep_check():
    """No trigger is public: the whole deep self-check on cuDNN, with the fence lifted, must show a failure."""
    from jax_ragged_attn.tools.selfcheck_deep import deep_check

    issue = _issue("TransformerEngine#1937", "ragged")
    _need(issue)
    rows = deep_check(("cudnn",), lift=(issue.key,))
    assert any(row.status == "failed" for row in rows), f"{issue.key}: every cuDNN row passed with the fence lifted"
    fenced = deep_check(("cudnn",))
    assert all(row.status == "declined" and issue.key in row.detail for row in fenced), fenced


@gpu
def test_reproduces_cudnn_frontend_462():
    """Needs the extension built against cudnn-frontend 1.27 (scripts/build_old_frontend.sh, .prebuilt127/): its
    run-time full-extent check is this entry's workaround, switched off through the extension."""
    issue = _issue("cudnn-frontend#462", "ragged")
    _need(issue)
    rng = np.random.default_rng(462)
    lengths = (300, 17, 129)
    q, k, v = (jnp.asarray(rng.standard_normal((sum(lengths), 4, 128)), jnp.bfloat16) for _ in range(3))
    cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)

    def grads(rows):  # `rows` of capacity: a graph of its own for each run
        pad = lambda x: jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, 0)))
        loss = lambda q, k, v: jnp.sum(
            ragged_attention(
                q,
                k,
                v,
                cu,
                cu,
                max_seqlen_q=300,
                max_seqlen_kv=300,
                is_causal=True,
                strategy="lean_memory",
                implementation="cudnn",
            ).astype(jnp.float32)
        )
        return jax.grad(loss, argnums=(0, 1, 2))(pad(q), pad(k), pad(v))

    extension.module().set_full_extent_fallback_enabled(False)
    try:
        lifted = grads(sum(lengths) + 1)
    finally:
        extension.module().set_full_extent_fallback_enabled(True)
    assert all(not np.abs(np.asarray(g, np.float32)).any() for g in lifted), f"{issue.key} did not reproduce"
    assert all(np.abs(np.asarray(g, np.float32)).any() for g in grads(sum(lengths) + 2)), "the fallback is off"


@gpu
def test_negative_lse_rows_keep_finite_gradients():
    """cudnn-frontend#628 / #1072 (Hopper backward, cuDNN before 9.26: rows whose log-sum-exp is below -88.7 and
    s_kv = 64 mod 128 got NaN) do not reach this package's graphs, which always carry the padding mask: checked
    on every release rather than fenced."""
    _need_cudnn()
    lengths, d = (192, 64), 64
    rng = np.random.default_rng(628)
    k = jnp.asarray(1.0 + 0.01 * rng.standard_normal((sum(lengths), 2, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((sum(lengths), 2, d)), jnp.bfloat16)
    q = jnp.full((sum(lengths), 2, d), -12.5, jnp.bfloat16)  # every score about scale * -800 = -100
    cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
    d_out = np.asarray(jnp.asarray(rng.standard_normal((sum(lengths), 2, d)), jnp.bfloat16).astype(jnp.float32))
    expected = reference_attention(q, k, v, cu, cu, max_seqlen_q=192, max_seqlen_kv=192, d_out=d_out)
    assert expected["stats"].max() < -88.7
    out, vjp = jax.vjp(
        lambda q, k, v: ragged_attention(q, k, v, cu, cu, max_seqlen_q=192, max_seqlen_kv=192, implementation="cudnn"),
        q,
        k,
        v,
    )
    for name, got in zip(("dq", "dk", "dv"), vjp(jnp.asarray(d_out, jnp.bfloat16))):
        assert_close(got, expected[name], jnp.bfloat16, name)


@pytest.mark.parametrize("packing", ["none", "kv", "qkv"])
@pytest.mark.parametrize("check", [False, True], ids=["unguarded", "check_mode"])
def test_the_no_query_workaround_zeroes_exactly_those_key_rows(monkeypatch, packing, check):
    """launch._backward_call with cuDNN's results stood in by 1 everywhere (as if every row were written): with
    the workaround on (cuDNN 9.14 loaded), every key row of a sequence without query rows reads 0 in each
    key-side gradient part, and every other real key row keeps the kernel's value (unguarded)."""
    from jax_ragged_attn.backends.cudnn import launch
    from jax_ragged_attn.index.packings import TABLE as PACKINGS

    if packing == "qkv":  # one buffer for q and kv: the sequence without queries has keys by seqused alone
        slots_q = slots_kv = (3, 5, 4)
        seqused_q, seqused_kv = jnp.asarray([3, 0, 4], jnp.int32), jnp.asarray([3, 2, 4], jnp.int32)
    else:
        slots_q, slots_kv = (3, 0, 4), (5, 6, 4)
        seqused_q = seqused_kv = None
    cu_q, cu_kv = (jnp.asarray(np.cumsum((0,) + s), jnp.int32) for s in (slots_q, slots_kv))
    tq, tkv = sum(slots_q) + 2, sum(slots_kv) + 2
    x = lambda t, h: jax.ShapeDtypeStruct((t, h, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)
    config = dataclasses.replace(
        make_config(
            x(tq, 4),
            x(tkv, 2),
            x(tkv, 2),
            cu,
            cu,
            AttentionOptions(check=check),
            max_seqlen_q=max(slots_q),
            max_seqlen_kv=max(slots_kv),
        ),
        packing=packing,
    )
    specs = PACKINGS[packing].gradient_specs(config)

    def fake_launch(direction, inputs, result_specs, names, cu_q, cu_kv, config, seqused=(None, None)):
        return [jnp.full(shape, 1.0, dtype) for shape, dtype, _ in specs], jnp.bool_(True)

    monkeypatch.setattr(launch, "_launch", fake_launch)
    monkeypatch.setattr(known_issues, "loaded_versions", lambda: Versions(cudnn=(9, 14, 0), arch=90))
    dummy = [jnp.zeros(shape, dtype) for shape, dtype, _ in specs]  # the fake launch never reads them
    grads = launch._backward_call(
        tuple(dummy),
        cu_q,
        cu_kv,
        jnp.zeros((tq, 4, 128), jnp.bfloat16),
        jnp.zeros((4, tq), jnp.float32),
        jnp.zeros((tq, 4, 128), jnp.bfloat16),
        config,
        (seqused_q, seqused_kv),
    )
    no_query_rows = np.zeros(tkv, bool)
    no_query_rows[int(cu_kv[1]) : int(cu_kv[2])] = True  # sequence 1 has keys and no query rows
    other_rows = ~no_query_rows & (np.arange(tkv) < int(cu_kv[-1]))  # capacity padding is zeroed anyway
    for grad, holds in zip(grads, (buffer.holds for buffer in PACKINGS[packing].buffers)):
        g = np.asarray(grad, np.float32)
        for part, side in enumerate(holds):
            values = g[:, part] if len(holds) > 1 else g
            if side == "q":
                continue
            rows = values.reshape(values.shape[0], -1)
            assert not rows[no_query_rows].any(), f"{packing} {side}: a no-query key row was not zeroed"
            if not check:  # check mode masks every row cuDNN does not own too
                assert (rows[other_rows] == 1).all(), f"{packing} {side}: another row was changed"
