"""Causal bottom-right against top-left on the cuDNN path: what the split backward (launch._backward) buys.

    python -m benchmarks.bottom_right [--calls 10 --repetitions 5]

Per case, fwd+bwd ms (plain loop of jitted calls, median) of: top-left causal and bottom-right with the split
backward. (The one-call bottom-right backward this measured against is gone: 0.64-0.74x, PERFORMANCE.md.)
Cases: equal q and kv lengths (the two masks are the same, so top-left is the floor), and one long piece of
queries late in its sequence (context parallelism's offset piece: bottom-right is the only right mask there,
and the causal area is what its work should cost).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.index import cu_seqlens_from_lengths
from jax_ragged_attn.testing.workloads import WORKLOADS

from benchmarks.timing import plain_loop_seconds

# (name, q lengths, kv lengths, heads q, heads kv, head dim)
CASES = (
    ("W1 (equal lengths)", WORKLOADS["W1"].seqlens, WORKLOADS["W1"].seqlens, 16, 16, 128),
    ("4 x 8192 (equal)", (8192,) * 4, (8192,) * 4, 32, 8, 128),
    ("16,384 q at 49,152 of 65,536 kv", (16384,), (65536,), 32, 8, 128),
    ("16,384 q at 16,384 of 32,768 kv", (16384,), (32768,), 32, 8, 128),
)


def _step(alignment, lengths_q, lengths_kv, hq, hkv, d):
    rng = np.random.default_rng(0)
    tq, tkv = sum(lengths_q), sum(lengths_kv)
    q = jnp.asarray(rng.standard_normal((tq, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((tkv, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((tkv, hkv, d)), jnp.bfloat16)
    cu_q, cu_kv = jnp.asarray(cu_seqlens_from_lengths(lengths_q)), jnp.asarray(cu_seqlens_from_lengths(lengths_kv))
    d_out = jnp.asarray(rng.standard_normal((tq, hq, d)), jnp.bfloat16)

    def loss(q, k, v):
        out = ragged_attention(q, k, v, cu_q, cu_kv, max_seqlen_q=max(lengths_q), max_seqlen_kv=max(lengths_kv),
                               is_causal=True, diagonal_alignment=alignment, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(f(q, k, v))
    return lambda: f(q, k, v)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}; fwd+bwd ms, median of {args.repetitions} loops of {args.calls}")
    print("| case | top-left | bottom-right split |")
    print("|---|---|---|")
    for name, lengths_q, lengths_kv, hq, hkv, d in CASES:
        ms = {}
        for label, alignment in (("top_left", "top_left"), ("split", "bottom_right")):
            if alignment == "top_left" and lengths_q != lengths_kv:
                ms[label] = float("nan")  # a different mask: no floor to compare with
                continue
            call = _step(alignment, lengths_q, lengths_kv, hq, hkv, d)
            ms[label] = statistics.median(plain_loop_seconds(call, args.calls, args.repetitions)) * 1e3
        print(f"| {name} | {ms['top_left']:.3f} | {ms['split']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
