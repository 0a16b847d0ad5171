"""Segment-id rows against the float64 reference applied to each segment on its own.

The expected results never go through the op or its packing: a plain Python loop finds each segment (a
maximal run of one positive id within a row), `reference_attention` attends it as a batch of one, and the
results are written back into [R, S] rows. Padding tokens, tokens of dropped segments and tokens cut by
max_seqlen are NaN-poisoned in q, k and v, and the cotangents are non-zero there, so any leak shows up as
NaN or as a non-zero where an exact zero is required. Inputs come from a seed derived from the test id.
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import some_fast  # tests/ is on sys.path under pytest

from jax_ragged_attn.backends.cudnn import launch
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.features.checks import RaggedAttentionInputError, RaggedAttentionInputWarning, input_errors
from jax_ragged_attn.inputs.segments import ragged_attention_segments, segments_to_cu_seqlens
from jax_ragged_attn.testing import assert_close
from jax_ragged_attn.testing.reference import reference_attention


def segment_runs(segment_ids) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every segment, in row-major order."""
    runs = []
    for r, row in enumerate(np.asarray(segment_ids).tolist()):
        start = 0
        for t in range(1, len(row) + 1):
            if t == len(row) or row[t] != row[start]:
                if row[start] > 0:
                    runs.append((r, start, t))
                start = t
    return runs


@dataclasses.dataclass(frozen=True)
class Case:
    segment_ids: tuple[tuple[int, ...], ...]
    heads: tuple[int, int] = (4, 2)  # (Hq, Hkv)
    dims: tuple[int, int] = (8, 8)  # (Dqk, Dv)
    is_causal: bool = False
    local_window_size: int | tuple[int, int] | None = None
    diagonal_alignment: str = "top_left"
    scale: float | None = None
    spare_segments: int = 0  # max_segments = segments found + this (negative: fewer slots than segments)
    max_seqlen: int | None = None
    dtype: str = "float32"

    @property
    def runs(self):
        return segment_runs(self.segment_ids)

    @property
    def max_segments(self) -> int:
        return max(len(self.runs) + self.spare_segments, 1)

    def options(self) -> dict:
        return dict(
            scale=self.scale,
            is_causal=self.is_causal,
            local_window_size=self.local_window_size,
            diagonal_alignment=self.diagonal_alignment,
        )


MIXED = (
    (1, 1, 1, 2, 2, 0, 0, 3),  # adjacent ids, a padding run in the middle, a segment touching the row end
    (0, 0, 5, 5, 5, 5, 5, 5),  # leading padding
    (0, 0, 0, 0, 0, 0, 0, 0),  # a row of padding only
    (1, 1, 1, 1, 1, 1, 1, 1),
)  # one full row, id 1 again
CASES = {
    "mixed_gqa_causal": Case(MIXED, heads=(4, 2), is_causal=True),
    # Row 0 ends and row 1 starts with id 1 (row 1 -> 2 likewise): contiguous in the flat buffer, yet two segments.
    "id_continues_across_rows_dv_differs": Case(
        ((3, 3, 1, 1, 1, 1), (1, 1, 1, 2, 2, 2), (2, 2, 0, 0, 0, 0)), heads=(6, 2), dims=(8, 16)
    ),
    # One id twice in a row with padding between (two segments); ids <= 0 are padding.
    "same_id_after_a_gap_negative_ids_window": Case(
        ((1, 1, 0, 1, 1, -2), (-1, 4, 4, 0, 4, 0)), heads=(2, 2), local_window_size=1
    ),
    "single_tokens_mqa_causal_window_bottom_right": Case(
        ((1, 2, 3, 3, 4, 5), (9, 8, 8, 8, 9, 9)),
        heads=(4, 1),
        is_causal=True,
        local_window_size=(1, 0),
        diagonal_alignment="bottom_right",
        scale=0.4,
        dtype="bfloat16",
    ),
    # Segments past max_segments (row-major order) are treated as padding.
    "overflow_drops_the_last_segments": Case(MIXED, is_causal=True, spare_segments=-2, dtype="bfloat16"),
    # Unused trailing slots are zero-length sequences; segments longer than max_seqlen are cut.
    "spare_slots_max_seqlen_window_tuple": Case(MIXED, local_window_size=(2, 1), spare_segments=3, max_seqlen=3),
    "all_padding": Case(((0, 0, 0, 0), (0, 0, 0, 0)), spare_segments=2),
}


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def attended_spans(case: Case):
    """(row, start, stop) of the tokens the op must attend: the first max_segments segments, cut to max_seqlen."""
    limit = case.max_seqlen or len(case.segment_ids[0])
    return [(r, a, min(b, a + limit)) for r, a, b in case.runs[: case.max_segments]]


