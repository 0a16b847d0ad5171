"""Sinks on the cuDNN path (the log-sum-exp epilogue) against no sinks and against the xla path's sinks:
fwd+bwd of one workload (default W1), plain loop of jitted calls (ms, median). Needs a GPU with cuDNN.

Usage: python -m benchmarks.sinks [WORKLOAD]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.testing.workloads import WORKLOADS


def step(implementation, with_sinks, q, k, v, cu, s, w):
    def loss(q, k, v, s):
        out = ragged_attention(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen_q=w.max_seqlen,
            max_seqlen_kv=w.max_seqlen,
            is_causal=True,
            implementation=implementation,
            sinks=s if with_sinks else None,
        )
        return jnp.sum(out.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sinks", description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", nargs="?", default="W1", choices=sorted(WORKLOADS))
    w = WORKLOADS[parser.parse_args(argv).workload]
    q, k, v, cu = w.packed_inputs()
    s = jnp.zeros((w.num_heads_q,), jnp.float32)
    print("| system | fwd+bwd ms |\n|---|---|")
    for name, impl, sinks, calls in (
        ("cudnn, no sinks", "cudnn", False, 20),
        ("cudnn, sinks (epilogue)", "cudnn", True, 20),
        ("xla, sinks", "xla", True, 2),
    ):
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
