"""Quiet under jax.debug_infs / jax.debug_nans unless the inputs hold inf or NaN.

Both checks make JAX raise FloatingPointError when a primitive (eagerly) or a jitted computation's output
holds inf / NaN; for a jitted one it then reruns the computation op by op to name the primitive, so
intermediates count there too. Masked logits are finite, so with return_stats=False nothing non-finite is
computed at all. The one documented -inf is `stats` of padding rows and rows without keys: with
return_stats=True it trips jax.debug_infs (it is an inf the caller asked for) and never jax.debug_nans.

Inputs are finite everywhere here (padding rows included): NaN-poisoned padding would be the caller's NaN.
The same tests run on the cuDNN path on a GPU (marked gpu; skipped elsewhere with the reason).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.shared.extension import cudnn_unavailable_reason
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked, ragged_attention_qkvpacked
from jax_ragged_attn.inputs.segments import ragged_attention_segments
from jax_ragged_attn.testing import packed_batch

pytestmark = pytest.mark.slow  # every call under jax.debug_infs / debug_nans, eager and jitted

_CUDNN_REASON = cudnn_unavailable_reason()
IMPLEMENTATIONS = [
    "xla",
    pytest.param(
        "cudnn",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN path unavailable: {_CUDNN_REASON}"),
        ],
    ),
]
MODES = ["eager", "jit"]


@contextlib.contextmanager
def checks(infs: bool = True, nans: bool = True):
    with jax.debug_infs(infs), jax.debug_nans(nans):
        yield


@dataclasses.dataclass(frozen=True)
class Scenario:
    seqlens_q: tuple[int, ...]
    seqlens_kv: tuple[int, ...]
    heads: tuple[int, int] = (4, 2)
    slack: tuple[int, int] = (3, 2)
    options: tuple = ()  # (name, value) pairs for ragged_attention
    sinks: bool = False

    @property
    def every_row_attends(self) -> bool:
        """No padding row, no row without a key: then even stats hold no -inf."""
        return self.slack == (0, 0) and self.seqlens_q == self.seqlens_kv and 0 not in self.seqlens_q


SCENARIOS = {
    # bottom-right causal with sq > skv: the first rows of sequence 3 attend no key; sequence 1 is empty.
    "causal_padding_empty_rows_gqa": Scenario(
        (5, 0, 7, 4), (6, 0, 7, 2), options=(("is_causal", True), ("diagonal_alignment", "bottom_right"))
    ),
    "window_mqa": Scenario((6, 9), (6, 9), heads=(4, 1), options=(("local_window_size", (2, 1)),)),
    "zero_length_kv": Scenario((3, 4), (0, 5)),
    "causal_every_row_attends": Scenario((5, 8), (5, 8), slack=(0, 0), options=(("is_causal", True),)),
    "sinks": Scenario((4, 0, 6), (5, 0, 6), sinks=True, options=(("is_causal", True),)),
    "check_mode": Scenario((4, 6), (4, 6), options=(("check", True), ("is_causal", True))),
}


def _batch(scenario: Scenario, implementation: str, seed: int = 0):
    dtype = jnp.bfloat16 if implementation == "cudnn" else jnp.float32
    rng = np.random.default_rng(seed)
    batch = packed_batch(
        rng,
        scenario.seqlens_q,
        scenario.seqlens_kv,
        num_heads_q=scenario.heads[0],
        num_heads_kv=scenario.heads[1],
        head_dim_qk=16,
        head_dim_v=16,
        dtype=dtype,
        slack_q=scenario.slack[0],
        slack_kv=scenario.slack[1],
        poison=3.0,
    )
    sinks = jnp.asarray(rng.standard_normal(scenario.heads[0]), jnp.float32) if scenario.sinks else None
    return batch, sinks


def _attention(batch, sinks, scenario, implementation, **options):
    def attend(q, k, v, sinks):
        return ragged_attention(
            q,
            k,
            v,
            batch.cu_seqlens_q,
            batch.cu_seqlens_kv,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_kv=batch.max_seqlen_kv,
            implementation=implementation,
            sinks=sinks,
            **dict(scenario.options),
            **options,
        )

    return attend


def _forward_and_vjp(f, primals, cotangent, mode):
    """f's outputs and its vjp, eagerly (every primitive checked) or under one jit."""

    def run(primals, cotangent):
        outputs, vjp = jax.vjp(f, *primals)
        return outputs, vjp(cotangent)

    outputs, grads = (run if mode == "eager" else jax.jit(run))(primals, cotangent)
    jax.block_until_ready((outputs, grads))
    return outputs, grads


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SCENARIOS)
def test_out_only_is_quiet_forward_and_backward(name, mode, implementation):
    """return_stats=False: nothing non-finite anywhere, values and gradients (sinks' included)."""
    scenario = SCENARIOS[name]
    batch, sinks = _batch(scenario, implementation)
    f = _attention(batch, sinks, scenario, implementation)
    d_out = jnp.asarray(np.random.default_rng(1).standard_normal(batch.q.shape[:2] + (16,)), batch.q.dtype)
    with checks():
        out, grads = _forward_and_vjp(f, (batch.q, batch.k, batch.v, sinks), d_out, mode)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    for g in jax.tree.leaves(grads):
        assert np.isfinite(np.asarray(g, np.float32)).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_stats_where_every_row_attends_are_quiet_with_their_gradient(layout, mode, implementation):
    """return_stats=True with no padding and no row without keys: stats finite, a stats cotangent too."""
    scenario = SCENARIOS["causal_every_row_attends"]
    assert scenario.every_row_attends
    batch, sinks = _batch(scenario, implementation)
    f = _attention(batch, sinks, scenario, implementation, return_stats=True, stats_layout=layout)
    rng = np.random.default_rng(2)
    d_out = jnp.asarray(rng.standard_normal(batch.q.shape[:2] + (16,)), batch.q.dtype)
    stats_shape = batch.q.shape[:2] if layout == "token_major" else batch.q.shape[1::-1]
    d_stats = jnp.asarray(rng.standard_normal(stats_shape), jnp.float32)
    with checks():
        (out, stats), grads = _forward_and_vjp(f, (batch.q, batch.k, batch.v, sinks), (d_out, d_stats), mode)
    assert np.isfinite(np.asarray(stats)).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("name", ["causal_padding_empty_rows_gqa", "zero_length_kv", "sinks"])
