"""Context parallelism on 2 GPUs against one: fwd+bwd step time, per-device attention time, memory.

    python -m benchmarks.context_parallel [--workloads CP-a,W1] [--implementation cudnn]
    python -m benchmarks.context_parallel --simulate 2,4,8 --workloads CP-a,CP-b,CP-c  # 1 GPU

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
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import device_bytes, median_loop_seconds
from jax_ragged_attn import ragged_attention
from jax_ragged_attn.parallel import context_parallel as cp
from jax_ragged_attn.parallel.load_balance import balanced_document_order, causal_work_per_device
from jax_ragged_attn.parallel.sharding import reorder_for_load_balance, sharded_ragged_attention
from jax_ragged_attn.testing.workloads import WORKLOADS, Workload

DEVICES = 2


# The context-parallel workloads, GQA 32/8, d 128, causal: (a) 4 documents of 32,768 tokens, (b) 10 documents of 4k..32k
# (131,072 tokens), (c) W-like: 16 documents of 128..8192 (65,536 tokens).
def _scaled_lengths(num: int, low: int, high: int, total: int, seed: int) -> tuple[int, ...]:
    """num lengths drawn uniform in [low, high], scaled to sum to exactly `total` (the remainder on the last)."""
    drawn = np.random.default_rng(seed).integers(low, high, size=num, endpoint=True).astype(np.float64)
    lengths = np.floor(drawn * total / drawn.sum()).astype(np.int64)
    lengths[-1] += total - lengths.sum()
    return tuple(int(x) for x in lengths)


CP_A = Workload("CP-a", "4 documents of 32,768 tokens, GQA", (32768,) * 4, 32, 8, 128)
CP_B = Workload("CP-b", "10 documents of 4k..32k, GQA", _scaled_lengths(10, 4096, 32768, 131072, seed=1), 32, 8, 128)
CP_C = Workload(
    "CP-c", "16 documents of 128..8192 (W-like), GQA", _scaled_lengths(16, 128, 8192, 65536, seed=0), 32, 8, 128
)
CP_WORKLOADS = {"CP-a": CP_A, "CP-b": CP_B, "CP-c": CP_C, **WORKLOADS}


def _padded_tokens(w: Workload, devices: int) -> int:
    """The rows of _inputs' buffers: w's tokens padded to a multiple of 2 * devices (load_balance's chunks)."""
    return w.total_tokens + -w.total_tokens % (2 * devices)


def _inputs(w: Workload, devices: int = DEVICES):
    """The workload's q, k, v with tail padding up to _padded_tokens rows."""
    q, k, v, cu = w.packed_inputs()
    pad = _padded_tokens(w, devices) - q.shape[0]
    q, k, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    return q, k, v, cu


def packer_ordered(w: Workload, devices: int) -> Workload:
    """w with its documents in the order pack_documents(context_parallel_devices=devices) would give them
    (load_balance.balanced_document_order over w's padded token count): with the dual-chunk order after it,
    the best balance the library offers."""
    order = balanced_document_order(np.asarray(w.seqlens), devices, _padded_tokens(w, devices))
    return dataclasses.replace(w, seqlens=tuple(int(w.seqlens[i]) for i in order))


def _step(attention):
    def step(q, k, v, cu, d_out):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu, cu), q, k, v)
        return out, *pullback(d_out)

    return step


def _time(compiled, args, calls: int, repetitions: int) -> float:
    return median_loop_seconds(compiled, args, calls, repetitions)  # after one warm call


def _options(w: Workload, implementation):
    return dict(
        max_seqlen_q=w.max_seqlen, max_seqlen_kv=w.max_seqlen, is_causal=w.causal, implementation=implementation
    )


def one_device(w: Workload, implementation, calls, repetitions, devices: int = DEVICES):
    q, k, v, cu = _inputs(w, devices)
    d_out = jnp.ones_like(q)
    step = jax.jit(_step(functools.partial(ragged_attention, **_options(w, implementation))))
    compiled = step.lower(q, k, v, cu, d_out).compile()
    return _time(compiled, (q, k, v, cu, d_out), calls, repetitions), device_bytes(compiled)


