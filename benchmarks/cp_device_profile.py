"""Where a context-parallel device's time goes: GPU kernels of one device's fwd+bwd against one GPU's, per kernel.

    python -m benchmarks.cp_device_profile [--workload CP-c] [--devices 8] [--implementation fa3] [--ranks 0,7]

A measurement aid (issue 33, CP-c). It builds exactly what benchmarks/context_parallel.py times (the packer's
order, the dual-chunk order, each device's chunk calls on one GPU), records a few steps of each with
jax.profiler, and sums the GPU kernels by name: ms per step on one GPU, that times the device's causal work
share, and ms per step on the device. A kernel whose device time is far above its share is where the
per-device excess lives.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.parallel import context_parallel as cp
from jax_ragged_attn.parallel.load_balance import causal_work_per_device

from benchmarks import context_parallel as bench


def profiler_events(fn, args, steps: int) -> list[dict]:
    """The events (perfetto JSON) of a jax.profiler trace of `steps` calls of fn(*args), after one untimed call."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(steps):
                result = fn(*args)
            jax.block_until_ready(result)
        path = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def kernel_ms(fn, args, steps: int) -> tuple[dict[str, float], float]:
    """{kernel name: ms per step}, summed over the GPU streams of a jax.profiler trace of `steps` calls, and
    the wall ms per step between the first and last kernel."""
    events = profiler_events(fn, args, steps)
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and re.search(r"GPU|gpu|device:", str(e.get("args", {}).get("name", "")))
                and "host" not in str(e.get("args", {}).get("name", "")).lower()}
    # A GPU's process also holds "XLA Modules" / "XLA Ops" lines that span the kernels: streams only.
    streams = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e.get("pid") in gpu_pids and "stream" in str(e.get("args", {}).get("name", "")).lower()}
    if not streams:
        names = sorted({str(e.get("args", {}).get("name")) for e in events if e.get("ph") == "M"})
        raise SystemExit(f"no GPU stream in the trace; its processes and threads: {names[:40]}")
    totals = collections.defaultdict(float)
    first, last = float("inf"), 0.0
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams and "dur" in e:
            name = re.sub(r"\s+", " ", str(e["name"]))[:70]
            totals[name] += e["dur"] / 1e3 / steps
            first, last = min(first, e["ts"]), max(last, e["ts"] + e["dur"])
    return dict(totals), (last - first) / 1e3 / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="CP-c")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--implementation", default=None)
    parser.add_argument("--ranks", default="0")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args(argv)
    n = args.devices
    w = bench.packer_ordered(bench.CP_WORKLOADS[args.workload], n)
    q, k, v, cu = bench._inputs(w, n)
    total = q.shape[0]
    d_out = jnp.ones_like(q)
    one = jax.jit(bench._step(lambda q, k, v, a, b: bench.ragged_attention(
        q, k, v, a, b, **bench._options(w, args.implementation))))
    base, base_wall = kernel_ms(one, (q, k, v, cu, d_out), args.steps)
    shares = causal_work_per_device(np.asarray(cu), n, True, capacity=total)
    shares = shares / shares.sum()
    rows = total // (2 * n)
    plan = cp.Plan(token_axis="cp", devices=n, load_balance=True, max_seqlen=min(w.max_seqlen, total),
                   is_causal=w.causal, window_left=None, stats_axis=1)
    attend = bench._attend(dict(is_causal=w.causal, implementation=args.implementation), total, w.num_seqs)
    print(f"{w.name}, n = {n}, packer + balanced, implementation {args.implementation}: one GPU "
          f"{sum(base.values()):.3f} ms of kernels, {base_wall:.3f} ms wall per step")
    for r in (int(x) for x in args.ranks.split(",")):
        ids = [r, 2 * n - 1 - r]
        step_args = bench._device_args(q, k, v, ids, rows)
        device, wall = kernel_ms(bench._device_step(plan, attend, cu, rows, ids, True), step_args, args.steps)
        share = shares[r]
        print(f"\ndevice {r}: share {share:.3f}; kernels {sum(device.values()):.3f} ms (share x one GPU "
              f"{share * sum(base.values()):.3f}), wall {wall:.3f} ms (share x one GPU {share * base_wall:.3f})")
        print(f"| kernel | one GPU ms | x share | device ms | device / share |")
        print("|---|---|---|---|---|")
        names = sorted(set(base) | set(device), key=lambda x: -max(device.get(x, 0), share * base.get(x, 0)))
        for name in names[:args.top]:
            b, d = base.get(name, 0.0), device.get(name, 0.0)
            ratio = f"{d / (share * b):.2f}" if b else "-"
            print(f"| {name} | {b:.3f} | {share * b:.3f} | {d:.3f} | {ratio} |")
        rest_b = sum(base.get(x, 0) for x in names[args.top:])
        rest_d = sum(device.get(x, 0) for x in names[args.top:])
        print(f"| (the other {max(len(names) - args.top, 0)}) | {rest_b:.3f} | {share * rest_b:.3f} | {rest_d:.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
