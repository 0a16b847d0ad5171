"""What a context-parallel device's call would gain from a smaller launch: timed variants of one device's call.

    python -m benchmarks.cp_call_variants [--workload CP-c] [--devices 4,8] [--implementation fa3] [--ranks 0,3]

A measurement aid (issue 33, CP-c). A device's call (context_parallel.device_chunks_attention) launches its
kernels over B + 1 slots of up to min(max_seqlen, rows) queries and max_seqlen keys, and reads its keys from two
windows cut out of the gathered K/V and concatenated. With the device's pieces known on the host, this times
the shipped call beside the same call
  slots:   only the slots that hold a piece (the grid a call could have if it knew its pieces);
  tight:   those slots, and max_seqlen_q / max_seqlen_kv the largest piece's (the smallest possible grid);
  gather:  the shipped call with the two windows read by one gather instead of two slices and a concatenation.
"shipped" is context_parallel.device_chunks_attention's call rebuilt from the pieces computed on the host (the same
slots, windows and launch); each variant's largest difference to its out and gradients is printed beside it. The gap
between the shipped call and `tight` bounds what any change of the launch's size can win; `gather` what the windows'
copy can.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.parallel import context_parallel as cp
from jax_ragged_attn.parallel.load_balance import causal_work_per_device

from benchmarks import context_parallel as bench


def variant_call(plan, attend, cu, r, rows, total, mode: str):
    """f(q, k_all, v_all) -> out: device r's call, shipped or as `mode` (module docstring)."""
    slots, starts, size = cp.two_chunk_call(plan, cu, r, rows, total)
    slots, starts = jax.tree.map(np.asarray, slots), [int(s) for s in starts]
    max_q, max_kv = min(plan.max_seqlen, rows), plan.max_seqlen
    if mode in ("slots", "tight"):
        keep = np.flatnonzero(slots.q_len > 0)
        slots = cp.Pieces(*(x[keep] for x in slots))
        if mode == "tight":
            max_q, max_kv = int(slots.q_len.max()), int(slots.kv_len.max())
    cu_q = jnp.asarray(np.append(slots.q_start, 2 * rows), jnp.int32)
    cu_kv = jnp.asarray(np.append(slots.kv_start, 2 * size), jnp.int32)
    seqused = (jnp.asarray(slots.q_len, jnp.int32), jnp.asarray(slots.kv_len, jnp.int32))
    index = np.concatenate([np.arange(s, s + size) for s in starts]).astype(np.int32)

    def windows(x):
        if mode == "gather":
            return jnp.take(x, jnp.asarray(index), axis=0)
        return cp.windows(x, tuple(jnp.int32(s) for s in starts), size)

    def f(q, k, v):
        return attend(q, windows(k), windows(v), cu_q, cu_kv, max_q, max_kv, seqused=seqused,
                      diagonal_alignment="bottom_right" if plan.is_causal else "top_left")[0]
    return f, len(slots.q_len), max_q, max_kv


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="CP-c")
    parser.add_argument("--devices", default="4,8")
    parser.add_argument("--implementation", default=None)
    parser.add_argument("--ranks", default="0")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args(argv)
    print("| n | device | share x one GPU ms | variant | slots | max_q / max_kv | fwd+bwd ms | / share | max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.devices.split(",")):
        w = bench.packer_ordered(bench.CP_WORKLOADS[args.workload], n)
        q, k, v, cu = bench._inputs(w, n)
        total = q.shape[0]
        cu = np.asarray(cu)
        one, _ = bench.one_device(w, args.implementation, args.calls, args.repetitions, devices=n)
        shares = causal_work_per_device(cu, n, True, capacity=total)
        shares = shares / shares.sum()
        rows = total // (2 * n)
        plan = cp.Plan(token_axis="cp", devices=n, load_balance=True, max_seqlen=min(w.max_seqlen, total),
                       is_causal=w.causal, window_left=None, stats_axis=1)
        attend = bench._attend(dict(is_causal=w.causal, implementation=args.implementation), total, w.num_seqs)
        ranks = range(n) if args.ranks == "all" else [int(x) for x in args.ranks.split(",") if int(x) < n]
        for r in ranks:
            ids = [r, 2 * n - 1 - r]
            k_all, v_all, q_dev = bench._device_args(q, k, v, ids, rows)
            reference = None
            for mode in ("shipped", "slots", "tight", "gather"):
                f, slots, max_q, max_kv = variant_call(plan, attend, cu, r, rows, total, mode)

                def step(k, v, q, f=f):
                    out, pullback = jax.vjp(f, q, k, v)
                    return (out, *pullback(jnp.ones_like(out)))
                compiled = jax.jit(step).lower(k_all, v_all, q_dev).compile()
                results = compiled(k_all, v_all, q_dev)
                reference = results if reference is None else reference
                diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                           for a, b in zip(results, reference))
                seconds = bench._time(compiled, (k_all, v_all, q_dev), args.calls, args.repetitions)
                print(f"| {n} | {r} | {shares[r] * one * 1e3:.3f} | {mode} | {slots} | {max_q} / {max_kv} | "
                      f"{seconds * 1e3:.3f} | {seconds / (shares[r] * one):.2f} | {diff:.2g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
