"""The global JAX settings real codebases run with, and index arrays of every integer dtype.

The whole semantic suite also runs once per setting (`pytest --jax-config=strict`, `--jax-config=x64`; see
conftest.py and .ci/run). These tests pin what one session cannot: each setting switched on inside a test
(jax.config's context managers) against the float64 reference, and the conversions of index/__init__.py.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.features.checks import RaggedAttentionInputError, RaggedAttentionInputWarning, input_errors
from jax_ragged_attn.index import as_int32
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked, ragged_attention_qkvpacked
from jax_ragged_attn.inputs.segments import ragged_attention_segments
from jax_ragged_attn.testing import assert_close, packed_batch, reference_attention

pytestmark = pytest.mark.slow  # every global JAX setting (CI also runs the semantic suite under strict,x64)

INT_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


def _batch(seed: int, dtype=jnp.float32, heads=(4, 2)):
    rng = np.random.default_rng(seed)
    return packed_batch(
        rng,
        seqlens_q=(5, 0, 7, 3),
        seqlens_kv=(5, 0, 7, 3),
        num_heads_q=heads[0],
        num_heads_kv=heads[1],
        head_dim_qk=8,
        head_dim_v=8,
        slack_q=4,
        slack_kv=4,
        dtype=dtype,
    )


def _loss_and_grads(batch, cu, **options):
    """(out, stats, dq, dk, dv) of a loss over out and stats, through the public op on the xla path."""
    rng = np.random.default_rng(1)
    d_out = jnp.asarray(rng.standard_normal(batch.q.shape[:2] + (batch.v.shape[2],)), jnp.float32)
    d_stats = jnp.asarray(rng.standard_normal(batch.q.shape[:2]), jnp.float32)
    valid = np.arange(batch.q.shape[0]) < sum(batch.seqlens_q)

    def loss(q, k, v):
        out, stats = ragged_attention(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_kv=batch.max_seqlen_kv,
            return_stats=True,
            stats_layout="token_major",
            implementation="xla",
            **options,
        )
        finite = jnp.where(jnp.isfinite(stats), stats, jnp.zeros((), stats.dtype))
        return (jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(finite * d_stats)), (out, stats)

    (_, (out, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(batch.q, batch.k, batch.v)
    expected = reference_attention(
        *batch.reference_args,
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_kv=batch.max_seqlen_kv,
        d_out=np.asarray(d_out, np.float64),
        d_stats=np.where(valid[:, None], np.asarray(d_stats, np.float64), 0.0),
        **options,
    )
    return (out, stats, *grads), expected


def _check(results, expected, dtype):
    out, stats, dq, dk, dv = results
    assert_close(out, expected["out"], dtype, "out")
    assert_close(stats, expected["stats"], dtype, "stats")
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(got, expected[name], dtype, name)


# Each setting with one mask (they alternate): a setting acts on the Python around the kernels and on the matmuls'
# precision, which the mask does not touch; CI's strict+x64 stage runs the semantic files' fast tier under both.
@pytest.mark.parametrize(
    "setting, is_causal",
    [
        ("rank_raise", False),
        ("dtype_strict", True),
        ("x64", True),
        ("checks", False),
        ("matmul_bfloat16", False),
        ("matmul_highest", True),
    ],
)
def test_xla_path_exact_under_setting(setting, is_causal):
    """Forward, stats and gradients stay those of the float64 reference with each setting on: the xla path's
    float32 matmuls ask for HIGHEST themselves, so a bfloat16 default precision cannot degrade them."""
    contexts = {
        "rank_raise": jax.numpy_rank_promotion("raise"),
        "dtype_strict": jax.numpy_dtype_promotion("strict"),
        "x64": jax.enable_x64(True),
        "checks": jax.enable_checks(True),
        "matmul_bfloat16": jax.default_matmul_precision("bfloat16"),
        "matmul_highest": jax.default_matmul_precision("highest"),
    }
    with contexts[setting]:
        batch = _batch(7)
        cu = jnp.array(np.asarray(batch.cu_seqlens_q).tolist())  # the ordinary spelling: int64 under x64
        results, expected = _loss_and_grads(batch, cu, is_causal=is_causal)
        if setting == "x64":
            assert cu.dtype == jnp.int64
            assert results[0].dtype == jnp.float32 and results[1].dtype == jnp.float32, "no silent float64"
    _check(results, expected, jnp.float32)


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_cu_seqlens_of_any_integer_dtype(dtype, kind):
    """Every integer dtype gives the result int32 gives, NumPy and jax alike, eager and under jit."""
    if dtype in ("int64", "uint64") and kind == "jax" and not jax.config.jax_enable_x64:
        pytest.skip("jax makes 64-bit arrays only under jax_enable_x64 (the --jax-config=x64 session runs this)")
    batch = _batch(3)
    values = np.asarray(batch.cu_seqlens_q)
    cu = values.astype(dtype) if kind == "numpy" else jnp.asarray(values.astype(dtype))
    assert cu.dtype == np.dtype(dtype)
    kwargs = dict(
        max_seqlen_q=batch.max_seqlen_q, max_seqlen_kv=batch.max_seqlen_kv, is_causal=True, implementation="xla"
    )
    expected = ragged_attention(*batch.args, **kwargs)
    got = ragged_attention(batch.q, batch.k, batch.v, cu, cu, **kwargs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    jitted = jax.jit(lambda q, cu: ragged_attention(q, batch.k, batch.v, cu, cu, **kwargs))(batch.q, cu)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(expected))


def test_as_int32_conversions():
    assert as_int32(np.array([0, 3], np.int32), "x").dtype == np.int32
    got = as_int32(np.array([0, 3, 2**31 - 1], np.int64), "cu_seqlens_q")
    assert isinstance(got, np.ndarray) and got.dtype == np.int32
    assert as_int32([0, 4, 9], "cu_seqlens").dtype == np.int32
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\] = 2147483648 does not fit int32"):
        as_int32(np.array([0, 3, 2**31], np.int64), "cu_seqlens_q")
    with pytest.raises(ValueError, match=r"positions\[\(1, 0\)\] = -2147483649"):
        as_int32(np.array([[0, 1], [-(2**31) - 1, 2]], np.int64), "positions")
    with pytest.raises(ValueError, match="cu_seqlens_kv must have an integer dtype .* got float32"):
        as_int32(jnp.zeros(3, jnp.float32), "cu_seqlens_kv")
    with pytest.raises(ValueError, match="seqused_q must have an integer dtype .* got bool"):
        as_int32(np.zeros(3, bool), "seqused_q")
    with pytest.raises(ValueError, match="cu_seqlens_q must be an integer array, got str"):
        as_int32("0, 3", "cu_seqlens_q")


def test_device_values_past_int32_clamp_not_wrap():
    """A 64-bit device value past int32 becomes int32's bound, never a small wrapped value: the op then treats
    it as out of range like any other bad entry (clamped and counted, or an error in check mode)."""
    with jax.enable_x64(True):
        cu = jnp.array([0, 3, 2**32 + 5], jnp.int64)  # would wrap to 5 if cast directly
        assert as_int32(cu, "cu_seqlens_q").tolist() == [0, 3, 2**31 - 1]
        assert as_int32(jnp.array([2**63 - 1], jnp.uint64), "x").tolist() == [2**31 - 1]
        assert as_int32(jnp.array([-(2**40)], jnp.int64), "x").tolist() == [-(2**31)]
        batch = _batch(5)
        q, k, v = batch.q, batch.k, batch.v
        kwargs = dict(max_seqlen_q=19, max_seqlen_kv=19, implementation="xla")
        out, overflow = ragged_attention(q, k, v, cu, cu, return_overflow=True, **kwargs)
        assert int(overflow.invalid_cu_seqlens) == 1  # 2**32 + 5 > capacity 19; one array for q and kv: once
        clamped = jnp.array([0, 3, 19], jnp.int32)  # what the op makes of it: the capacity
        # Sequence 1 runs past the buffer: its rows read NaN; sequence 0 is what the clamped call gives.
        assert np.isnan(np.asarray(out)[3:]).all()
        np.testing.assert_array_equal(
            np.asarray(out)[:3], np.asarray(ragged_attention(q, k, v, clamped, clamped, **kwargs))[:3]
        )
        with pytest.raises(RaggedAttentionInputError, match=r"cu_seqlens_q\[2\] = 2147483647 is past the capacity"):
            ragged_attention(q, k, v, cu, cu, check=True, **kwargs)
        # NumPy int64 past int32: refused at trace time, naming the argument, in or out of check mode.
        with pytest.raises(ValueError, match=r"cu_seqlens_kv\[2\] = 4294967301 does not fit int32"):
            ragged_attention(q, k, v, np.array([0, 3, 8]), np.array([0, 3, 2**32 + 5]), **kwargs)


def test_numpy_int64_warning_still_names_the_argument():
    batch = _batch(9)
    cu = np.array([0, 3, 40], np.int64)  # past the capacity 19: clamped, and said so at trace time
    with pytest.warns(RaggedAttentionInputWarning, match=r"cu_seqlens_q is invalid: cu_seqlens_q\[2\] = 40"):
        ragged_attention(batch.q, batch.k, batch.v, cu, cu, max_seqlen_q=19, max_seqlen_kv=19, implementation="xla")


def test_check_mode_under_jit_first_line_through_input_errors():
    """Under jit a failed check reaches the caller as XLA's error; input_errors() (README Quickstart) gives
    the op's own exception whose message is the first line, naming the argument and the problem."""
    batch = _batch(11)
    bad = jnp.array([0, 5, 30, 18], jnp.int32)
    f = jax.jit(
        lambda q, cu: ragged_attention(
            q, batch.k, batch.v, cu, cu, max_seqlen_q=8, max_seqlen_kv=8, check=True, implementation="xla"
        )
    )
    with pytest.raises(RaggedAttentionInputError) as error, input_errors():
        jax.block_until_ready(f(batch.q, bad))
    first_line = str(error.value).splitlines()[0]
    assert first_line.startswith("cu_seqlens_q is invalid: it decreases at index 3"), first_line


