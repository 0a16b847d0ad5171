"""Head-sharded attention against the unsharded call, on 4 virtual CPU devices (token_axis, context
parallelism: tests/test_context_parallel.py).

The device count is fixed when JAX initialises its backend, which other test files in this process have
already done, so the sharded checks run in a child interpreter (this file run as a script) with
--xla_force_host_platform_device_count=4; each check prints one JSON line that a test below asserts on.
Reproduce by hand with
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python tests/test_sharding.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.parallel.sharding import sharded_ragged_attention
from jax_ragged_attn.testing import assert_close, packed_batch
from jax_ragged_attn.testing.multidevice import cudnn_gpus, report_checks, run_checks_in_child

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
EXPLICIT, AUTO = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
# name: (mesh shape, mesh axes, their type, head_axis, (Hq, Hkv), stats layout)
CASES = {
    "head_major": ((4,), ("model",), EXPLICIT, "model", (8, 4), "head_major"),
    "token_major": ((4,), ("model",), EXPLICIT, "model", (8, 4), "token_major"),
    "two_axis_mesh": ((2, 2), ("data", "model"), EXPLICIT, ("data", "model"), (8, 4), "head_major"),
    # 12 query heads over 4 kv heads: each device holds one whole group of 3; replicated inputs, auto axes.
    "groups_of_3_auto_axes": ((4,), ("model",), AUTO, "model", (12, 4), "token_major"),
}


# ---- The child: runs every check on 4 devices and reports each as a JSON line. ----


def _check(mesh_shape, mesh_axes, axis_type, head_axis, heads, stats_layout) -> None:
    assert len(jax.devices()) == 4, f"expected 4 virtual devices, got {jax.devices()}"
    mesh = jax.make_mesh(mesh_shape, mesh_axes, axis_types=(axis_type,) * len(mesh_axes))
    hq, hkv = heads
    rng = np.random.default_rng(hq * 10 + len(mesh_axes))
    batch = packed_batch(
        rng,
        (5, 0, 9, 3),
        (7, 0, 4, 3),
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim_qk=16,
        head_dim_v=8,
        dtype=np.float32,
        slack_q=3,
        slack_kv=2,
    )
    options = dict(
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_kv=batch.max_seqlen_kv,
        is_causal=True,
        stats_layout=stats_layout,
        return_stats=True,
    )
    # Random cotangents for out and stats: the xla path differentiates through stats, so both are checked.
    d_out = jnp.asarray(rng.standard_normal((batch.q.shape[0], hq, 8)), jnp.float32)
    d_stats = jnp.asarray(rng.standard_normal((hq, batch.q.shape[0])), jnp.float32)
    d_stats = d_stats if stats_layout == "head_major" else d_stats.T

    def forward_and_backward(attention, q, k, v, cu_q, cu_kv, d_out, d_stats):
        # A vjp rather than a loss: a scalar loss would sum over heads and so need an all-reduce.
        outputs, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu_q, cu_kv, **options), q, k, v)
        return (*outputs, *pullback((d_out, d_stats)))

    sharded = functools.partial(sharded_ragged_attention, mesh=mesh, head_axis=head_axis)
    head_split = jax.NamedSharding(mesh, jax.P(None, head_axis, None))
    if axis_type == EXPLICIT:
        args = (*jax.device_put(batch.args[:3], head_split), *batch.args[3:], d_out, d_stats)
    else:  # replicated inputs: shard_map must split them itself, still without any collective
        args = (*batch.args, d_out, d_stats)
    compiled = jax.jit(functools.partial(forward_and_backward, sharded)).lower(*args).compile()
    got = compiled(*args)
    expected = jax.jit(functools.partial(forward_and_backward, ragged_attention))(*batch.args, d_out, d_stats)
    for what, actual, want in zip(("out", "stats", "dq", "dk", "dv"), got, expected):
        assert_close(actual, want, np.float32, what)
        assert float(jnp.abs(jnp.where(jnp.isfinite(want), want, 0)).max()) > 0, f"{what} is all zero"

    stats_split = jax.P(head_axis, None) if stats_layout == "head_major" else jax.P(None, head_axis)
    out, stats = got[:2]
    assert out.sharding.is_equivalent_to(head_split, 3), f"out sharding {out.sharding}"
    assert stats.sharding.is_equivalent_to(jax.NamedSharding(mesh, stats_split), 2), f"stats {stats.sharding}"
    assert out.addressable_shards[0].data.shape[1] == hq // 4, "each device should hold a quarter of the heads"
    found = [c for c in COLLECTIVES if c in compiled.as_text()]
    assert not found, f"collectives in the compiled program: {found}"


def _child() -> None:
    report_checks(CASES, lambda index, name, case: _check(*case))


# ---- The tests. ----


def test_sharded_matches_unsharded_without_collectives():
    # One test, one child: split into several, pytest -n would start a child per worker.
    run_checks_in_child(__file__, CASES)


def _args(hq=8, hkv=4):
    batch = packed_batch(
        np.random.default_rng(0),
        (3, 4),
        (3, 4),
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=np.float32,
    )
    return batch.args, dict(max_seqlen_q=4, max_seqlen_kv=4)


def test_token_split_input_without_token_axis_raises():
    # On a mesh of explicit axes an array's type carries its sharding: a q split along tokens is refused
    # unless token_axis asks for context parallelism (tests/test_context_parallel.py).
    args, options = _args()
    mesh = jax.make_mesh((1,), ("model",), axis_types=(EXPLICIT,))
    q = jax.device_put(args[0], jax.NamedSharding(mesh, jax.P("model", None, None)))
    with pytest.raises(
        NotImplementedError,
        match=r"q is split along its packed token axis over 'model', but "
        r"token_axis is None: pass token_axis='model'",
    ):
        sharded_ragged_attention(q, *args[1:], mesh=mesh, head_axis="model", **options)


@pytest.mark.parametrize("hq, hkv, name", [(6, 3, "q"), (8, 2, "k")])
def test_heads_must_divide_the_head_axis(hq, hkv, name):
    args, options = _args(hq, hkv)
    mesh = jax.sharding.AbstractMesh((4,), ("model",))  # validation needs only the axis sizes
    with pytest.raises(
        ValueError,
        match=rf"{name}'s heads \({args[0 if name == 'q' else 1].shape[1]}\) must be a "
        r"multiple of the 4 devices on head_axis 'model'",
    ):
        sharded_ragged_attention(*args, mesh=mesh, head_axis="model", **options)


def test_unknown_head_axis_raises():
    args, options = _args()
    with pytest.raises(ValueError, match=r"head_axis must name axes of the mesh \('model',\), got 'heads'"):
        sharded_ragged_attention(*args, mesh=jax.make_mesh((1,), ("model",)), head_axis="heads", **options)


if __name__ == "__main__":
    _child()


@pytest.mark.gpu
def test_two_gpus_cudnn_head_sharded_matches_one_gpu_without_collectives():
    """On a host with 2+ GPUs: the cuDNN path split over heads equals the unsharded cuDNN call and the
    float64 reference, with no collective in the compiled program."""
    from jax_ragged_attn.testing.reference import reference_attention

    gpus = cudnn_gpus(2)
    mesh = jax.make_mesh((2,), ("model",), axis_types=(EXPLICIT,), devices=gpus[:2])
    rng = np.random.default_rng(11)
    batch = packed_batch(
        rng,
        (300, 0, 517, 64),
        (280, 9, 517, 70),
        num_heads_q=16,
        num_heads_kv=4,
        head_dim_qk=128,
        head_dim_v=128,
        dtype="bfloat16",
        slack_q=40,
        slack_kv=7,
    )
    options = dict(
        max_seqlen_q=batch.max_seqlen_q, max_seqlen_kv=batch.max_seqlen_kv, is_causal=True, implementation="cudnn"
    )
    d_out = rng.standard_normal((batch.q.shape[0], 16, 128)).astype("bfloat16")
    d_out[sum(batch.seqlens_q) :] = 0

    def forward_and_backward(attention, q, k, v, cu_q, cu_kv, d_out):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu_q, cu_kv, **options), q, k, v)
        return (out, *pullback(d_out))

    sharded = functools.partial(sharded_ragged_attention, mesh=mesh, head_axis="model")
    head_split = jax.NamedSharding(mesh, jax.P(None, "model", None))
    args = (
        *jax.device_put(batch.args[:3], head_split),
        *batch.args[3:],
        jax.device_put(jnp.asarray(d_out), head_split),
    )
    compiled = jax.jit(functools.partial(forward_and_backward, sharded)).lower(*args).compile()
    got = compiled(*args)
    one_gpu = jax.jit(functools.partial(forward_and_backward, ragged_attention))(*batch.args, jnp.asarray(d_out))
    expected = reference_attention(
        *batch.reference_args,
        d_out=d_out.astype(np.float64),
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_kv=batch.max_seqlen_kv,
        is_causal=True,
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, one_gpu):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
        assert_close(np.asarray(a, np.float64), expected[name], "bfloat16", name)
    assert got[0].addressable_shards[0].data.shape[1] == 8 and {s.device for s in got[0].addressable_shards} == set(
        gpus[:2]
    )
    found = [c for c in COLLECTIVES if c in compiled.as_text()]
    assert not found, f"collectives in the compiled program: {found}"