def test_documented_minus_inf_stats_trip_debug_infs_only(name, layout, mode, implementation):
    """Rows without keys and padding rows read stats -inf, as documented: jax.debug_nans stays quiet
    (forward and backward, with a stats cotangent), jax.debug_infs reports that -inf."""
    scenario = SCENARIOS[name]
    batch, sinks = _batch(scenario, implementation)
    f = _attention(batch, sinks, scenario, implementation, return_stats=True, stats_layout=layout)
    rng = np.random.default_rng(3)
    d_out = jnp.asarray(rng.standard_normal(batch.q.shape[:2] + (16,)), batch.q.dtype)
    stats_shape = batch.q.shape[:2] if layout == "token_major" else batch.q.shape[1::-1]
    d_stats = jnp.asarray(rng.standard_normal(stats_shape), jnp.float32)  # finite on the -inf rows too
    primals = (batch.q, batch.k, batch.v, sinks)
    with checks(infs=False, nans=True):
        (out, stats), grads = _forward_and_vjp(f, primals, (d_out, d_stats), mode)
    assert np.isneginf(np.asarray(stats)).any()
    for g in jax.tree.leaves(grads):
        assert np.isfinite(np.asarray(g, np.float32)).all()
    with checks(infs=True, nans=False), pytest.raises(FloatingPointError, match=r"\binf\b"):
        jax.block_until_ready(f(*primals) if mode == "eager" else jax.jit(f)(*primals))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wrapper", ["qkvpacked", "kvpacked", "segments"])
def test_packed_and_segment_wrappers_are_quiet(wrapper, mode, implementation):
    dtype = jnp.bfloat16 if implementation == "cudnn" else jnp.float32
    rng = np.random.default_rng(4)
    batch = packed_batch(
        rng,
        (5, 0, 7),
        (5, 0, 7),
        num_heads_q=2,
        num_heads_kv=2,
        head_dim_qk=16,
        head_dim_v=16,
        dtype=dtype,
        slack_q=4,
        slack_kv=4,
        poison=3.0,
    )
    t = batch.q.shape[0]
    common = dict(is_causal=True, implementation=implementation)
    if wrapper == "qkvpacked":
        f = functools.partial(
            ragged_attention_qkvpacked, cu_seqlens=batch.cu_seqlens_q, max_seqlen=batch.max_seqlen_q, **common
        )
        primals = (jnp.stack([batch.q, batch.k, batch.v], axis=1),)
    elif wrapper == "kvpacked":
        f = functools.partial(
            ragged_attention_kvpacked,
            cu_seqlens_q=batch.cu_seqlens_q,
            cu_seqlens_kv=batch.cu_seqlens_kv,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_kv=batch.max_seqlen_kv,
            **common,
        )
        primals = (batch.q, jnp.stack([batch.k, batch.v], axis=1))
    else:
        rows, seq = 2, t // 2
        ids = np.zeros((rows, seq), np.int32)
        ids[0, :3], ids[0, 3 : seq - 2], ids[1, 1 : seq - 1] = 1, 2, 1  # padding tokens at both ends of row 1
        segment_ids = jnp.asarray(ids)

        def f(q, k, v):
            return ragged_attention_segments(q, k, v, segment_ids, max_segments=3, **common)

        primals = tuple(x[: rows * seq].reshape(rows, seq, *x.shape[1:]) for x in (batch.q, batch.k, batch.v))
    d_out = jnp.ones(jax.eval_shape(f, *primals).shape, dtype)
    with checks():
        out, grads = _forward_and_vjp(f, primals, d_out, mode)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    for g in grads:
        assert np.isfinite(np.asarray(g, np.float32)).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_jax_nn_debug_infs_regression_ported(dtype, implementation):
    """jax's testDotProductAttentionFloat64MaskDebugInfs (jax issue #37422), as the issue ran it."""
    if implementation == "cudnn" and dtype == "float32":
        pytest.skip("the cuDNN path takes bfloat16 / float16")
    q = jnp.ones((4, 1, 8), dtype)
    cu = jnp.array([0, 4], jnp.int32)
    with checks():
        out = ragged_attention(
            q, q, q, cu, cu, max_seqlen_q=4, max_seqlen_kv=4, is_causal=True, implementation=implementation
        )
        # jax.nn itself promotes bfloat16/float16 with float32 implicitly, which the strict dtype promotion of a
        # --jax-config=strict session refuses (jax's, not this op's; the op ran above under it).
        with jax.numpy_dtype_promotion("standard"):
            reference = jax.nn.dot_product_attention(q[None], q[None], q[None], is_causal=True)[0]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference, np.float32), rtol=1e-2)
