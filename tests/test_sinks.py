"""Learnable sinks (one logit per query head that joins every softmax without a value) on both
implementations (the epilogue of sinks.py; cuDNN on a GPU, skipped with the reason elsewhere), against the
float64 reference and its analytic gradient, the sinks' own gradient included; real rows without keys have
the sink as their whole softmax (stats = sink, out 0)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ragged_attn as jra
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.testing import assert_close, packed_batch
from jax_ragged_attn.testing.reference import reference_attention

_CUDNN_REASON = extension.cudnn_unavailable_reason()
IMPLEMENTATIONS = [
    pytest.param("xla", "float32", id="xla"),
    pytest.param(
        "cudnn",
        "bfloat16",
        id="cudnn",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN path unavailable: {_CUDNN_REASON}"),
        ],
    ),
]


def _batch(seed, dtype="float32"):
    rng = np.random.default_rng(seed)
    # GQA 4/2, an empty sequence, a sequence with more queries than keys (bottom-right: some rows attend no
    # key), capacity padding (NaN-poisoned by packed_batch).
    batch = packed_batch(
        rng,
        [6, 0, 9, 5],
        [8, 0, 4, 5],
        num_heads_q=4,
        num_heads_kv=2,
        head_dim_qk=16,
        head_dim_v=8,
        dtype=dtype,
        slack_q=3,
        slack_kv=2,
    )
    return rng, batch


OPTIONS = dict(max_seqlen_q=9, max_seqlen_kv=8, is_causal=True, diagonal_alignment="bottom_right")


@pytest.mark.parametrize("implementation,dtype", IMPLEMENTATIONS)
@pytest.mark.parametrize("stats_layout", ["head_major", "token_major"])
@pytest.mark.parametrize("sink_scale", [0.5, 6.0])  # 6: the sink takes most of the mass
def test_values_and_every_gradient_match_the_reference(stats_layout, sink_scale, implementation, dtype):
    rng, batch = _batch(int(sink_scale * 10) + len(stats_layout), dtype)
    sinks = (sink_scale * rng.standard_normal(4)).astype(np.float32)
    tq = batch.q.shape[0]
    d_out = rng.standard_normal((tq, 4, 8)).astype(np.float32)
    d_stats = rng.standard_normal((tq, 4)).astype(np.float32)
    d_out[sum(batch.seqlens_q) :] = np.nan  # never read

    def attend(q, k, v, sinks):
        return jra.ragged_attention(
            q,
            k,
            v,
            *batch.args[3:],
            sinks=sinks,
            stats_layout=stats_layout,
            return_stats=True,
            implementation=implementation,
            **OPTIONS,
        )

    (out, stats), vjp = jax.vjp(jax.jit(attend), *batch.args[:3], jnp.asarray(sinks))
    expected = reference_attention(*batch.reference_args, sinks=sinks, d_out=d_out, d_stats=d_stats, **OPTIONS)
    # The reference's cotangent for rows without keys is ignored; give the op the same finite values.
    d_stats_in = jnp.asarray(np.where(np.isfinite(expected["stats"]), d_stats, 0.0))
    dq, dk, dv, dsinks = vjp((jnp.asarray(d_out, dtype), d_stats_in.T if stats_layout == "head_major" else d_stats_in))

    stats = np.asarray(stats)
    assert_close(np.asarray(out, np.float64), expected["out"], dtype, "out")
    assert_close(stats.T if stats_layout == "head_major" else stats, expected["stats"], dtype, "stats")
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv), ("dsinks", dsinks)):
        assert_close(np.asarray(got, np.float64), expected[name], dtype, name)
    # Real rows without keys (bottom-right, 9 queries over 4 keys) hold the sink itself as their stats.
    keyless = np.isfinite(expected["stats"]) & ~np.isfinite(
        reference_attention(*batch.reference_args, **OPTIONS)["stats"]
    )
    assert keyless.any()
    assert np.abs(expected["dsinks"]).max() > 1e-3  # the sinks really receive a gradient here


@pytest.mark.parametrize("implementation,dtype", IMPLEMENTATIONS)
@pytest.mark.parametrize("sink_scale", [0.5, 6.0])
def test_without_returned_stats_every_gradient_matches_the_reference(sink_scale, implementation, dtype):
    """return_stats=False: on cuDNN the sink folds into the plain backward (cudnn/sinks.py), no stats cotangent."""
    rng, batch = _batch(int(sink_scale * 10) + 3, dtype)
    sinks = (sink_scale * rng.standard_normal(4)).astype(np.float32)
    d_out = rng.standard_normal((batch.q.shape[0], 4, 8)).astype(np.float32)
    d_out[sum(batch.seqlens_q) :] = np.nan  # never read

    def attend(q, k, v, sinks):
        return jra.ragged_attention(q, k, v, *batch.args[3:], sinks=sinks, implementation=implementation, **OPTIONS)

    out, vjp = jax.vjp(jax.jit(attend), *batch.args[:3], jnp.asarray(sinks))
    expected = reference_attention(*batch.reference_args, sinks=sinks, d_out=np.nan_to_num(d_out), **OPTIONS)
    grads = vjp(jnp.asarray(d_out, dtype))
    assert_close(np.asarray(out, np.float64), expected["out"], dtype, "out")
    for name, got in zip(("dq", "dk", "dv", "dsinks"), grads):
        assert_close(np.asarray(got, np.float64), expected[name], dtype, name)
    assert np.abs(expected["dsinks"]).max() > 1e-3


def test_a_very_negative_sink_changes_nothing_and_a_large_one_takes_the_mass():
    rng, batch = _batch(1)
    plain = jra.ragged_attention(*batch.args, implementation="xla", **OPTIONS)
    gone = jra.ragged_attention(*batch.args, sinks=jnp.full((4,), -1e4), implementation="xla", **OPTIONS)
    np.testing.assert_allclose(np.asarray(gone), np.asarray(plain), rtol=0, atol=0)
    swamped = jra.ragged_attention(*batch.args, sinks=jnp.full((4,), 60.0), implementation="xla", **OPTIONS)
    assert np.abs(np.asarray(swamped)).max() < 1e-12  # every row's weight went to the sink, which has no value


def test_bad_sinks_name_the_argument():
    _, batch = _batch(2)
    for sinks, message in (
        (jnp.zeros((3,)), r"sinks must be \[Hq=4\]"),
        (jnp.zeros((4, 1)), "sinks must have rank 1"),
        (jnp.zeros((4,), jnp.int32), "sinks must be a floating array"),
    ):
        with pytest.raises(ValueError, match=message):
            jra.ragged_attention(*batch.args, sinks=sinks, implementation="xla", **OPTIONS)
    out = jra.ragged_attention(*batch.args, sinks=jnp.zeros((4,)), **OPTIONS)  # None: cuDNN where it serves
    assert out.shape == batch.q.shape[:2] + (8,)


def test_huge_sinks_keep_every_gradient_finite():
    """exp(sink) overflows float32 in rows without keys; neither values nor gradients may turn NaN."""
    _, batch = _batch(3)

    def loss(q, sinks):
        out = jra.ragged_attention(q, *batch.args[1:], sinks=sinks, implementation="xla", **OPTIONS)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0))

    dq, dsinks = jax.grad(loss, argnums=(0, 1))(batch.q, jnp.full((4,), 100.0))
    assert np.isfinite(np.asarray(dsinks)).all() and np.isfinite(np.asarray(dq)[: sum(batch.seqlens_q)]).all()
