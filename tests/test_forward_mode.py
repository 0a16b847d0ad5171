"""Forward-mode differentiation through every entry point (backends/shared/forward_mode.py).

jax.jvp, jax.linearize, jax.jacfwd and forward-over-reverse Hessian-vector products (jax.jvp(jax.grad(f)))
against the float64 reference: a directional derivative of the reference is its central difference in float64
(step 1e-6, so the difference's own error, about 1e-10, is far below any tolerance here), a Hessian-vector
product the central difference of the reference's float64 gradients. On the CPU the xla path runs and
FlashAttention-3's wrapper runs on testing/fa3_emulator.py's kernels; the cuDNN cases run on a GPU.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from implementations import xla_and_cudnn  # tests/ is on sys.path under pytest

from jax_ragged_attn import flash_attn_varlen_func, ragged_attention, ragged_attention_with_kvcache
from jax_ragged_attn.inputs.packed import ragged_attention_qkvpacked
from jax_ragged_attn.inputs.segments import ragged_attention_segments
from jax_ragged_attn.testing import assert_close, fa3_emulator, reference_attention
from jax_ragged_attn.testing.kvcache_reference import reference_kvcache_attention

STEP = 1e-6
# Sequences of 3, 0 and 6 rows in 12: an empty sequence, and padding rows the tangents must leave at 0.
CU = np.array([0, 3, 3, 9], np.int32)
CAPACITY, MAX_SEQLEN = 12, 8


def _normal(seed, shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _central(fn, primals, tangents):
    """The float64 central difference of fn (float64 arrays -> dict or tuple of arrays) along tangents."""
    plus = fn(*(np.float64(p) + STEP * np.float64(t) for p, t in zip(primals, tangents)))
    minus = fn(*(np.float64(p) - STEP * np.float64(t) for p, t in zip(primals, tangents)))
    return jax.tree.map(lambda a, b: np.where(np.isfinite(a) & np.isfinite(b), (a - b) / (2 * STEP), 0.0), plus, minus)


def _qkv(seed, heads_q=4, heads_kv=2, head_dim=8, dtype=np.float32):
    shapes = [(CAPACITY, heads_q, head_dim), (CAPACITY, heads_kv, head_dim), (CAPACITY, heads_kv, head_dim)]
    primals = [_normal(seed + i, s, dtype) for i, s in enumerate(shapes)]
    tangents = [_normal(seed + 10 + i, s, dtype) for i, s in enumerate(shapes)]
    return primals, tangents


def _reference(is_causal, layout="token_major"):
    """q, k, v (float64) -> (out, stats in `layout`) of the float64 reference over CU."""

    def fn(q, k, v):
        result = reference_attention(
            q, k, v, CU, CU, max_seqlen_q=MAX_SEQLEN, max_seqlen_kv=MAX_SEQLEN, is_causal=is_causal
        )
        stats = result["stats"].T if layout == "head_major" else result["stats"]
        return result["out"], stats

    return fn


def _op(implementation, is_causal, layout):
    def fn(q, k, v):
        return ragged_attention(
            q,
            k,
            v,
            jnp.asarray(CU),
            jnp.asarray(CU),
            max_seqlen_q=MAX_SEQLEN,
            max_seqlen_kv=MAX_SEQLEN,
            is_causal=is_causal,
            return_stats=True,
            stats_layout=layout,
            implementation=implementation,
        )

    return fn


@pytest.fixture(params=["xla", "fa3"])
def implementation(request):
    """The xla path, and FA3's wrapper on the emulator's kernels (bfloat16, head dim 128: what FA3 serves)."""
    if request.param == "fa3":
        with fa3_emulator.patched():
            yield "fa3", np.dtype(jnp.bfloat16), 128
    else:
        yield "xla", np.dtype(np.float32), 8


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_jvp_of_out_and_stats_is_the_references(implementation, layout, is_causal):
    name, dtype, head_dim = implementation
    primals, tangents = _qkv(0, head_dim=head_dim, dtype=dtype)
    outs, derivatives = jax.jit(lambda p, t: jax.jvp(_op(name, is_causal, layout), p, t))(primals, tangents)
    expected = _central(_reference(is_causal, layout), primals, tangents)
    assert_close(derivatives[0], expected[0], dtype, f"{name} d out")
    assert_close(derivatives[1], expected[1], np.float32 if dtype == np.float32 else dtype, f"{name} d stats")
    assert not np.asarray(derivatives[0][CU[-1] :], np.float64).any(), "padding rows' tangents must be 0"


def test_linearize_and_jacfwd_agree_with_reverse_mode():
    primals, tangents = _qkv(1, heads_q=2, heads_kv=1, head_dim=4)
    fn = _op("xla", True, "head_major")
    _, linear = jax.linearize(fn, *primals)
    _, derivative = jax.jvp(fn, primals, tangents)
    for a, b in zip(linear(*tangents), derivative):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    q = primals[0][:5, :1, :2]  # a tiny Jacobian: q of the first sequences, one head, two columns

    def out(q_small):
        full = jnp.asarray(primals[0]).at[:5, :1, :2].set(q_small)
        return fn(full, *primals[1:])[0][:5]

    np.testing.assert_allclose(jax.jacfwd(out)(q), jax.jacrev(out)(q), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("is_causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_hessian_vector_product_is_the_references(implementation, is_causal):
    """Forward over reverse: jax.jvp(jax.grad(loss)) for a loss of out and stats."""
    name, dtype, head_dim = implementation
    primals, tangents = _qkv(2, head_dim=head_dim, dtype=dtype)
    c_out = _normal(7, primals[0].shape[:2] + (head_dim,))
    c_stats = _normal(8, primals[0].shape[:2])
    fn = _op(name, is_causal, "token_major")

    def loss(q, k, v):
        out, stats = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * c_out) + jnp.sum(jnp.where(jnp.isfinite(stats), stats, 0) * c_stats)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    _, hvp = jax.jit(lambda p, t: jax.jvp(lambda *a: grad(*a), p, t))(primals, tangents)

    def reference_grads(q, k, v):
        result = reference_attention(
            q, k, v, CU, CU, max_seqlen_q=MAX_SEQLEN, max_seqlen_kv=MAX_SEQLEN, is_causal=is_causal,
            d_out=c_out, d_stats=c_stats,
        )  # fmt: skip
        return result["dq"], result["dk"], result["dv"]

    expected = _central(reference_grads, primals, tangents)
    for got, want, what in zip(hvp, expected, ("q", "k", "v")):
        assert_close(got, want, dtype, f"{name} Hessian-vector product, {what}")


def test_vmap_of_jvp_and_grad_of_vmap_and_vmap_of_grad(implementation):
    name, dtype, head_dim = implementation
    primals, tangents = _qkv(3, head_dim=head_dim, dtype=dtype)
    fn = _op(name, True, "head_major")
    qs = jnp.stack([primals[0], -primals[0]])
    tqs = jnp.stack([tangents[0], 2 * tangents[0]])
    batched = jax.vmap(lambda q, t: jax.jvp(lambda q: fn(q, *primals[1:]), (q,), (t,))[1])(qs, tqs)
    for i in range(2):
        one = jax.jvp(lambda q: fn(q, *primals[1:]), (qs[i],), (tqs[i],))[1]
        for a, b in zip(batched, one):
            np.testing.assert_array_equal(np.asarray(a[i], np.float32), np.asarray(b, np.float32))

    def loss(q):
        return jnp.sum(fn(q, *primals[1:])[0].astype(jnp.float32) ** 2)

    per_row = [jax.grad(loss)(qs[i]) for i in range(2)]
    for grads in (jax.grad(lambda qs: jnp.sum(jax.vmap(loss)(qs)))(qs), jax.vmap(jax.grad(loss))(qs)):
        for i in range(2):
            np.testing.assert_allclose(np.asarray(grads[i], np.float32), np.asarray(per_row[i], np.float32))


def test_reverse_mode_still_runs_the_backends_own_backward():
    """jax.grad transposes the tangent into the custom_vjp's backward, not the portable derivative: the
    FA3 wrapper's backward kernel runs (and its forward kernel once, not in the backward)."""
    calls = {"forward": 0, "backward": 0}

    def counting(kind, kernel):
        def call(*args):
            calls[kind] += 1
            return kernel(*args)

        return call

    with fa3_emulator.patched():
        from jax_ragged_attn.backends.fa3 import ragged as fa3

        forward, backward = fa3._forward_call, fa3._backward_call
        fa3._forward_call, fa3._backward_call = counting("forward", forward), counting("backward", backward)
        try:
            primals, _ = _qkv(4, head_dim=128, dtype=jnp.bfloat16)
            fn = _op("fa3", True, "head_major")
            jax.grad(lambda q: jnp.sum(fn(q, *primals[1:])[0].astype(jnp.float32)))(primals[0])
        finally:
            fa3._forward_call, fa3._backward_call = forward, backward
    assert calls == {"forward": 1, "backward": 1}