def make_inputs(rng, case: Case, dtype):
    """q, k, v as jax arrays plus float64 copies of the same values; every token not attended is NaN."""
    rows, seq = np.shape(case.segment_ids)
    (hq, hkv), (dqk, dv) = case.heads, case.dims
    attended = np.zeros((rows, seq), bool)
    for r, a, b in attended_spans(case):
        attended[r, a:b] = True
    arrays = []
    for heads, dim in ((hq, dqk), (hkv, dqk), (hkv, dv)):
        x = rng.standard_normal((rows, seq, heads, dim)).astype(dtype)
        x[~attended] = np.nan
        arrays.append(x)
    return [jnp.asarray(x) for x in arrays], [x.astype(np.float64) for x in arrays], attended


def expected_results(case: Case, q64, k64, v64, d_out=None, d_stats=None) -> dict[str, np.ndarray]:
    """The reference on each segment alone; stats token-major [R, S, Hq]. Untouched tokens: 0 / -inf, as are
    segments longer than max_seqlen, whose rows the op makes NaN (loud_tokens) and which get no gradient."""
    rows, seq, hq, _ = q64.shape
    result = {"out": np.zeros((rows, seq, hq, v64.shape[3])), "stats": np.full((rows, seq, hq), -np.inf)}
    if d_out is not None:
        result.update(dq=np.zeros_like(q64), dk=np.zeros_like(k64), dv=np.zeros_like(v64))
    limit = case.max_seqlen or seq
    for r, a, b in case.runs[: case.max_segments]:
        if b - a > limit:
            continue
        cu = np.array([0, b - a])
        cotangents = {} if d_out is None else dict(d_out=d_out[r, a:b], d_stats=d_stats[r, a:b])
        one = reference_attention(
            q64[r, a:b],
            k64[r, a:b],
            v64[r, a:b],
            cu,
            cu,
            max_seqlen_q=limit,
            max_seqlen_kv=limit,
            **case.options(),
            **cotangents,
        )
        for name, value in one.items():
            result[name][r, a:b] = value
    return result


def loud_tokens(case: Case) -> np.ndarray:
    """[R, S] bool: the tokens of kept segments longer than max_seqlen, which read NaN."""
    loud = np.zeros(np.shape(case.segment_ids), bool)
    for r, a, b in case.runs[: case.max_segments]:
        loud[r, a:b] = b - a > (case.max_seqlen or loud.shape[1])
    return loud


def forward_and_vjp(case: Case, layout: str, q, k, v, segment_ids, cotangent):
    """out, stats and the q/k/v cotangents, under one jit that takes segment_ids as a traced argument."""

    def run(q, k, v, segment_ids, cotangent):
        def f(q, k, v):
            return ragged_attention_segments(
                q,
                k,
                v,
                segment_ids,
                max_segments=case.max_segments,
                max_seqlen=case.max_seqlen,
                stats_layout=layout,
                return_stats=True,
                implementation="xla",
                **case.options(),
            )

        outputs, vjp = jax.vjp(f, q, k, v)
        return outputs, vjp(cotangent)

    return jax.jit(run)(q, k, v, segment_ids, cotangent)


