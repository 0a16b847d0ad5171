"""The xla path's time and peak memory on W1 and W3 (the short-sequence shape), before and after a change.

    python -m benchmarks.xla_memory           # CPU-sized: W1 and W3 scaled down
    python -m benchmarks.xla_memory --full    # the real shapes (an H200)
    git show <commit>:jax_ragged_attn/backends/xla/ragged.py > /tmp/xla_before.py
    python -m benchmarks.xla_memory --before /tmp/xla_before.py

Every case runs in a child process of its own, so a peak is that case's alone and an implementation that
runs out of memory costs one row, not the run. Each case is compiled first: XLA's own accounting
(memory_analysis(): temp + output bytes) is reported, and a case whose accounting exceeds --budget (a
fraction of the device's memory) is not run. Columns:

    xla MiB       compiled temp + output bytes of the jitted call (forward, or value_and_grad of a loss)
    estimate MiB  xla_memory.estimate_bytes for the current implementation (the bound it is checked against)
    peak MiB      measured: the device allocator's peak (GPU) or the growth of the process's max RSS (CPU)
    ms            median wall time of --repeats calls after one warm-up

max_seqlen "exact" is the longest sequence, "capacity" is T, the "to be safe" value a caller who does not know
its lengths passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp

from benchmarks.timing import plain_loop_seconds
from jax_ragged_attn.backends.xla import memory as xla_memory
from jax_ragged_attn.backends.xla import ragged as current_xla
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.testing.workloads import WORKLOADS

DIRECTIONS = ("forward", "forward+backward")
# The repository root: each case's child runs `python -m benchmarks.xla_memory` from there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scaled_workloads(full: bool):
    """W1 and W3 as in workloads.py (--full), or cut down to run in seconds on a CPU: W1's lengths / 8 with
    4 heads of dim 64 (4,096 tokens), W3's first 64 sequences with 4 heads (8,800 tokens)."""
    w1, w3 = WORKLOADS["W1"], WORKLOADS["W3"]
    if full:
        return [w1, w3]
    return [
        dataclasses.replace(
            w1,
            name="W1/8",
            seqlens=tuple(max(n // 8, 1) for n in w1.seqlens),
            num_heads_q=4,
            num_heads_kv=4,
            head_dim=64,
        ),
        dataclasses.replace(w3, name="W3/8", seqlens=w3.seqlens[:64], num_heads_q=4, num_heads_kv=4),
    ]


def _load(path: str | None):
    if path is None:
        return current_xla
    spec = importlib.util.spec_from_file_location("xla_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _device_peak() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def run_case(case: dict) -> dict:
    """One (implementation, workload, max_seqlen, direction) in this process; returns the row's figures."""
    workload = next(w for w in scaled_workloads(case["full"]) if w.name == case["workload"])
    impl = _load(case["impl"])
    q, k, v, cu = workload.packed_inputs()
    max_seqlen = workload.max_seqlen if case["max_seqlen"] == "exact" else workload.total_tokens
    config = make_config(
        q, k, v, cu, cu, AttentionOptions(is_causal=workload.causal), max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen
    )
    # No bound inside the benchmark: it reports sizes instead (a case past --budget is not run).
    extra = {"memory_limit": "off"} if impl is current_xla else {}

    def forward(q, k, v):
        return impl.attention_xla(q, k, v, cu, cu, config, **extra)[0]

    weights = jax.random.normal(jax.random.key(1), q.shape[:2] + (v.shape[2],), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v).astype(jnp.float32) * weights)

    fn = forward if case["direction"] == "forward" else jax.value_and_grad(loss, argnums=(0, 1, 2))
    compiled = jax.jit(fn).lower(q, k, v).compile()
    analysis = compiled.memory_analysis()
    row = {"xla_bytes": analysis.temp_size_in_bytes + analysis.output_size_in_bytes}
    if impl is current_xla:
        block_q, block_kv = xla_memory.block_sizes(config)
        direction = "forward" if case["direction"] == "forward" else "backward"
        row["estimate_bytes"] = xla_memory.estimate_bytes(config, block_q, block_kv, direction)
    budget = case["budget"] * xla_memory.device_memory_bytes()
    if row["xla_bytes"] > budget:
        return {**row, "status": f"not run: XLA sizes it past the budget of {budget / 2**30:.1f} GiB"}

    jax.block_until_ready((q, k, v, weights))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    in_use_before = (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use")
    jax.block_until_ready(compiled(q, k, v))
    times = plain_loop_seconds(lambda: compiled(q, k, v), 1, case["repeats"])  # each call blocked
    peak = _device_peak()
    if peak is not None and in_use_before is not None:
        row["peak_bytes"] = peak - in_use_before
    else:
        row["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    return {**row, "status": "ok", "ms": 1e3 * statistics.median(times)}


def _child(case: dict) -> dict:
    command = [sys.executable, "-m", "benchmarks.xla_memory", "--case", json.dumps(case)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
    killed = " (killed: out of memory?)" if result.returncode in (-9, 137) else ""
    return {"status": f"failed, exit {result.returncode}{killed}: {tail[:160]}"}


def _mib(row: dict, key: str) -> str:
    return f"{row[key] / 2**20:,.1f}" if key in row else "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the real W1 and W3 shapes (for a GPU)")
    parser.add_argument("--before", metavar="PATH", help="an older xla.py to run beside the current one")
    parser.add_argument("--max-seqlen", default="exact,capacity", help="exact, capacity or both (default)")
    parser.add_argument("--workloads", help="comma-separated names of the workloads to run (default: both)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.25, help="fraction of the device's memory a case may take")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child's one case, as JSON
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0

    chosen = scaled_workloads(args.full)
    if args.workloads:
        names = args.workloads.split(",")
        unknown = sorted(set(names) - {w.name for w in chosen})
        if unknown:
            parser.error(f"unknown workloads {unknown}: choose from {[w.name for w in chosen]}")
        chosen = [w for w in chosen if w.name in names]
    impls = [("after", None)] + ([("before", args.before)] if args.before else [])
    print(
        f"xla path on {jax.devices()[0].device_kind} ({jax.default_backend()}); budget {args.budget:.0%} of "
        f"{xla_memory.device_memory_bytes() / 2**30:.0f} GiB"
    )
    print("| workload | max_seqlen | direction | impl | xla MiB | estimate MiB | peak MiB | ms | status |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for workload in chosen:
        for max_seqlen in args.max_seqlen.split(","):
            for direction in DIRECTIONS:
                for name, path in impls:
                    case = dict(
                        impl=path,
                        workload=workload.name,
                        full=args.full,
                        max_seqlen=max_seqlen,
                        direction=direction,
                        repeats=args.repeats,
                        budget=args.budget,
                    )
                    row = _child(case)
                    ms = f"{row['ms']:,.1f}" if "ms" in row else "-"
                    print(
                        f"| {workload.name} ({workload.total_tokens:,} tok) | {max_seqlen} | {direction} | {name} | "
                        f"{_mib(row, 'xla_bytes')} | {_mib(row, 'estimate_bytes')} | {_mib(row, 'peak_bytes')} | "
                        f"{ms} | {row['status']} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