def test_packed_qkv_and_flash_attn_names_and_segments():
    primals, tangents = _qkv(5, heads_q=2, heads_kv=2)
    expected = _central(_reference(True), primals, tangents)
    cu = jnp.asarray(CU)

    def packed(q, k, v):
        qkv = jnp.stack([q, k, v], axis=1)
        return ragged_attention_qkvpacked(qkv, cu, max_seqlen=MAX_SEQLEN, is_causal=True, implementation="xla")

    def flash(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, MAX_SEQLEN, MAX_SEQLEN, causal=True)

    for fn in (packed, flash):
        _, derivative = jax.jvp(fn, primals, tangents)
        assert_close(derivative, expected[0], np.float32, fn.__name__)

    # Segments: one row of segment ids holding the same three sequences (ids 1, 3; 2 is empty), padding 0.
    ids = np.zeros((1, CAPACITY), np.int32)
    ids[0, :3], ids[0, 3:9] = 1, 3

    def segments(q, k, v):
        return ragged_attention_segments(
            q[None], k[None], v[None], jnp.asarray(ids), max_segments=3, is_causal=True, implementation="xla"
        )[0]

    _, derivative = jax.jvp(segments, primals, tangents)
    assert_close(derivative, expected[0], np.float32, "segments")


def test_kvcache_op_jvp_is_the_references_and_its_gradient_still_raises():
    batch, seqlen_q, length, heads, head_dim = 2, 2, 6, 2, 8
    q, k_cache, v_cache = (_normal(i, (batch, n, heads, head_dim)) for i, n in enumerate((seqlen_q, length, length)))
    tangents = tuple(_normal(10 + i, x.shape) for i, x in enumerate((q, k_cache, v_cache)))
    lengths = np.array([4, 6], np.int32)

    def op(q, k, v):
        return ragged_attention_with_kvcache(q, k, v, jnp.asarray(lengths), return_stats=True, implementation="xla")

    def reference(q, k, v):
        result = reference_kvcache_attention(q, k, v, lengths)
        return result["out"], result["stats"]

    _, derivative = jax.jvp(op, (q, k_cache, v_cache), tangents)
    expected = _central(reference, (q, k_cache, v_cache), tangents)
    assert_close(derivative[0], expected[0], np.float32, "kvcache d out")
    assert_close(derivative[1], expected[1], np.float32, "kvcache d stats")
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(lambda q: jnp.sum(op(q, k_cache, v_cache)[0]))(q)


