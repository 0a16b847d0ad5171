"""Context parallelism on 2 GPUs against one: fwd+bwd step time, per-device attention time, memory.

    python -m jax_ragged_attn.tools.bench.context_parallel [--workloads CP-a,W1] [--implementation cudnn]

Systems, each one jitted forward + backward (a vjp with a fixed cotangent) per step:
  1 GPU            ragged_attention on the first device
  CP=2 natural     sharded_ragged_attention(token_axis="cp") over 2 devices, contiguous halves
  CP=2 balanced    the same with load_balance=True on reorder_for_load_balance'd inputs

Per-device attention time: each device's calls (its chunks' pieces against all T keys, what its part of the
sharded step runs) timed alone on one GPU, so no collective hides the imbalance; imbalance = slowest /
mean - 1. Memory: the compiled step's arguments + outputs + temporaries on one device (XLA's own
accounting). On a host with fewer than 2 devices the CP rows are skipped with the reason.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import jax
import jax.numpy as jnp

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.context_parallel import chunk_pieces, pieces_cu_seqlens
from jax_ragged_attn.sharding import reorder_for_load_balance, sharded_ragged_attention
from jax_ragged_attn.tools.bench.timing import device_bytes, plain_loop_seconds
from jax_ragged_attn.tools.workloads import WORKLOADS, Workload

DEVICES = 2
# (a) of issue 12: 4 documents of 32,768 tokens, GQA 32/8, d 128, causal.
CP_A = Workload("CP-a", "4 documents of 32,768 tokens, GQA", (32768,) * 4, 32, 8, 128)
CP_WORKLOADS = {"CP-a": CP_A, **WORKLOADS}


def _inputs(w: Workload):
    """The workload's q, k, v with tail padding up to a multiple of 2 * DEVICES rows (load_balance's chunks)."""
    q, k, v, cu = w.packed_inputs()
    pad = -q.shape[0] % (2 * DEVICES)
    q, k, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    return q, k, v, cu


def _step(attention):
    def step(q, k, v, cu, d_out):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu, cu), q, k, v)
        return out, *pullback(d_out)
    return step


def _time(compiled, args, calls: int, repetitions: int) -> float:
    jax.block_until_ready(compiled(*args))  # warm
    return statistics.median(plain_loop_seconds(lambda: compiled(*args), calls, repetitions))


def _options(w: Workload, implementation):
    return dict(max_seqlen_q=w.max_seqlen, max_seqlen_kv=w.max_seqlen, is_causal=w.causal, implementation=implementation)


def one_device(w: Workload, implementation, calls, repetitions):
    q, k, v, cu = _inputs(w)
    d_out = jnp.ones_like(q)
    step = jax.jit(_step(functools.partial(ragged_attention, **_options(w, implementation))))
    compiled = step.lower(q, k, v, cu, d_out).compile()
    return _time(compiled, (q, k, v, cu, d_out), calls, repetitions), device_bytes(compiled)


def context_parallel(w: Workload, implementation, load_balance: bool, calls, repetitions):
    mesh = jax.make_mesh((DEVICES,), ("cp",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:DEVICES])
    q, k, v, cu = _inputs(w)
    if load_balance:
        q, k, v = (reorder_for_load_balance(x, DEVICES) for x in (q, k, v))
    tokens = jax.NamedSharding(mesh, jax.P("cp", None, None))
    q, k, v = jax.device_put((q, k, v), tokens)
    d_out = jax.device_put(jnp.ones(q.shape, q.dtype), tokens)
    cu = jax.device_put(cu, jax.NamedSharding(mesh, jax.P()))
    attention = functools.partial(sharded_ragged_attention, mesh=mesh, token_axis="cp", load_balance=load_balance,
                                  **_options(w, implementation))
    compiled = jax.jit(_step(attention)).lower(q, k, v, cu, d_out).compile()
    return _time(compiled, (q, k, v, cu, d_out), calls, repetitions), device_bytes(compiled)


def per_device_seconds(w: Workload, implementation, load_balance: bool, calls, repetitions) -> list[float]:
    """Each device's attention calls (fwd+bwd) in the sharded step, timed alone on the first device."""
    q, k, v, cu = _inputs(w)
    total = q.shape[0]
    chunks = 2 * DEVICES if load_balance else DEVICES
    rows = total // chunks
    options = dict(_options(w, implementation), is_causal=w.causal, diagonal_alignment="bottom_right")
    seconds = []
    for r in range(DEVICES):
        ids = [r, 2 * DEVICES - 1 - r] if load_balance else [r]
        calls_of_device = []
        for chunk in ids:
            pieces = chunk_pieces(cu, chunk * rows, rows, max_seqlen=w.max_seqlen, is_causal=w.causal)
            cu_q, cu_kv = pieces_cu_seqlens(pieces)
            calls_of_device.append((q[chunk * rows:(chunk + 1) * rows], cu_q, cu_kv))

        def device_step(k, v, *chunks):
            results = []
            for q_chunk, cu_q, cu_kv in zip(chunks[0::3], chunks[1::3], chunks[2::3]):
                attention = functools.partial(ragged_attention, **dict(options, max_seqlen_q=min(w.max_seqlen, rows)))
                out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu_q, cu_kv), q_chunk, k, v)
                results.append(pullback(jnp.ones_like(out)))
            return results

        args = (k, v, *[x for c in calls_of_device for x in c])
        compiled = jax.jit(device_step).lower(*args).compile()
        seconds.append(_time(compiled, args, calls, repetitions))
    return seconds


def _mib(n):
    return "-" if n is None else f"{n / 2**20:,.0f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="CP-a,W1", help=f"comma-separated, of {sorted(CP_WORKLOADS)}")
    parser.add_argument("--implementation", default=None, choices=(None, "cudnn", "xla"))
    parser.add_argument("--calls", type=int, default=5, help="steps per timed loop")
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in CP_WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(CP_WORKLOADS)}")
    skip = None if len(jax.devices()) >= DEVICES else (
        f"needs {DEVICES} devices, this host has {len(jax.devices())}: CP rows skipped")
    print("| workload | system | fwd+bwd ms/step | speedup vs 1 GPU | per-device attention ms | imbalance | "
          "memory per device MiB |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        w = CP_WORKLOADS[name]
        print(f"<!-- {w.summary()} -->", file=sys.stderr)
        base, base_bytes = one_device(w, args.implementation, args.calls, args.repetitions)
        print(f"| {name} | 1 GPU | {base * 1e3:.2f} | 1.00x | - | - | {_mib(base_bytes)} |", flush=True)
        for balanced in (False, True):
            system = f"CP={DEVICES} {'balanced' if balanced else 'natural'}"
            if skip:
                print(f"| {name} | {system} | skipped: {skip} | | | | |", flush=True)
                continue
            seconds, footprint = context_parallel(w, args.implementation, balanced, args.calls, args.repetitions)
            each = per_device_seconds(w, args.implementation, balanced, args.calls, args.repetitions)
            imbalance = max(each) / (sum(each) / len(each)) - 1
            print(f"| {name} | {system} | {seconds * 1e3:.2f} | {base / seconds:.2f}x | "
                  f"{' / '.join(f'{s * 1e3:.2f}' for s in each)} | {imbalance * 100:.1f} % | {_mib(footprint)} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
