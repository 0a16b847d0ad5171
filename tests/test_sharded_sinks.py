"""Learnable sinks through sharded_ragged_attention on 4 virtual CPU devices (a child interpreter, as in
test_sharding.py): heads split (the sink logits split with their heads), tokens split (all-gather context
parallelism, natural and load-balanced), and both; out, stats and the gradients of q, k, v and the sinks
against the unsharded op. Reproduce by hand with
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python tests/test_sharded_sinks.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.parallel.sharding import reorder_for_load_balance, restore_order, sharded_ragged_attention
from jax_ragged_attn.testing import assert_close
from jax_ragged_attn.testing.multidevice import report_checks, run_checks_in_child

pytestmark = pytest.mark.slow  # 4-device children

CASES = {  # name: (mesh shape, mesh axes, sharded_ragged_attention keywords)
    "heads": ((4,), ("m",), dict(head_axis="m")),
    "tokens_natural": ((4,), ("m",), dict(token_axis="m")),
    "tokens_balanced": ((4,), ("m",), dict(token_axis="m", load_balance=True)),
    "heads_and_tokens": ((2, 2), ("h", "m"), dict(head_axis="h", token_axis="m")),
}
T = 48
CU = np.array([0, 17, 17, 26, 39, 44], np.int32)  # documents cross the 12-row shards; a zero-length one
OPTIONS = dict(max_seqlen_q=17, max_seqlen_kv=17, is_causal=True, implementation="xla", return_stats=True)


def _loss(attention, q, k, v, sinks):
    out, stats = attention(q, k, v, sinks)
    weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    return jnp.sum(out * weights) + 0.3 * jnp.sum(jnp.where(jnp.isfinite(stats), stats, 0.0))


def _check(index, name, case) -> None:
    mesh_shape, mesh_axes, keywords = case
    rng = np.random.default_rng(index)
    q = jnp.asarray(rng.standard_normal((T, 8, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((T, 4, 8)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(2 * rng.standard_normal(8), jnp.float32)
    mesh = jax.make_mesh(mesh_shape, mesh_axes)
    n = mesh.shape["m"]
    balanced = keywords.get("load_balance", False)
    order = (lambda x, axis=0: reorder_for_load_balance(x, n, axis)) if balanced else (lambda x, axis=0: x)
    restore = (lambda x, axis=0: restore_order(x, n, axis)) if balanced else (lambda x, axis=0: x)

    def sharded(q, k, v, sinks):
        out, stats = sharded_ragged_attention(
            order(q), order(k), order(v), CU, CU, mesh=mesh, sinks=sinks, **keywords, **OPTIONS
        )
        return restore(out), restore(stats, 1)

    def unsharded(q, k, v, sinks):
        return ragged_attention(q, k, v, CU, CU, sinks=sinks, **OPTIONS)

    with jax.set_mesh(mesh):
        got = jax.jit(sharded)(q, k, v, sinks)
        got_grads = jax.jit(jax.grad(functools.partial(_loss, sharded), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    want = unsharded(q, k, v, sinks)
    want_grads = jax.grad(functools.partial(_loss, unsharded), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for what, g, w in zip(("out", "stats", "dq", "dk", "dv", "dsinks"), (*got, *got_grads), (*want, *want_grads)):
        assert_close(np.asarray(g), np.asarray(w), "float32", f"{name}: {what}")
    assert float(jnp.abs(want_grads[3]).max()) > 1e-3, "the sinks receive a gradient"


def test_sinks_through_sharded_attention():
    run_checks_in_child(__file__, CASES)


def test_ring_refuses_sinks_with_the_reason():
    mesh = jax.make_mesh((1,), ("m",))
    q = jnp.zeros((8, 2, 8), jnp.float32)
    cu = jnp.array([0, 8], jnp.int32)
    with pytest.raises(NotImplementedError, match="sinks with context_strategy='ring'"):
        sharded_ragged_attention(
            q,
            q,
            q,
            cu,
            cu,
            mesh=mesh,
            token_axis="m",
            context_strategy="ring",
            sinks=jnp.zeros((2,)),
            max_seqlen_q=8,
            max_seqlen_kv=8,
        )


if __name__ == "__main__":
    report_checks(CASES, _check)