@pytest.mark.parametrize("case_name", CASES)
def test_matches_reference_per_segment(rng, case_name):
    case = CASES[case_name]
    dtype = case.dtype
    (q, k, v), (q64, k64, v64), attended = make_inputs(rng, case, dtype)
    rows, seq, hq, dv = q.shape[:3] + v.shape[3:]
    # Cotangents are non-zero on every token, padding included: they must be ignored there.
    d_out = rng.standard_normal((rows, seq, hq, dv)).astype(dtype).astype(np.float64)
    d_stats = rng.standard_normal((rows, seq, hq)).astype(np.float32).astype(np.float64)
    expected = expected_results(case, q64, k64, v64, d_out, d_stats)
    layout = ("token_major", "head_major")[list(CASES).index(case_name) % 2]
    to_layout = (lambda s: s) if layout == "token_major" else (lambda s: np.moveaxis(s, 2, 0))  # -> [Hq, R, S]
    cotangent = (jnp.asarray(d_out, dtype), jnp.asarray(to_layout(d_stats), jnp.float32))

    (out, stats), grads = forward_and_vjp(case, layout, q, k, v, jnp.asarray(case.segment_ids, jnp.int32), cotangent)

    assert out.shape == (rows, seq, hq, dv) and out.dtype == q.dtype
    assert stats.shape == to_layout(expected["stats"]).shape and stats.dtype == jnp.float32
    if layout == "head_major":
        stats = jnp.moveaxis(stats, 0, 2)
    what = f"{case_name} {dtype} {layout}: "
    loud = loud_tokens(case)
    assert np.isnan(np.asarray(out, np.float32)[loud]).all() and np.isnan(np.asarray(stats)[loud]).all(), what
    out, stats = jnp.where(loud[..., None, None], 0, out), jnp.where(loud[..., None], -jnp.inf, stats)
    assert_close(out, expected["out"], dtype, what + "out")
    assert_close(stats, expected["stats"], dtype, what + "stats")
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert grad.dtype == like.dtype, f"{what}{name} dtype {grad.dtype}"
        assert_close(grad, expected[name], dtype, what + name)
    # assert_close bounds; tokens that are not attended must be exact (and their NaN inputs never read).
    padding = ~attended
    np.testing.assert_array_equal(np.asarray(out)[padding], 0.0, err_msg=what + "out of padding tokens")
    np.testing.assert_array_equal(np.asarray(stats)[padding], -np.inf, err_msg=what + "stats of padding tokens")
    for name, grad in zip(("dq", "dk", "dv"), grads):
        np.testing.assert_array_equal(np.asarray(grad)[padding], 0.0, err_msg=f"{what}{name} of padding tokens")


def test_worked_example_layout():
    """The example of the module docstring, then the same ids with fewer slots than segments."""
    ids = jnp.array([[1, 1, 0, 2], [2, 0, 0, 2]], jnp.int32)
    layout = jax.jit(segments_to_cu_seqlens, static_argnames="max_segments")(ids, max_segments=4)
    np.testing.assert_array_equal(layout.cu_seqlens, [0, 2, 3, 4, 5])
    np.testing.assert_array_equal(layout.gather_index, [0, 1, 3, 4, 7, 2, 5, 6])
    np.testing.assert_array_equal(layout.scatter_index, [0, 1, 5, 2, 3, 6, 7, 4])
    np.testing.assert_array_equal(layout.valid, [[True, True, False, True], [True, False, False, True]])
    assert int(layout.num_segments) == 4
    assert layout.cu_seqlens.dtype == jnp.int32

    spare = segments_to_cu_seqlens(ids, max_segments=6)
    np.testing.assert_array_equal(spare.cu_seqlens, [0, 2, 3, 4, 5, 5, 5])  # trailing slots: zero-length

    short = segments_to_cu_seqlens(ids, max_segments=2)
    np.testing.assert_array_equal(short.cu_seqlens, [0, 2, 3])
    np.testing.assert_array_equal(short.valid, [[True, True, False, True], [False, False, False, False]])
    np.testing.assert_array_equal(short.gather_index, [0, 1, 3, 2, 4, 5, 6, 7])
    assert int(short.num_segments) == 4  # the overflow is visible to the caller


