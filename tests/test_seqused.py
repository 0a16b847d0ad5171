"""seqused_q / seqused_kv (FlashAttention's seqused semantics): sequence b's rows start at cu_seqlens[b] and
only the first seqused[b] of its slot cu_seqlens[b]:cu_seqlens[b+1] are used.

Held to the float64 reference run on the same used rows packed tightly: every unused row of a slot is NaN
in q, k, v and both cotangents (so reading one fails the test), reads out 0 / stats -inf, and gets
exactly zero gradients. Every implementation (cuDNN and both FlashAttention-3 builds on a GPU, skipped with the
reason elsewhere; the FA3 ones bottom-right only), both stats layouts, GQA, causal top-left and bottom-right (which
counts the used lengths), gaps, zero used and used = slot; packed QKV / KV; check mode and the overflow counts.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import some_fast  # tests/ is on sys.path under pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.fa3 import dew
from jax_ragged_attn.backends.fa3 import ragged as fa3
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.features.checks import RaggedAttentionInputError
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked, ragged_attention_qkvpacked
from jax_ragged_attn.testing import assert_close, implementation_options, reference_attention

_CUDNN_REASON = extension.cudnn_unavailable_reason()


def _gpu(name: str, reason: str | None, what: str):
    return pytest.param(
        name,
        id=name,
        marks=[pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=f"{what} unavailable: {reason}")],
    )


IMPLEMENTATIONS = [
    pytest.param("xla", id="xla"),
    _gpu("cudnn", _CUDNN_REASON, "cuDNN path"),
    _gpu("flash-attn3-jax", fa3.unavailable_reason(), "FlashAttention-3"),
    # dew-flash-attn's kernels take no seqused: its wrapper hands the unused rows over as sequences of their own.
    _gpu("dew-flash-attn", dew.unavailable_reason(), "dew-flash-attn"),
]
# (dtype, head dim) each runs at: the GPU kernels take 16-bit inputs; the FA3 wheels' common head dim is 128.
PROFILES = {
    "xla": (jnp.float32, 8),
    "cudnn": (jnp.bfloat16, 64),
    "flash-attn3-jax": (jnp.bfloat16, 128),
    "dew-flash-attn": (jnp.bfloat16, 128),
}
# FA3's kernels align masks bottom-right only; a top-left mask over slots of unequal lengths is declined.
BOTTOM_RIGHT_ONLY = {"flash-attn3-jax", "dew-flash-attn"}


@dataclasses.dataclass(frozen=True)
class Slots:
    """Slots of fixed or varied size with used prefixes; everything else is NaN."""

    slots_q: tuple[int, ...]
    used_q: tuple[int, ...]
    slots_kv: tuple[int, ...]
    used_kv: tuple[int, ...]


CASES = {
    # gaps everywhere, one sequence with nothing used, one using its whole slot
    "gaps": Slots((9, 6, 12, 5), (4, 0, 12, 3), (9, 6, 12, 5), (7, 2, 12, 0)),
    # a fixed-slot KV cache: decode-like short query runs against long used key prefixes
    "cache": Slots((3, 3, 3), (1, 3, 2), (16, 16, 16), (11, 16, 1)),
    # every slot fully used: must equal plain cu_seqlens
    "full": Slots((5, 7, 4), (5, 7, 4), (6, 7, 3), (6, 7, 3)),
}


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _offsets(slots) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(slots)]).astype(np.int32)


def _used_rows(slots, used) -> np.ndarray:
    cu = _offsets(slots)
    return np.concatenate([np.arange(cu[b], cu[b] + used[b]) for b in range(len(slots))]).astype(np.int64)


def _inputs(case: Slots, heads, dim, dtype, seed, slack=3):
    rng = np.random.default_rng(seed)
    tq, tkv = sum(case.slots_q) + slack, sum(case.slots_kv) + slack
    rows_q, rows_kv = _used_rows(case.slots_q, case.used_q), _used_rows(case.slots_kv, case.used_kv)

    def poisoned(rows, total, h, d):
        x = np.full((total, h, d), np.nan)
        x[rows] = rng.standard_normal((len(rows), h, d))
        x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # the values the op sees
        return x

    q = poisoned(rows_q, tq, heads[0], dim)
    k = poisoned(rows_kv, tkv, heads[1], dim)
    v = poisoned(rows_kv, tkv, heads[1], dim)
    d_out = poisoned(rows_q, tq, heads[0], dim)
    d_stats = np.full((tq, heads[0]), np.nan)
    d_stats[rows_q] = rng.standard_normal((len(rows_q), heads[0]))
    return q, k, v, d_out, d_stats, rows_q, rows_kv


def _expected(case: Slots, q, k, v, d_out, d_stats, rows_q, rows_kv, **options):
    """The reference on the used rows packed tightly, scattered back into the slots (zeros / -inf elsewhere)."""
    cu_q, cu_kv = _offsets(case.used_q), _offsets(case.used_kv)
    tight = reference_attention(
        q[rows_q],
        k[rows_kv],
        v[rows_kv],
        cu_q,
        cu_kv,
        max_seqlen_q=max(max(case.used_q), 1),
        max_seqlen_kv=max(max(case.used_kv), 1),
        d_out=d_out[rows_q],
        d_stats=d_stats[rows_q],
        **options,
    )
    full = {
        "out": np.zeros(d_out.shape),
        "stats": np.full(d_stats.shape, -np.inf),
        "dq": np.zeros(q.shape),
        "dk": np.zeros(k.shape),
        "dv": np.zeros(v.shape),
    }
    for name, rows in (("out", rows_q), ("stats", rows_q), ("dq", rows_q), ("dk", rows_kv), ("dv", rows_kv)):
        full[name][rows] = tight[name]
    return full


def _run(implementation, case, q, k, v, d_out, d_stats, dtype, *, stats_layout, **options):
    cu_q, cu_kv = _offsets(case.slots_q), _offsets(case.slots_kv)
    used_q, used_kv = np.asarray(case.used_q, np.int32), np.asarray(case.used_kv, np.int32)
    kwargs = dict(
        max_seqlen_q=max(case.slots_q),
        max_seqlen_kv=max(case.slots_kv),
        return_stats=True,
        stats_layout=stats_layout,
        **implementation_options(implementation),
        **options,
    )
    cast = lambda x: jnp.asarray(x, dtype)
    # The cotangents' NaN rows are the op's to ignore (they belong to no used row).
    g_out, g_stats = jnp.asarray(d_out, jnp.float32), jnp.asarray(d_stats, jnp.float32)
    if stats_layout == "head_major":
        g_stats = g_stats.T

    def f(q, k, v):
        return ragged_attention(
            q,
            k,
            v,
            jnp.asarray(cu_q),
            jnp.asarray(cu_kv),
            seqused_q=jnp.asarray(used_q),
            seqused_kv=jnp.asarray(used_kv),
            **kwargs,
        )

    (out, stats), vjp = jax.vjp(jax.jit(f), cast(q), cast(k), cast(v))
    dq, dk, dv = vjp((g_out.astype(dtype), g_stats))
    if stats_layout == "head_major":
        stats = stats.T
    return {"out": out, "stats": stats, "dq": dq, "dk": dk, "dv": dv}


def _check(got, expected, rows_q, rows_kv, dtype):
    unused_q = np.setdiff1d(np.arange(got["out"].shape[0]), rows_q)
    unused_kv = np.setdiff1d(np.arange(got["dk"].shape[0]), rows_kv)
    for name in ("out", "dq"):
        assert not np.asarray(got[name], np.float64)[unused_q].any(), f"{name}: an unused row is not exactly 0"
    assert np.all(np.asarray(got["stats"])[unused_q] == -np.inf), "stats: an unused row is not -inf"
    for name in ("dk", "dv"):
        assert not np.asarray(got[name], np.float64)[unused_kv].any(), f"{name}: an unused key row is not exactly 0"
    for name in ("out", "stats", "dq", "dk", "dv"):
        assert_close(got[name], expected[name], dtype, name)


@some_fast(
    {
        "stats_layout": ["head_major", "token_major"],
        "mask": ["none", "causal", "causal_bottom_right"],
        "case_name": sorted(CASES),
        "implementation": IMPLEMENTATIONS,
    },
    fast=["head_major-none-cache-xla", "token_major-causal-gaps-xla", "head_major-causal_bottom_right-full-xla"],
)
def test_seqused_against_reference(implementation, case_name, mask, stats_layout):
    if mask == "causal" and implementation in BOTTOM_RIGHT_ONLY:
        pytest.skip(
            f"implementation={implementation!r} declines a top-left mask it cannot prove bottom-right "
            "(test_declines.py)"
        )
    case = CASES[case_name]
    dtype, dim = PROFILES[implementation]
    inputs = _inputs(case, (4, 2), dim, dtype, _seed(implementation, case_name, mask, stats_layout))
    options = {
        "none": {},
        "causal": dict(is_causal=True),
        "causal_bottom_right": dict(is_causal=True, diagonal_alignment="bottom_right"),
    }[mask]
    got = _run(implementation, case, *inputs[:5], dtype, stats_layout=stats_layout, **options)
    expected = _expected(case, *inputs, **options)
    _check(got, expected, inputs[5], inputs[6], dtype)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_full_slots_equal_plain_cu_seqlens(implementation):
    """seqused equal to every slot's length changes nothing: the same bits as without it."""
    case = CASES["full"]
    dtype, dim = PROFILES[implementation]
    q, k, v, *_ = _inputs(case, (4, 4), dim, dtype, _seed("full", implementation), slack=0)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    cu_q, cu_kv = jnp.asarray(_offsets(case.slots_q)), jnp.asarray(_offsets(case.slots_kv))
    kwargs = dict(
        max_seqlen_q=7,
        max_seqlen_kv=7,
        is_causal=True,
        **implementation_options(implementation),
        diagonal_alignment="bottom_right" if implementation in BOTTOM_RIGHT_ONLY else "top_left",
    )
    plain = ragged_attention(q, k, v, cu_q, cu_kv, **kwargs)
    used = ragged_attention(
        q, k, v, cu_q, cu_kv, seqused_q=jnp.asarray(case.used_q), seqused_kv=jnp.asarray(case.used_kv), **kwargs
    )
    np.testing.assert_array_equal(np.asarray(used, np.float32), np.asarray(plain, np.float32))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_wrappers_take_seqused(implementation):
    """qkv- and kv-packed buffers with seqused: the results of the separate buffers, gradients in the packed
    shape with exact zeros in unused rows."""
    dtype, dim = PROFILES[implementation]
    slots, used = (8, 5, 9), np.array([6, 0, 9], np.int32)
    cu = jnp.asarray(_offsets(slots))
    rng = np.random.default_rng(_seed("packed", implementation))
    qkv = jnp.asarray(rng.standard_normal((22, 3, 2, dim)), dtype)
    kwargs = dict(is_causal=True, **implementation_options(implementation))
    out = ragged_attention_qkvpacked(qkv, cu, max_seqlen=9, seqused_q=used, seqused_kv=used, **kwargs)
    expected = ragged_attention(
        qkv[:, 0],
        qkv[:, 1],
        qkv[:, 2],
        cu,
        cu,
        max_seqlen_q=9,
        max_seqlen_kv=9,
        seqused_q=used,
        seqused_kv=used,
        **kwargs,
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    unused = np.setdiff1d(np.arange(22), _used_rows(slots, used))
    grad = jax.grad(
        lambda x: (
            ragged_attention_qkvpacked(x, cu, max_seqlen=9, seqused_q=used, seqused_kv=used, **kwargs)
            .astype(jnp.float32)
            .sum()
        )
    )(qkv)
    assert grad.shape == qkv.shape and not np.asarray(grad, np.float32)[unused].any()
    out_kv = ragged_attention_kvpacked(
        qkv[:, 0], qkv[:, 1:], cu, cu, max_seqlen_q=9, max_seqlen_kv=9, seqused_q=used, seqused_kv=used, **kwargs
    )
    np.testing.assert_array_equal(np.asarray(out_kv, np.float32), np.asarray(expected, np.float32))


def test_check_mode_and_overflow_with_seqused():
    rng = np.random.default_rng(5)
    q = k = v = jnp.asarray(rng.standard_normal((12, 2, 8)), jnp.float32)
    cu = jnp.array([0, 5, 12], jnp.int32)
    kwargs = dict(max_seqlen_q=7, max_seqlen_kv=7, implementation="xla")
    # A slot longer than max_seqlen is fine when the used part fits it.
    out, overflow = ragged_attention(
        q,
        k,
        v,
        jnp.array([0, 4, 12]),
        jnp.array([0, 4, 12]),
        seqused_q=jnp.array([4, 7]),
        seqused_kv=jnp.array([4, 7]),
        return_overflow=True,
        check=True,
        **kwargs,
    )
    assert int(overflow.truncated_rows_q) == 0 and int(overflow.truncated_rows_kv) == 0
    with pytest.raises(RaggedAttentionInputError, match=r"seqused_q\[1\] = 9 is more than the slot's 7 rows"):
        ragged_attention(q, k, v, cu, cu, seqused_q=np.array([5, 9]), check=True, **kwargs)
    with pytest.raises(RaggedAttentionInputError, match=r"seqused_kv\[0\] = -1 is negative"):
        jax.block_until_ready(ragged_attention(q, k, v, cu, cu, seqused_kv=np.array([-1, 3]), check=True, **kwargs))
    # Off check mode, out-of-range values are clamped into [0, slot]: -1 uses nothing, 9 the whole slot.
    clamped = ragged_attention(q, k, v, cu, cu, seqused_q=jnp.array([-1, 9]), **kwargs)
    expected = ragged_attention(q, k, v, cu, cu, seqused_q=jnp.array([0, 7]), **kwargs)
    np.testing.assert_array_equal(np.asarray(clamped), np.asarray(expected))
    with pytest.raises(ValueError, match=r"seqused_q must be \[B=2\]"):
        ragged_attention(q, k, v, cu, cu, seqused_q=jnp.array([1, 2, 3]), **kwargs)
    with pytest.raises(ValueError, match="seqused_kv must have an integer dtype"):
        ragged_attention(q, k, v, cu, cu, seqused_kv=jnp.array([1.0, 2.0]), **kwargs)


def test_context_parallelism_refuses_seqused_by_name():
    from jax_ragged_attn.parallel.sharding import sharded_ragged_attention

    mesh = jax.make_mesh((1,), ("cp",))
    q = jnp.zeros((8, 2, 8), jnp.float32)
    cu = jnp.array([0, 4, 8], jnp.int32)
    with pytest.raises(NotImplementedError, match="seqused_q / seqused_kv with token_axis"):
        sharded_ragged_attention(
            q,
            q,
            q,
            cu,
            cu,
            mesh=mesh,
            token_axis="cp",
            max_seqlen_q=8,
            max_seqlen_kv=8,
            seqused_q=jnp.array([2, 3]),
            implementation="xla",
        )


def test_check_mode_under_vmap_with_one_side_batched():
    """One set of slots, a batch of seqused (a KV cache's fill levels), check mode under jit(vmap): valid
    values pass, and a bad value in one element is named with that element."""
    rng = np.random.default_rng(8)
    q = k = v = jnp.asarray(rng.standard_normal((12, 2, 8)), jnp.float32)
    cu = jnp.array([0, 4, 12], jnp.int32)
    kwargs = dict(max_seqlen_q=8, max_seqlen_kv=8, implementation="xla", check=True)
    f = jax.jit(jax.vmap(lambda used: ragged_attention(q, k, v, cu, cu, seqused_kv=used, **kwargs)))
    good = jnp.array([[4, 8], [1, 2], [0, 5]], jnp.int32)
    out = f(good)
    for i in range(3):
        expected = ragged_attention(q, k, v, cu, cu, seqused_kv=good[i], **kwargs)
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(expected), rtol=1e-6, atol=1e-6)
    bad = good.at[2, 0].set(5)
    from jax_ragged_attn.features.checks import input_errors

    with (
        pytest.raises(RaggedAttentionInputError, match=r"vmapped element \(2,\).*seqused_kv\[0\] = 5 is more than"),
        input_errors(),
    ):
        jax.block_until_ready(f(bad))