def test_packed_and_segments_under_rank_raise_and_x64():
    rng = np.random.default_rng(2)
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"), jax.enable_x64(True):
        qkv = jnp.asarray(rng.standard_normal((12, 3, 2, 8)), jnp.float32)
        cu = jnp.array([0, 4, 4, 10])  # int64 here
        out = ragged_attention_qkvpacked(qkv, cu, max_seqlen=6, is_causal=True, implementation="xla")
        expected = ragged_attention(
            qkv[:, 0],
            qkv[:, 1],
            qkv[:, 2],
            np.array([0, 4, 4, 10], np.int32),
            np.array([0, 4, 4, 10], np.int32),
            max_seqlen_q=6,
            max_seqlen_kv=6,
            is_causal=True,
            implementation="xla",
        )
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
        grad = jax.grad(lambda x: ragged_attention_qkvpacked(x, cu, max_seqlen=6, implementation="xla").sum())(qkv)
        assert grad.shape == qkv.shape and grad.dtype == jnp.float32
        kv = qkv[:, 1:]
        out_kv = ragged_attention_kvpacked(
            qkv[:, 0], kv, cu, cu, max_seqlen_q=6, max_seqlen_kv=6, is_causal=True, implementation="xla"
        )
        np.testing.assert_array_equal(np.asarray(out_kv), np.asarray(expected))
        x = jnp.asarray(rng.standard_normal((2, 6, 2, 8)), jnp.float32)
        ids = jnp.array([[1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 0, 0]])  # int64 here
        grad = jax.grad(
            lambda x: ragged_attention_segments(
                x, x, x, ids, max_segments=4, is_causal=True, implementation="xla"
            ).sum()
        )(x)
        assert grad.shape == x.shape and np.isfinite(np.asarray(grad)).all()