def test_layout_of_random_ids_is_an_in_bounds_permutation(rng):
    """Random ids (negative, repeated, huge) under budgets too small, tight-ish and generous, under jit."""
    layout_fn = jax.jit(segments_to_cu_seqlens, static_argnames="max_segments")
    rows, seq = 3, 7
    for draw in range(30):
        ids = rng.choice([-3, 0, 0, 1, 2, 2, 7, 2**31 - 1], size=(rows, seq)).astype(np.int32)
        runs = segment_runs(ids)
        max_segments = (1, 6, rows * seq)[draw % 3]
        layout = layout_fn(jnp.asarray(ids), max_segments=max_segments)
        gather, scatter = np.asarray(layout.gather_index), np.asarray(layout.scatter_index)
        cu = np.asarray(layout.cu_seqlens)
        what = f"draw {draw}: ids {ids.tolist()}, max_segments {max_segments}: "
        np.testing.assert_array_equal(np.sort(gather), np.arange(rows * seq), err_msg=what + "not a permutation")
        np.testing.assert_array_equal(gather[scatter], np.arange(rows * seq), err_msg=what + "not inverses")
        assert int(layout.num_segments) == len(runs), what
        kept = runs[:max_segments]
        expected_cu = np.concatenate([[0], np.cumsum([b - a for _, a, b in kept])]).astype(np.int64)
        expected_cu = np.pad(expected_cu, (0, max_segments + 1 - len(expected_cu)), mode="edge")
        np.testing.assert_array_equal(cu, expected_cu, err_msg=what + "cu_seqlens")
        # Compacted rows of segment b hold exactly that segment's tokens, in order.
        for b, (r, a, stop) in enumerate(kept):
            np.testing.assert_array_equal(gather[cu[b] : cu[b + 1]], r * seq + np.arange(a, stop), err_msg=what)
        valid = np.zeros((rows, seq), bool)
        for r, a, stop in kept:
            valid[r, a:stop] = True
        np.testing.assert_array_equal(layout.valid, valid, err_msg=what + "valid")


def test_one_compilation_serves_any_segment_ids(rng):
    """segment_ids are data: two different packings through one trace, each against the reference."""
    budget = 8
    other = ((4, 4, 4, 4, 0, 6, 6, 6), (2, 2, 2, 2, 2, 0, 0, 0), (0, 8, 8, 8, 8, 8, 8, 0), (1, 1, 2, 2, 3, 3, 0, 0))
    traces = []

    @jax.jit
    def f(q, k, v, segment_ids):
        traces.append(None)
        return ragged_attention_segments(
            q, k, v, segment_ids, max_segments=budget, is_causal=True, implementation="xla"
        )

    for ids in (MIXED, other):
        case = Case(ids, is_causal=True, spare_segments=budget - len(segment_runs(ids)))
        assert case.max_segments == budget
        (q, k, v), (q64, k64, v64), _ = make_inputs(rng, case, np.float32)
        out = f(q, k, v, jnp.asarray(ids, jnp.int32))
        assert_close(out, expected_results(case, q64, k64, v64)["out"], np.float32, f"ids {ids}: out")
    assert len(traces) == 1


def test_grad_of_output_only_loss(rng):
    """return_stats=False (the default): jax.grad of a scalar loss of out, i.e. a zero stats cotangent."""
    case = CASES["mixed_gqa_causal"]
    (q, k, v), (q64, k64, v64), attended = make_inputs(rng, case, np.float32)
    d_out = rng.standard_normal(q.shape[:3] + v.shape[3:]).astype(np.float32)
    expected = expected_results(case, q64, k64, v64, d_out.astype(np.float64), np.zeros(q.shape[:3]))
    segment_ids = jnp.asarray(case.segment_ids, jnp.int32)

    def loss(q, k, v):
        out = ragged_attention_segments(
            q, k, v, segment_ids, max_segments=case.max_segments, is_causal=True, implementation="xla"
        )
        return jnp.sum(out * d_out)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert_close(grad, expected[name], np.float32, name)
        np.testing.assert_array_equal(np.asarray(grad)[~attended], 0.0, err_msg=f"{name} of padding tokens")


def _valid_call(**changes):
    # float32 spelled out: under jax_enable_x64 (pytest --jax-config=x64) jnp.zeros would be float64.
    args = dict(
        q=jnp.zeros((2, 4, 4, 8), jnp.float32),
        k=jnp.zeros((2, 4, 2, 8), jnp.float32),
        v=jnp.zeros((2, 4, 2, 8), jnp.float32),
        segment_ids=jnp.ones((2, 4), jnp.int32),
        max_segments=2,
        implementation="xla",
    )
    args.update(changes)
    return ragged_attention_segments(**args)


