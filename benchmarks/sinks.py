"""Sinks on the cuDNN path (the log-sum-exp epilogue) against no sinks and against the xla path's sinks:
fwd+bwd of one W1-like batch, plain loop of jitted calls (ms, median). Usage: python -m benchmarks.sinks"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.testing.workloads import WORKLOADS


def step(implementation, with_sinks, q, k, v, cu, s, w):
    def loss(q, k, v, s):
        out = ragged_attention(q, k, v, cu, cu, max_seqlen_q=w.max_seqlen, max_seqlen_kv=w.max_seqlen, is_causal=True,
                               implementation=implementation, sinks=s if with_sinks else None)
        return jnp.sum(out.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def main():
    w = WORKLOADS[sys.argv[1] if len(sys.argv) > 1 else "W1"]
    q, k, v, cu = w.packed_inputs()
    s = jnp.zeros((w.num_heads_q,), jnp.float32)
    print("| system | fwd+bwd ms |\n|---|---|")
    for name, impl, sinks, calls in (("cudnn, no sinks", "cudnn", False, 20), ("cudnn, sinks (epilogue)", "cudnn", True, 20),
                                     ("xla, sinks", "xla", True, 2)):
        f = step(impl, sinks, q, k, v, cu, s, w)
        jax.block_until_ready(f(q, k, v, s))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                r = f(q, k, v, s)
            jax.block_until_ready(r)
            times.append((time.perf_counter() - t0) / calls)
        print(f"| {name} | {statistics.median(times) * 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
