"""Context parallelism: the packed token axis split over 4 devices, both strategies, natural and balanced
order, against the op on one device (outputs, stats and gradients).

    python examples/context_parallel.py                        # 4 virtual CPU devices, on any machine
    JAX_PLATFORMS=cuda python examples/context_parallel.py     # the first 4 GPUs of a host that has them

Device r holds rows [r*T/n, (r+1)*T/n); documents may straddle devices. "all_gather" gathers K/V on every
device; "ring" passes K/V shards around with ppermute (memory O(T/n)). With load_balance=True the inputs come
in the dual-chunk order (device r holds chunks r and 2n-1-r of 2n), which evens causal work; the results come
back in that order. docs/CONTEXT_PARALLEL.md explains each. XLA reads its flags when jax is imported, so
they are set first.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.parallel.sharding import reorder_for_load_balance, restore_order, sharded_ragged_attention

n, S = 4, 16
cu_seqlens = jnp.array([0, 12, 12, 28], jnp.int32)  # T = 32 rows: a multiple of 2n = 8
keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (32, 8, 64), jnp.float32)
k = jax.random.normal(keys[1], (32, 4, 64), jnp.float32)
v = jax.random.normal(keys[2], (32, 4, 64), jnp.float32)
mesh = jax.make_mesh((n,), ("cp",), devices=jax.devices()[:n])


def loss(attend):
    def f(q, k, v):
        out, stats = attend(q, k, v)
        return (out * out).sum() + jnp.where(jnp.isfinite(stats), stats, 0.0).sum(), (out, stats)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


(_, (want_out, want_stats)), want_grads = loss(
    lambda q, k, v: ragged_attention(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen_q=S, max_seqlen_kv=S, is_causal=True, return_stats=True
    )
)(q, k, v)

for strategy in ("all_gather", "ring"):
    for balanced in (False, True):
        order = (lambda x, axis=0: reorder_for_load_balance(x, n, axis)) if balanced else (lambda x, axis=0: x)
        back = (lambda x, axis=0: restore_order(x, n, axis)) if balanced else (lambda x, axis=0: x)
        (_, (out, stats)), grads = loss(
            lambda q, k, v: sharded_ragged_attention(
                q,
                k,
                v,
                cu_seqlens,
                cu_seqlens,
                mesh=mesh,
                token_axis="cp",
                context_strategy=strategy,
                load_balance=balanced,
                max_seqlen_q=S,
                max_seqlen_kv=S,
                is_causal=True,
                return_stats=True,
            )
        )(*(order(x) for x in (q, k, v)))  # cu_seqlens stay in the natural order
        out, stats = back(out), back(stats, axis=1)  # head-major stats [H, T]: tokens on axis 1
        grads = [back(g) for g in grads]
        error = max(float(jnp.abs(a - b).max()) for a, b in [(out, want_out), *zip(grads, want_grads)])
        same_stats = bool(jnp.allclose(stats, want_stats, atol=1e-4))
        print(
            f"{strategy:10s} {'balanced' if balanced else 'natural '}: out and dq/dk/dv within {error:.1e} "
            f"of one device, stats {'equal' if same_stats else 'DIFFERENT'}"
        )
        assert error < 1e-4 and same_stats, (strategy, balanced, error)