@pytest.mark.parametrize(
    "changes, name",
    [
        pytest.param(dict(segment_ids=jnp.ones((8,), jnp.int32)), "segment_ids", id="segment_ids_rank_1"),
        pytest.param(dict(segment_ids=jnp.ones((2, 4), jnp.float32)), "segment_ids", id="segment_ids_float"),
        pytest.param(dict(segment_ids=[[1, 1, 1, 1]] * 2), "segment_ids", id="segment_ids_list"),
        pytest.param(dict(q=jnp.zeros((2, 5, 4, 8))), "q", id="q_rows_differ"),
        pytest.param(dict(k=jnp.zeros((8, 2, 8))), "k", id="k_rank_3"),
        pytest.param(dict(v=jnp.zeros((2, 4, 2))), "v", id="v_rank_3"),
        pytest.param(dict(max_segments=0), "max_segments", id="max_segments_0"),
        pytest.param(dict(max_segments=2.5), "max_segments", id="max_segments_float"),
        pytest.param(dict(max_seqlen=0), "max_seqlen", id="max_seqlen_0"),
        pytest.param(dict(max_seqlen_q=4), "max_seqlen_q", id="max_seqlen_q_given"),
    ],
)
def test_malformed_calls_name_the_argument(changes, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _valid_call(**changes)


def test_valid_call_and_check_mode_pass():
    """The base of the malformed calls is itself valid, also with the run-time cu_seqlens check on."""
    out, stats = jax.jit(lambda: _valid_call(check=True, return_stats=True, stats_layout="token_major"))()
    assert out.shape == (2, 4, 4, 8) and stats.shape == (2, 4, 4)


# What the segment-id wrapper drops (README, "What can be dropped"): segments past max_segments and tokens
# past max_seqlen. Default mode counts them (return_overflow); check mode raises naming segment_ids' row and
# token; NumPy ids warn. MIXED holds 5 segments; its longest (row 3) has 8 tokens, row 1's has 6.
DROP_ROWS = {
    # (max_segments, max_seqlen, dropped_segments, truncated tokens, check-mode message fragments)
    "fits": (5, None, 0, 0, ()),
    "two_segments_past_max_segments": (
        3,
        None,
        2,
        0,
        (
            "segment_ids hold 5 segments, more than max_segments = 3",
            "segments 3 to 4 (row-major)",
            "the first of them at segment_ids[1, 2] = 5",
        ),
    ),
    "segments_longer_than_max_seqlen": (
        5,
        5,
        0,
        1 + 3,
        ("segment 3 (segment_ids[1, 2:8] = 5) has 6 tokens, more than max_seqlen = 5",),
    ),
    "both": (4, 3, 1, 3, ("more than max_segments = 4", "segment 3 (segment_ids[1, 2:8] = 5) has 6 tokens")),
}


def _segments_call(rng, implementation="xla", **options):
    dtype = np.float32 if implementation == "xla" else jnp.bfloat16
    (q, k, v), _, _ = make_inputs(rng, Case(MIXED), dtype)
    q, k, v = (jnp.nan_to_num(x) for x in (q, k, v))  # padding 0, every real token random

    def f(segment_ids, max_segments, max_seqlen):
        return ragged_attention_segments(
            q,
            k,
            v,
            segment_ids,
            max_segments=max_segments,
            max_seqlen=max_seqlen,
            implementation=implementation,
            **options,
        )

    return f


@some_fast({"row": list(DROP_ROWS)}, fast=["fits", "segments_longer_than_max_seqlen", "two_segments_past_max_segments"])
def test_default_mode_counts_dropped_segments_and_cut_tokens(rng, row):
    max_segments, max_seqlen, dropped, cut, _ = DROP_ROWS[row]
    f = _segments_call(rng, return_overflow=True)
    ids = jnp.asarray(MIXED, jnp.int32)
    for how, call in (("eager", f), ("jit", jax.jit(f, static_argnums=(1, 2)))):
        out, overflow = call(ids, max_segments, max_seqlen)
        counts = (
            int(overflow.dropped_segments),
            int(overflow.truncated_rows_q),
            int(overflow.truncated_rows_kv),
            int(overflow.invalid_cu_seqlens),
        )
        assert counts == (dropped, cut, cut, 0), f"{row} {how}: {overflow}"
    # Independent of the counts: real tokens that read exactly 0 are the dropped ones, and those that read NaN
    # every token of a kept segment longer than max_seqlen.
    real = np.asarray(MIXED) > 0
    zero = np.all(np.asarray(out) == 0, axis=(2, 3))
    dropped_tokens = sum(b - a for _, a, b in segment_runs(MIXED)[max_segments:])
    assert int(np.sum(zero & real)) == dropped_tokens, (row, zero.astype(int).tolist())
    limit = max_seqlen or np.shape(MIXED)[1]
    long_segments = [(r, a, b) for r, a, b in segment_runs(MIXED)[:max_segments] if b - a > limit]
    assert cut == sum(b - a - limit for _, a, b in long_segments), row
    loud = np.zeros(np.shape(MIXED), bool)
    for r, a, b in long_segments:
        loud[r, a:b] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(out)).all(axis=(2, 3)), loud, err_msg=row)


