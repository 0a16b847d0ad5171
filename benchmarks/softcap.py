"""Logit soft-capping on cuDNN (the graph's score modifier) against no cap: forward and forward + backward of
one workload (default W1), a plain loop of jitted calls (benchmarks/timing.py: plain_loop_seconds), median ms, and
the ratio of the two (softcap's cost). Needs a GPU for cuDNN.

Usage: python -m benchmarks.softcap [WORKLOAD] [SOFTCAP] [IMPLEMENTATION]   (defaults: W1 50 cudnn)
"""

import argparse
import statistics

import jax
import jax.numpy as jnp

from benchmarks.timing import plain_loop_seconds
from jax_ragged_attn import ragged_attention
from jax_ragged_attn.testing.workloads import WORKLOADS


def functions(w, cu, implementation, softcap):
    def attend(q, k, v):
        return ragged_attention(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen_q=w.max_seqlen,
            max_seqlen_kv=w.max_seqlen,
            is_causal=w.causal,
            implementation=implementation,
            softcap=softcap,
        )

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    return {"fwd": jax.jit(attend), "fwd+bwd": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.softcap", description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", nargs="?", default="W1", choices=sorted(WORKLOADS))
    parser.add_argument("softcap", nargs="?", type=float, default=50.0)
    parser.add_argument("implementation", nargs="?", default="cudnn")
    args = parser.parse_args(argv)
    name, cap, implementation = args.workload, args.softcap, args.implementation
    w = WORKLOADS[name]
    q, k, v, cu = w.packed_inputs()
    calls = 20 if implementation == "cudnn" else 2
    medians = {}
    print(f"{name}, {implementation}\n| softcap | direction | ms (median) |\n|---|---|---|")
    for softcap in (None, cap):
        for direction, f in functions(w, cu, implementation, softcap).items():
            jax.block_until_ready(f(q, k, v))  # compile and build the graphs outside the timing
            medians[softcap, direction] = statistics.median(plain_loop_seconds(lambda: f(q, k, v), calls, 5))
            print(f"| {softcap} | {direction} | {medians[softcap, direction] * 1e3:.3f} |", flush=True)
    for direction in ("fwd", "fwd+bwd"):
        print(f"softcap {cap} / none, {direction}: {medians[cap, direction] / medians[None, direction]:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