def context_parallel(w: Workload, implementation, load_balance: bool, calls, repetitions):
    mesh = jax.make_mesh(
        (DEVICES,), ("cp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:DEVICES]
    )
    q, k, v, cu = _inputs(w)
    if load_balance:
        q, k, v = (reorder_for_load_balance(x, DEVICES) for x in (q, k, v))
    tokens = jax.NamedSharding(mesh, jax.P("cp", None, None))
    q, k, v = jax.device_put((q, k, v), tokens)
    d_out = jax.device_put(jnp.ones(q.shape, q.dtype), tokens)
    cu = jax.device_put(cu, jax.NamedSharding(mesh, jax.P()))
    attention = functools.partial(
        sharded_ragged_attention, mesh=mesh, token_axis="cp", load_balance=load_balance, **_options(w, implementation)
    )
    compiled = jax.jit(_step(attention)).lower(q, k, v, cu, d_out).compile()
    return _time(compiled, (q, k, v, cu, d_out), calls, repetitions), device_bytes(compiled)


def _attend(options, total: int, num_seqs: int):
    """device_chunks_attention's attend, as sharding.sharded_ragged_attention passes it: the op, with the whole
    batch's shape class (T / B) for implementation=None's choice."""
    from jax_ragged_attn.config import AttentionOptions
    from jax_ragged_attn.ops.ragged import attend as attend_op

    base = AttentionOptions(
        return_stats=True, policy_tokens_per_sequence=cp.batch_tokens_per_sequence(total, num_seqs), **options
    )

    def attend(q, k, v, cu_q, cu_kv, max_seqlen_q, max_seqlen_kv, *, seqused, diagonal_alignment):
        return attend_op(
            (q, k, v),
            cu_q,
            cu_kv,
            dataclasses.replace(base, diagonal_alignment=diagonal_alignment),
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            seqused_q=seqused[0],
            seqused_kv=seqused[1],
        )

    return attend


def per_device_seconds(
    w: Workload, implementation, load_balance: bool, calls, repetitions, *, devices: int = DEVICES
) -> list[float]:
    """Each of `devices` devices' attention calls (fwd+bwd) in the sharded step, timed alone on the first
    device: the exact function the sharded op runs (context_parallel.device_chunks_attention) on that
    device's query chunks against all T keys, so no collective hides the imbalance."""
    q, k, v, cu = _inputs(w, devices)
    total = q.shape[0]
    chunks = 2 * devices if load_balance else devices
    rows = total // chunks
    plan = cp.Plan(
        token_axis="cp",
        devices=devices,
        load_balance=load_balance,
        max_seqlen=min(w.max_seqlen, total),
        is_causal=w.causal,
        window_left=None,
        stats_axis=1,
    )
    attend = _attend(dict(is_causal=w.causal, implementation=implementation), total, w.num_seqs)
    seconds = []
    for r in range(devices):
        ids = [r, 2 * devices - 1 - r] if load_balance else [r]
        args = _device_args(q, k, v, ids, rows)
        compiled = _device_step(plan, attend, cu, rows, ids, True).lower(*args).compile()
        seconds.append(_time(compiled, args, calls, repetitions))
    return seconds


def _device_step(plan, attend, cu, rows, ids, backward: bool):
    """Device r's call (ids: its chunks, r first) as one jitted function of (k, v, q): forward only, or with the
    backward of a fixed cotangent. context_parallel.device_chunks_attention, as the sharded op runs it; q is the
    device's rows (_device_args), as its shard holds them."""

    def step(k, v, q):
        def f(q, k, v):
            return cp.device_chunks_attention(plan, attend, q, k, v, cu, ids[0])[0]

        if not backward:
            return f(q, k, v)
        out, pullback = jax.vjp(f, q, k, v)
        return pullback(jnp.ones_like(out))

    return jax.jit(step)


def _device_args(q, k, v, ids, rows):
    """(k, v, the device's query rows: its chunks side by side), made outside the timed function."""
    return k, v, jnp.concatenate([q[c * rows : (c + 1) * rows] for c in ids])


def breakdown(names, implementation, calls, repetitions, devices: int, order: str = "packer+balanced") -> None:
    """Timed parts of each device's call: its forward alone and its backward (fwd+bwd minus
    fwd), each beside the device's share of one GPU's forward / backward."""
    print("| workload | n | order | device | fwd ms (share x 1 GPU) | bwd ms (share x 1 GPU) |")
    print("|---|---|---|---|---|---|")
    for name in names:
        w = CP_WORKLOADS[name]
        total = _padded_tokens(w, devices)
        balanced = order != "natural"
        if order == "packer+balanced":
            w = packer_ordered(w, devices)
        q, k, v, cu = _inputs(w, devices)
        one_fwd = _time(
            jax.jit(functools.partial(ragged_attention, **_options(w, implementation)))
            .lower(q, k, v, cu, cu)
            .compile(),
            (q, k, v, cu, cu),
            calls,
            repetitions,
        )
        one_both, _ = one_device(w, implementation, calls, repetitions, devices=devices)
        shares = causal_work_per_device(np.asarray(cu), devices, balanced, capacity=total)
        shares = shares / shares.sum()
        rows = total // (2 * devices if balanced else devices)
        plan = cp.Plan(
            token_axis="cp",
            devices=devices,
            load_balance=balanced,
            max_seqlen=min(w.max_seqlen, total),
            is_causal=w.causal,
            window_left=None,
            stats_axis=1,
        )
        attend = _attend(dict(is_causal=w.causal, implementation=implementation), total, w.num_seqs)
        for r in range(devices):
            ids = [r, 2 * devices - 1 - r] if balanced else [r]
            args = _device_args(q, k, v, ids, rows)
            fwd = _time(
                _device_step(plan, attend, cu, rows, ids, False).lower(*args).compile(), args, calls, repetitions
            )
            both = _time(
                _device_step(plan, attend, cu, rows, ids, True).lower(*args).compile(), args, calls, repetitions
            )
            print(
                f"| {name} | {devices} | {order} | {r} | {fwd * 1e3:.2f} ({shares[r] * one_fwd * 1e3:.2f}) | "
                f"{(both - fwd) * 1e3:.2f} ({shares[r] * (one_both - one_fwd) * 1e3:.2f}) |",
                flush=True,
            )


ORDERS = ("natural", "balanced", "packer+balanced")


def simulate(names, implementation, calls, repetitions, device_counts=(2, 4, 8), orders=ORDERS) -> None:
    """The one-GPU CP benchmark: per device count and order, the slowest device's local call against
    one GPU's whole call, the spread between devices, and each device's time against its share of the causal
    work times one GPU's time ("waste": 1.00 = no more than its share)."""
    print(
        "| workload | n | order | one GPU ms | per-device ms | slowest / one GPU | target | spread | "
        "work shares | time / (share x one GPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    targets = {2: 0.53, 4: 0.28, 8: 0.15}
    for name in names:
        w = CP_WORKLOADS[name]
        print(f"<!-- {w.summary()} -->", file=sys.stderr)
        for n in device_counts:
            base, _ = one_device(w, implementation, calls, repetitions, devices=n)
            total = _padded_tokens(w, n)
            packed = packer_ordered(w, n)
            for label, workload, balanced in (
                ("natural", w, False),
                ("balanced", w, True),
                ("packer+balanced", packed, True),
            ):
                if label not in orders:
                    continue
                each = per_device_seconds(workload, implementation, balanced, calls, repetitions, devices=n)
                cu = workload.cu_seqlens()
                shares = causal_work_per_device(np.asarray(cu), n, balanced, capacity=total)
                shares = shares / shares.sum()
                waste = [t / (sh * base) for t, sh in zip(each, shares)]
                ratio = max(each) / base
                print(
                    f"| {name} | {n} | {label} | {base * 1e3:.2f} | "
                    f"{' / '.join(f'{t * 1e3:.2f}' for t in each)} | {ratio:.3f} | "
                    f"{'met' if ratio <= targets.get(n, 1) else 'missed'} (<= {targets.get(n, 1)}) | "
                    f"{(max(each) / min(each) - 1) * 100:.1f} % | {' / '.join(f'{x:.2f}' for x in shares)} | "
                    f"{' / '.join(f'{x:.2f}' for x in waste)} |",
                    flush=True,
                )


def _mib(n):
    return "-" if n is None else f"{n / 2**20:,.0f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="CP-a,W1", help=f"comma-separated, of {sorted(CP_WORKLOADS)}")
    parser.add_argument("--implementation", default=None, choices=(None, "cudnn", "fa3", "xla"))
    parser.add_argument("--orders", default=",".join(ORDERS), help=f"with --simulate: comma-separated, of {ORDERS}")
    parser.add_argument("--calls", type=int, default=5, help="steps per timed loop")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument(
        "--simulate",
        default=None,
        metavar="N,N,...",
        help="one GPU: time each of n devices' local calls for these n (e.g. 2,4,8) instead",
    )
    parser.add_argument(
        "--breakdown",
        default=None,
        metavar="N",
        help="one GPU: timed parts (forward, backward) of each of N devices' calls instead",
    )
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in CP_WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(CP_WORKLOADS)}")
    orders = [o for o in args.orders.split(",") if o not in ORDERS]
    if orders:
        parser.error(f"unknown orders {orders}; choose from {list(ORDERS)}")
    if args.breakdown:
        breakdown(names, args.implementation, args.calls, args.repetitions, int(args.breakdown))
        return 0
    if args.simulate:
        simulate(
            names,
            args.implementation,
            args.calls,
            args.repetitions,
            tuple(int(n) for n in args.simulate.split(",")),
            tuple(args.orders.split(",")),
        )
        return 0
    skip = (
        None
        if len(jax.devices()) >= DEVICES
        else (f"needs {DEVICES} devices, this host has {len(jax.devices())}: CP rows skipped")
    )
    print(
        "| workload | system | fwd+bwd ms/step | speedup vs 1 GPU | per-device attention ms | imbalance | "
        "memory per device MiB |"
    )
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
            print(
                f"| {name} | {system} | {seconds * 1e3:.2f} | {base / seconds:.2f}x | "
                f"{' / '.join(f'{s * 1e3:.2f}' for s in each)} | {imbalance * 100:.1f} % | {_mib(footprint)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