@pytest.mark.parametrize("row", [r for r in DROP_ROWS if DROP_ROWS[r][4]])
@pytest.mark.parametrize("implementation", ["xla", "cudnn_stand_in"])
def test_check_mode_names_segment_ids_row_and_token(rng, monkeypatch, row, implementation):
    max_segments, max_seqlen, _, _, fragments = DROP_ROWS[row]
    if implementation == "cudnn_stand_in":  # the cuDNN path's Python layer, test_cudnn_wrapper's CPU kernel
        from test_cudnn_wrapper import StandInKernel  # tests/ is on sys.path under pytest

        kernel = StandInKernel()
        shapes = [jax.ShapeDtypeStruct((32, h, 8), jnp.bfloat16) for h in (4, 2, 2)]
        cu = jax.ShapeDtypeStruct((max_segments + 1,), jnp.int32)
        kernel.config = make_config(*shapes, cu, cu, AttentionOptions(), max_seqlen_q=8, max_seqlen_kv=8)
        monkeypatch.setattr(jax.ffi, "ffi_call", kernel)
        monkeypatch.setattr(launch, "graph_info", lambda direction, config, layout=None: {"workspace_bytes": 64})
        monkeypatch.setattr(cudnn, "unsupported_reason", lambda config: None)
    f = _segments_call(rng, "cudnn" if implementation == "cudnn_stand_in" else "xla", check=True)
    ids = jnp.asarray(MIXED, jnp.int32)
    with pytest.raises(RaggedAttentionInputError) as raised:
        f(ids, max_segments, max_seqlen)
    for fragment in ("segment_ids is invalid", *fragments):
        assert fragment in str(raised.value), f"{fragment!r} missing from: {raised.value}"
    with pytest.raises(RaggedAttentionInputError) as raised, input_errors():
        jax.block_until_ready(jax.jit(f, static_argnums=(1, 2))(ids, max_segments, max_seqlen))
    for fragment in fragments:
        assert fragment in str(raised.value), f"{fragment!r} missing from: {raised.value}"


@some_fast({"row": list(DROP_ROWS)}, fast=["both", "segments_longer_than_max_seqlen", "two_segments_past_max_segments"])
def test_numpy_segment_ids_warn_outside_check_mode(rng, row):
    max_segments, max_seqlen, _, _, fragments = DROP_ROWS[row]
    f = _segments_call(rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(np.asarray(MIXED, np.int32), max_segments, max_seqlen)
    ours = [str(w.message) for w in caught if issubclass(w.category, RaggedAttentionInputWarning)]
    assert len(ours) == (1 if fragments else 0), ours
    for fragment in fragments:
        assert fragment in ours[0], f"{fragment!r} missing from: {ours[0]}"
    with warnings.catch_warnings():  # device arrays are not read outside check mode
        warnings.simplefilter("error", RaggedAttentionInputWarning)
        f(jnp.asarray(MIXED, jnp.int32), max_segments, max_seqlen)


def test_overflow_is_aux_for_grad(rng):
    (q, k, v), _, _ = make_inputs(rng, Case(MIXED), np.float32)
    q, k, v = (jnp.nan_to_num(x) for x in (q, k, v))
    ids = jnp.asarray(MIXED, jnp.int32)

    def loss(q, return_overflow):
        result = ragged_attention_segments(
            q, k, v, ids, max_segments=3, implementation="xla", return_overflow=return_overflow
        )
        out, overflow = result if return_overflow else (result, None)
        return jnp.sum(out * out), overflow

    grad, overflow = jax.jit(jax.grad(lambda q: loss(q, True), has_aux=True))(q)
    plain, _ = jax.jit(jax.grad(lambda q: loss(q, False), has_aux=True))(q)
    # Two XLA programs (the count is an extra output), which XLA may fuse differently: equal within float32's
    # rounding of the gradient's terms, not bit for bit.
    assert_close(grad, plain, np.float32, "dq with return_overflow=True")
    assert int(overflow.dropped_segments) == 2