def test_flax_layer_jvp_is_the_references():
    from flax import nnx
    from test_flax import _inputs, _model, _reference_sequence

    model = _model({"num_heads": 4, "num_kv_heads": 2})
    x, cu, positions = _inputs(0, poison=0.0)
    cu_host = np.asarray(cu)
    t = _normal(9, x.shape)
    graph, state = nnx.split(model)

    def layer(x):
        return nnx.merge(graph, state)(x, cu, positions, max_seqlen=int(np.diff(cu_host).max()))

    _, derivative = jax.jvp(layer, (x,), (jnp.asarray(t),))

    def reference(x):
        return np.concatenate(
            [_reference_sequence(model, x[a:b])[0] for a, b in itertools.pairwise(cu_host) if b > a]
            + [np.zeros((x.shape[0] - cu_host[-1], x.shape[1]))]
        )

    (expected,) = _central(lambda x: (reference(x),), (np.asarray(x),), (t,))
    assert_close(derivative, expected, np.float32, "flax layer")


@pytest.mark.parametrize("implementation", xla_and_cudnn())
@pytest.mark.parametrize("packing", ["none", "qkv"])
def test_gpu_backends_jvp_and_hvp_match_the_xla_path(implementation, packing):
    """Each backend's tangents and Hessian-vector products equal the portable path's (they are its, by
    construction; this holds the wiring: packings, stats layouts, the second-order backward)."""
    primals, tangents = _qkv(6, heads_q=2, heads_kv=2, head_dim=64, dtype=jnp.bfloat16)
    cu = jnp.asarray(CU)

    def fn(name, q, k, v):
        if packing == "qkv":
            return ragged_attention_qkvpacked(
                jnp.stack([q, k, v], axis=1), cu, max_seqlen=MAX_SEQLEN, is_causal=True, return_stats=True,
                implementation=name,
            )  # fmt: skip
        return _op(name, True, "head_major")(q, k, v)

    got = jax.jvp(functools.partial(fn, implementation), primals, tangents)[1]
    want = jax.jvp(functools.partial(fn, "xla"), primals, tangents)[1]
    for a, b, what in zip(got, want, ("out", "stats")):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2, err_msg=what)

    def hvp(name):
        def loss(q):
            return jnp.sum(fn(name, q, *primals[1:])[0].astype(jnp.float32) ** 2)

        return jax.jvp(jax.grad(loss), (primals[0],), (tangents[0],))[1]

    a, b = np.asarray(hvp(implementation), np.float32), np.asarray(hvp("xla"), np.float32)
    np.testing.assert_allclose(a, b, atol=5e-2 * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("context_strategy", ["ring", "all_gather"])
def test_context_parallel_jvp_equals_the_ops(context_strategy):
    """Context parallelism on a token axis of one device: the ring (its own custom_vjp, differentiated in
    forward mode through its steps) and the all-gather strategy (the key windows) give the op's tangents."""
    from jax_ragged_attn.parallel.sharding import sharded_ragged_attention

    primals, tangents = _qkv(11, heads_q=2, heads_kv=2)
    options = dict(max_seqlen_q=MAX_SEQLEN, max_seqlen_kv=MAX_SEQLEN, is_causal=True, return_stats=True)
    cu = jnp.asarray(CU)
    mesh = jax.make_mesh((1,), ("cp",))

    def sharded(q, k, v):
        return sharded_ragged_attention(
            q, k, v, cu, cu, mesh=mesh, token_axis="cp", context_strategy=context_strategy, implementation="xla",
            **options,
        )  # fmt: skip

    def plain(q, k, v):
        return ragged_attention(q, k, v, cu, cu, implementation="xla", **options)

    got = jax.jit(lambda p, t: jax.jvp(sharded, p, t)[1])(primals, tangents)
    want = jax.jvp(plain, primals, tangents)[1]
    for a, b, what in zip(got, want, ("out", "stats")):
        assert_close(a, b, np.float32, f"{context_strategy} d {what}")


def test_key_windows_jvp_slices_the_tangent():
    from jax import lax

    from jax_ragged_attn.parallel.key_windows import windows

    x, t = _normal(0, (15, 2, 3)), _normal(1, (15, 2, 3))
    a, b = jnp.int32(9), jnp.int32(2)
    _, got = jax.jvp(lambda x: windows(x, (a, b), 5), (x,), (t,))
    want = np.concatenate([lax.dynamic_slice_in_dim(t, s, 5) for s in (9, 2)])
    np.testing.assert_array_equal(got, want)


def test_heads_sharded_jvp_equals_the_ops():
    """sharded_ragged_attention over a head axis (the op inside shard_map) in forward mode."""
    from jax_ragged_attn.parallel.sharding import sharded_ragged_attention

    primals, tangents = _qkv(12, heads_q=2, heads_kv=2)
    options = dict(max_seqlen_q=MAX_SEQLEN, max_seqlen_kv=MAX_SEQLEN, is_causal=True, return_stats=True)
    cu = jnp.asarray(CU)
    mesh = jax.make_mesh((1,), ("heads",))

    def sharded(q, k, v):
        return sharded_ragged_attention(q, k, v, cu, cu, mesh=mesh, head_axis="heads", implementation="xla", **options)

    def plain(q, k, v):
        return ragged_attention(q, k, v, cu, cu, implementation="xla", **options)

    got = jax.jit(lambda p, t: jax.jvp(sharded, p, t)[1])(primals, tangents)
    want = jax.jvp(plain, primals, tangents)[1]
    for a, b, what in zip(got, want, ("out", "stats")):
        assert_close(a, b, np.float32, f"heads d {what}")


# ---- On 4 virtual CPU devices, in a child interpreter (this file run as a script): forward mode inside shard_map.

MULTI_DEVICE = {
    "heads": dict(head_axis="cp"),
    "ring": dict(token_axis="cp", context_strategy="ring"),
    "all_gather": dict(token_axis="cp", context_strategy="all_gather"),
}


def _multi_device_check(index, name, sharding):
    from jax_ragged_attn.parallel.sharding import sharded_ragged_attention

    primals, tangents = _qkv(20 + index, heads_q=4, heads_kv=4)
    options = dict(max_seqlen_q=MAX_SEQLEN, max_seqlen_kv=MAX_SEQLEN, is_causal=True, return_stats=True)
    cu = jnp.asarray(CU)
    mesh = jax.make_mesh((4,), ("cp",))

    def sharded(q, k, v):
        return sharded_ragged_attention(q, k, v, cu, cu, mesh=mesh, implementation="xla", **sharding, **options)

    def plain(q, k, v):
        return ragged_attention(q, k, v, cu, cu, implementation="xla", **options)

    got = jax.jit(lambda p, t: jax.jvp(sharded, p, t)[1])(primals, tangents)
    want = jax.jvp(plain, primals, tangents)[1]
    for a, b, what in zip(got, want, ("out", "stats")):
        assert_close(a, b, np.float32, f"{name} d {what}")


@pytest.mark.slow
def test_forward_mode_on_four_devices():
    from jax_ragged_attn.testing.multidevice import run_checks_in_child

    run_checks_in_child(__file__, MULTI_DEVICE)


if __name__ == "__main__":
    from jax_ragged_attn.testing.multidevice import report_checks

    report_checks(MULTI_DEVICE, _multi_device_check)


def _opaque(kernel):
    """kernel(*arrays, config) behind jax.pure_callback: a call JAX cannot differentiate, as a GPU kernel."""

    def call(*args):
        *arrays, config = args
        shapes = jax.eval_shape(lambda *a: kernel(*a, config), *arrays)
        host = lambda *a: jax.tree.map(np.asarray, kernel(*a, config))
        return jax.pure_callback(host, shapes, *arrays, vmap_method="sequential")

    return call


def test_kernels_are_never_differentiated():
    """FA3's wrapper with kernels JAX cannot differentiate: forward mode, jacfwd and forward over reverse
    take every derivative of them from the portable path, and agree with it."""
    from jax_ragged_attn.backends.fa3 import ragged as fa3

    primals, tangents = _qkv(13, heads_q=2, heads_kv=2, head_dim=128, dtype=jnp.bfloat16)
    with fa3_emulator.patched():
        forward, backward = fa3._forward_call, fa3._backward_call
        fa3._forward_call, fa3._backward_call = _opaque(forward), _opaque(backward)
        try:
            fn = _op("fa3", True, "token_major")
            got = jax.jit(lambda p, t: jax.jvp(fn, p, t)[1])(primals, tangents)

            def loss(q):
                out, stats = fn(q, *primals[1:])
                return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(stats), stats, 0))

            hvp = jax.jit(lambda q, t: jax.jvp(jax.grad(loss), (q,), (t,))[1])(primals[0], tangents[0])
        finally:
            fa3._forward_call, fa3._backward_call = forward, backward
    want = jax.jvp(_op("xla", True, "token_major"), primals, tangents)[1]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with fa3_emulator.patched():
        expected = jax.jvp(jax.grad(loss), (primals[0],), (tangents[0],))[1]
    np.testing.assert_allclose(np.asarray(hvp, np.float32), np.asarray(expected, np.float32), rtol=0.05, atol=0.05)