def test_flax_block_numpy_cu_seqlens_closed_over_in_jit():
    """What a new user writes with PackedDocuments.arrays(): NumPy cu_seqlens (int64 from their own code, too)
    closed over by jax.jit, positions left out; under rank promotion "raise" as well."""
    nnx = pytest.importorskip("flax.nnx")
    from jax_ragged_attn.flax import RaggedSelfAttention, positions_from_cu_seqlens

    cu = np.array([0, 5, 12, 18], np.int64)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((20, 32)), jnp.float32)
    with jax.numpy_rank_promotion("raise"):
        for heads, kv_heads in ((4, 4), (4, 2)):
            block = RaggedSelfAttention(32, heads, num_kv_heads=kv_heads, rngs=nnx.Rngs(0))
            jitted = jax.jit(lambda x: block(x, cu, max_seqlen=8))(x)
            eager = block(x, jnp.asarray(cu, jnp.int32), max_seqlen=8)
            np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-5)
        positions = jax.jit(lambda: positions_from_cu_seqlens(cu, 20))()
        assert positions.dtype == jnp.int32
        assert positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 0, 0]


def test_float_cu_seqlens_refused_by_name():
    batch = _batch(1)
    with pytest.raises(ValueError, match="cu_seqlens_kv must have an integer dtype"):
        ragged_attention(
            batch.q,
            batch.k,
            batch.v,
            batch.cu_seqlens_q,
            jnp.asarray(batch.cu_seqlens_kv, jnp.float32),
            max_seqlen_q=8,
            max_seqlen_kv=8,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # int16 is fine and quiet
        ragged_attention(
            batch.q,
            batch.k,
            batch.v,
            np.asarray(batch.cu_seqlens_q, np.int16),
            np.asarray(batch.cu_seqlens_kv, np.int16),
            max_seqlen_q=8,
            max_seqlen_kv=8,
            implementation="xla",
        )
