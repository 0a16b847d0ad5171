"""Logit soft-capping (softcap): scores s = scale * q.k become c * tanh(s / c) before the mask, sinks
and softmax. One test base run against each implementation (xla on any backend; cuDNN on a GPU, skipped with
the reason elsewhere), held to the float64 reference (testing/reference.py, whose hand-written backward is
itself checked against finite differences here): out, stats in both layouts and every gradient (q, k, v,
sinks, the stats cotangent's), with NaN in every padding row of the inputs and cotangents, GQA, windows and
bottom-right masks. Then what every entry point does with the keyword: None and 0 mean no cap, anything
negative or non-finite is a ValueError naming softcap, and FlashAttention-3 declines it with the reason.

A failure reproduces with `pytest tests/test_softcap.py -k 'XlaTest and test_every_result_matches_the_reference'`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jax_ragged_attn as jra
from jax_ragged_attn.backends.fa3 import ragged as fa3
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked, ragged_attention_qkvpacked
from jax_ragged_attn.inputs.segments import ragged_attention_segments
from jax_ragged_attn.parallel.sharding import sharded_ragged_attention
from jax_ragged_attn.testing import assert_close, packed_batch, reference_attention
from jax_ragged_attn.testing.private_config import config_overrides

_CUDNN_REASON = extension.cudnn_unavailable_reason()
LAYOUTS = ("head_major", "token_major")
# Masks over the batch below: none, causal bottom-right (some queries see no key), a two-sided window.
MASKS = {
    "none": dict(),
    "causal_bottom_right": dict(is_causal=True, diagonal_alignment="bottom_right"),
    "window_top_left": dict(local_window_size=(3, 1)),
}


def _token_major(stats, layout):
    return stats if layout == "token_major" else stats.T


class SoftcapTest(parameterized.TestCase):
    """The softcap cases; a subclass names the implementation, its dtype and its sizes."""

    __test__ = False
    implementation: str
    dtype: str
    head_dim: int
    longest: int  # sequences' lengths are drawn up to this
    softcap: float  # about the scores' spread at the default scale, so tanh bends them

    def batch(self, seed: int):
        """GQA 4/2; an empty sequence, one with more queries than keys (bottom-right: rows without keys), one
        at the longest length; capacity padding rows, NaN (packed_batch's poison)."""
        rng = np.random.default_rng(seed)
        n = self.longest
        lengths_q, lengths_kv = [n // 2, 0, n, n // 3 + 1], [n, 0, n // 2, n // 3 + 1]
        batch = packed_batch(
            rng,
            lengths_q,
            lengths_kv,
            num_heads_q=4,
            num_heads_kv=2,
            head_dim_qk=self.head_dim,
            head_dim_v=self.head_dim,
            dtype=self.dtype,
            slack_q=5,
            slack_kv=3,
        )
        return rng, batch

    def call(self, batch, **options):
        def attend(q, k, v, *sinks):
            return jra.ragged_attention(
                q,
                k,
                v,
                batch.cu_seqlens_q,
                batch.cu_seqlens_kv,
                max_seqlen_q=batch.max_seqlen_q,
                max_seqlen_kv=batch.max_seqlen_kv,
                implementation=self.implementation,
                sinks=sinks[0] if sinks else None,
                **options,
            )

        return attend

    def cotangents(self, rng, batch):
        """d_out and token-major d_stats, NaN on padding rows (never read)."""
        tq = batch.q.shape[0]
        d_out = rng.standard_normal((tq, 4, self.head_dim)).astype(self.dtype)
        d_stats = rng.standard_normal((tq, 4)).astype(np.float32)
        d_out[batch.padding_q] = np.nan
        d_stats[batch.padding_q] = np.nan
        return d_out, d_stats

    def reference(self, batch, d_out=None, d_stats=None, **options):
        clean = lambda x: None if x is None else np.nan_to_num(np.asarray(x, np.float64))
        return reference_attention(
            *batch.reference_args,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_kv=batch.max_seqlen_kv,
            d_out=clean(d_out),
            d_stats=clean(d_stats),
            **options,
        )

    def check(self, got, expected, names, what):
        for name, value in zip(names, got):
            assert_close(
                np.asarray(value, np.float64),
                expected[name],
                "float32" if name == "stats" else self.dtype,
                f"{what}: {name}",
            )

    @parameterized.product(stats_layout=LAYOUTS, mask=list(MASKS))
    def test_every_result_matches_the_reference(self, stats_layout, mask):
        """out, stats and dq, dk, dv for cotangents of both, under jit."""
        rng, batch = self.batch(len(mask) + len(stats_layout))
        options = dict(MASKS[mask], softcap=self.softcap)
        d_out, d_stats = self.cotangents(rng, batch)
        attend = self.call(batch, return_stats=True, stats_layout=stats_layout, **options)

        def step(q, k, v, d_out, d_stats):
            outputs, vjp = jax.vjp(attend, q, k, v)
            return outputs, vjp((d_out, d_stats))

        (out, stats), grads = jax.jit(step)(
            *batch.args[:3], jnp.asarray(d_out), jnp.asarray(_token_major(d_stats, stats_layout))
        )
        expected = self.reference(batch, d_out, d_stats, **options)
        self.check((out, _token_major(np.asarray(stats), stats_layout)), expected, ("out", "stats"), mask)
        self.check(grads, expected, ("dq", "dk", "dv"), mask)
        # Padding rows: out exactly 0, stats -inf, no gradient, whatever NaN they held.
        np.testing.assert_array_equal(np.asarray(out, np.float64)[batch.padding_q], 0.0)
        for name, grad, padding in zip(
            ("dq", "dk", "dv"), grads, (batch.padding_q, batch.padding_kv, batch.padding_kv)
        ):
            np.testing.assert_array_equal(np.asarray(grad, np.float64)[padding], 0.0, err_msg=name)
        # The cap changed the result: the test would pass for nothing otherwise.
        assert np.abs(self.reference(batch, **MASKS[mask])["out"] - expected["out"]).max() > 1e-2

    @parameterized.parameters(*MASKS)
    def test_out_cotangent_alone(self, mask):
        """return_stats=False: no stats cotangent (cuDNN's plain backward)."""
        rng, batch = self.batch(3 + len(mask))
        options = dict(MASKS[mask], softcap=self.softcap)
        d_out, _ = self.cotangents(rng, batch)
        out, vjp = jax.vjp(jax.jit(self.call(batch, **options)), *batch.args[:3])
        grads = vjp(jnp.asarray(d_out))
        expected = self.reference(batch, d_out, **options)
        self.check((out, *grads), expected, ("out", "dq", "dk", "dv"), mask)

    @parameterized.parameters(*LAYOUTS)
    def test_with_sinks_every_gradient(self, stats_layout):
        """The sink joins the softmax of the capped scores (it is not capped itself); its gradient too."""
        rng, batch = self.batch(11)
        options = dict(MASKS["causal_bottom_right"], softcap=self.softcap)
        sinks = rng.standard_normal(4).astype(np.float32)
        d_out, d_stats = self.cotangents(rng, batch)
        attend = self.call(batch, return_stats=True, stats_layout=stats_layout, **options)
        (out, stats), vjp = jax.vjp(jax.jit(attend), *batch.args[:3], jnp.asarray(sinks))
        expected = self.reference(batch, d_out, d_stats, sinks=sinks, **options)
        d_stats = np.where(np.isfinite(expected["stats"]), d_stats, 0.0)  # the reference ignores them there
        grads = vjp((jnp.asarray(d_out), jnp.asarray(_token_major(d_stats, stats_layout))))
        self.check((out, _token_major(np.asarray(stats), stats_layout)), expected, ("out", "stats"), "sinks")
        self.check(grads, expected, ("dq", "dk", "dv", "dsinks"), "sinks")

    def test_zero_and_none_are_no_cap(self):
        _, batch = self.batch(5)
        plain = self.call(batch, return_stats=True, is_causal=True)(*batch.args[:3])
        for softcap in (None, 0, 0.0):
            capped = self.call(batch, return_stats=True, is_causal=True, softcap=softcap)(*batch.args[:3])
            for a, b in zip(plain, capped):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"softcap={softcap!r}")


class XlaTest(SoftcapTest):
    __test__ = True
    implementation = "xla"
    dtype = "float32"
    head_dim = 16
    longest = 9
    softcap = 1.0

    def setUp(self):
        super().setUp()
        # Small blocks that divide no capacity: sequences straddle blocks, some tiles are masked whole.
        self.enter_context(config_overrides(xla_block_size=(8, 5)))

    def test_bfloat16(self):
        """bfloat16 operands in the tiles' matmuls, capped scores in float32."""
        batch = packed_batch(
            np.random.default_rng(7),
            [6, 9, 0],
            [8, 4, 2],
            num_heads_q=4,
            num_heads_kv=2,
            head_dim_qk=16,
            head_dim_v=16,
            dtype="bfloat16",
            slack_q=3,
            slack_kv=2,
        )
        options = dict(is_causal=True, softcap=self.softcap)
        out = self.call(batch, **options)(*batch.args[:3])
        assert_close(np.asarray(out, np.float64), self.reference(batch, **options)["out"], "bfloat16", "out")


@pytest.mark.gpu
@pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN path unavailable: {_CUDNN_REASON}")
class CudnnTest(SoftcapTest):
    """cuDNN's score modifier: sequences over several of its tiles, head dim 64."""

    __test__ = True
    implementation = "cudnn"
    dtype = "bfloat16"
    head_dim = 64
    longest = 150
    softcap = 1.0


# ---- not per implementation -------------------------------------------------------------------------------


def test_reference_backward_matches_finite_differences():
    """The reference's hand-written softcap backward against central differences of its own forward (float64):
    the other tests trust it."""
    rng = np.random.default_rng(0)
    batch = packed_batch(
        rng, [3, 4], [4, 2], num_heads_q=2, num_heads_kv=1, head_dim_qk=4, head_dim_v=3, dtype="float64"
    )
    q, k, v, cu_q, cu_kv = batch.reference_args
    options = dict(
        max_seqlen_q=4, max_seqlen_kv=4, is_causal=True, diagonal_alignment="bottom_right", softcap=0.7, scale=1.3
    )
    d_out = rng.standard_normal((q.shape[0], 2, 3))
    d_stats = rng.standard_normal((q.shape[0], 2))
    expected = reference_attention(q, k, v, cu_q, cu_kv, d_out=d_out, d_stats=d_stats, **options)

    def loss(q, k, v):
        result = reference_attention(q, k, v, cu_q, cu_kv, **options)
        stats = np.where(np.isfinite(result["stats"]), result["stats"], 0.0)
        return np.sum(result["out"] * d_out) + np.sum(stats * d_stats)

    for name, index in (("dq", 0), ("dk", 1), ("dv", 2)):
        arrays = [q, k, v]
        numeric = np.zeros_like(arrays[index])
        for position in np.ndindex(numeric.shape):
            plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
            plus[index][position] += 1e-6
            minus[index][position] -= 1e-6
            numeric[position] = (loss(*plus) - loss(*minus)) / 2e-6
        np.testing.assert_allclose(expected[name], numeric, rtol=1e-6, atol=1e-7, err_msg=name)


def test_large_cap_approaches_no_cap():
    """c * tanh(s / c) -> s as c grows: a cap far above the scores changes them by about s^3 / (3 c^2)."""
    rng = np.random.default_rng(1)
    batch = packed_batch(
        rng, [5, 7], [6, 7], num_heads_q=2, num_heads_kv=2, head_dim_qk=8, head_dim_v=8, dtype="float32"
    )
    options = dict(max_seqlen_q=7, max_seqlen_kv=7, is_causal=True, implementation="xla")
    plain = jra.ragged_attention(*batch.args, **options)
    capped = jra.ragged_attention(*batch.args, softcap=1e4, **options)
    np.testing.assert_allclose(np.asarray(capped), np.asarray(plain), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [-1.0, -1e-30, float("nan"), float("inf"), float("-inf"), "50", True, 1e39])
def test_bad_softcap_is_a_value_error_naming_it_on_every_entry_point(softcap):
    batch = packed_batch(
        np.random.default_rng(2), [3], [3], num_heads_q=2, num_heads_kv=2, head_dim_qk=8, head_dim_v=8, dtype="float32"
    )
    q, k, v, cu_q, cu_kv = batch.args
    qkv, kv = jnp.stack([q, k, v], axis=1), jnp.stack([k, v], axis=1)
    ids = jnp.ones((1, 3), jnp.int32)
    calls = {
        "ragged_attention": lambda: jra.ragged_attention(*batch.args, max_seqlen_q=3, max_seqlen_kv=3, softcap=softcap),
        "qkvpacked": lambda: ragged_attention_qkvpacked(qkv, cu_q, max_seqlen=3, softcap=softcap),
        "kvpacked": lambda: ragged_attention_kvpacked(
            q, kv, cu_q, cu_kv, max_seqlen_q=3, max_seqlen_kv=3, softcap=softcap
        ),
        "segments": lambda: ragged_attention_segments(q[None], k[None], v[None], ids, max_segments=1, softcap=softcap),
        # The options are read first thing, before the mesh is looked at.
        "sharded": lambda: sharded_ragged_attention(
            *batch.args, mesh=None, head_axis="heads", max_seqlen_q=3, max_seqlen_kv=3, softcap=softcap
        ),
        "options": lambda: AttentionOptions(softcap=softcap),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"\bsoftcap\b"):
            call()
            pytest.fail(f"{name} accepted softcap={softcap!r}")


def test_flax_block_takes_and_checks_softcap():
    flax = pytest.importorskip("jax_ragged_attn.flax")
    from flax import nnx

    with pytest.raises(ValueError, match=r"\bsoftcap\b"):
        flax.RaggedSelfAttention(16, 2, softcap=-3.0, rngs=nnx.Rngs(0))
    capped = flax.RaggedSelfAttention(16, 2, softcap=0.5, implementation="xla", rngs=nnx.Rngs(0))
    plain = flax.RaggedSelfAttention(16, 2, implementation="xla", rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((6, 16)), jnp.float32)
    cu = jnp.asarray([0, 2, 6], jnp.int32)
    a, b = capped(x, cu, max_seqlen=4), plain(x, cu, max_seqlen=4)
    assert a.shape == b.shape and not np.allclose(np.asarray(a), np.asarray(b))


def test_config_holds_a_plain_float_and_off_is_zero():
    view = jax.ShapeDtypeStruct((8, 2, 16), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    for softcap, want in ((None, 0.0), (0, 0.0), (30, 30.0), (np.float32(2.5), 2.5)):
        config = make_config(
            view, view, view, cu, cu, AttentionOptions(softcap=softcap), max_seqlen_q=4, max_seqlen_kv=4
        )
        assert type(config.softcap) is float and config.softcap == want, (softcap, config.softcap)
        hash(config)


def test_fa3_declines_softcap_with_the_reason():
    view = jax.ShapeDtypeStruct((8, 2, fa3.FA3_HEAD_DIM), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    config = make_config(
        view,
        view,
        view,
        cu,
        cu,
        AttentionOptions(softcap=50.0, is_causal=True, diagonal_alignment="bottom_right"),
        max_seqlen_q=4,
        max_seqlen_kv=4,
    )
    reason = fa3.unsupported_reason(config)
    assert reason is not None and "softcap" in reason, reason
