"""What one launch costs a plain loop of jitted calls: tiny programs whose every kernel does almost nothing.

    python -m benchmarks.launch_cost [--calls 500] [--rounds 9] [--trace]

Why: at 8 x 2k decode (issue 48) the op's call is FA3's kernel plus one launch of the KV-cache index clamp,
and a plain loop there waits on the host, not on the GPU, so the clamp's price is what the host spends to
launch it. The contiguous cache's clamp is an XLA fusion, the paged cache's our FFI handler (ffi/cache_index.cc),
and in benchmarks/decode_few.py the paged call took 2.3 us more than the contiguous one (H100, 2026-12-07) where
raw FA3 took the same on both. Each row here is one jitted
program on int32 [8] lengths and an int32 [8, 8] table, timed in the same rounds (interleaved_loop_seconds),
so the difference between two rows is the difference between their launches:

    no kernel          returns nothing: a jitted call's own price (returning an input would launch a copy)
    XLA: 1 fusion      the lengths clamped (the contiguous cache's clamp)
    XLA: 2 fusions     the lengths clamped and the table's entries selected (both as jnp: the reference)
    FFI clamp          both by our handler, one launch (backends/shared/cache_index.py)

--trace also records a few calls of each with jax.profiler and prints the host-side events per call by name
(the CUDA API calls and XLA's thunks), where a difference in the launch path shows up.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.backends.shared import cache_index
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.ops.kvcache import kvcache_config
from jax_ragged_attn.tools.bench import interleaved_loop_seconds

from benchmarks.capture import entry_launches

BATCH, PAGES, PAGE_SIZE, NUM_PAGES = 8, 8, 256, 64


def _config():
    """The paged decode call's configuration (GQA 32/8, d 128): what the clamp is given at 8 x 2k."""
    q = jax.ShapeDtypeStruct((BATCH, 1, 32, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((NUM_PAGES, PAGE_SIZE, 8, 128), jnp.bfloat16)
    return kvcache_config(q, cache, cache, jax.ShapeDtypeStruct((BATCH,), jnp.int32),
                          jax.ShapeDtypeStruct((BATCH, PAGES), jnp.int32), AttentionOptions(is_causal=True))


def rows() -> dict:
    """{label: function of (lengths, table)}."""
    config = _config()
    return {
        "no kernel": lambda n, t: (),
        "XLA: 1 fusion": lambda n, t: jnp.clip(n, 0, config.capacity),
        "XLA: 2 fusions": lambda n, t: cache_index.reference(n, t, config),
        "FFI clamp": lambda n, t: cache_index.safe_cache_index(n, t, config),
    }


def inputs():
    rng = np.random.default_rng(0)
    lengths = jnp.asarray(rng.integers(1, PAGES * PAGE_SIZE, BATCH), jnp.int32)
    table = jnp.asarray(rng.integers(-2, NUM_PAGES + 2, (BATCH, PAGES)), jnp.int32)
    return lengths, table


def host_events(fn, args, calls: int) -> dict[str, tuple[float, float]]:
    """{host-side event name: (us per call, count per call)} from a jax.profiler trace of `calls` calls."""
    from benchmarks.cp_device_profile import profiler_events

    events = profiler_events(fn, args, calls)
    host_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                 and "host" in str(e.get("args", {}).get("name", "")).lower()}
    totals, counts = collections.defaultdict(float), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in host_pids and "dur" in e:
            name = re.sub(r"\s+", " ", str(e["name"]))[:60]
            totals[name] += e["dur"] / calls
            counts[name] += 1
    return {name: (totals[name], counts[name] / calls) for name in totals}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="jitted calls a timed loop")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds, median reported")
    parser.add_argument("--trace", action="store_true", help="also the host-side events per call (jax.profiler)")
    args = parser.parse_args(argv)
    data = inputs()
    jitted = {label: jax.jit(fn) for label, fn in rows().items()}
    launches = {label: entry_launches(fn.lower(*data).compile().as_text()) for label, fn in jitted.items()}
    times = interleaved_loop_seconds(
        {label: ((lambda fn=fn: fn(*data)), args.calls) for label, fn in jitted.items()}, args.rounds)
    base = statistics.median(times["no kernel"])
    print(f"# {jax.devices()[0].device_kind}; {args.calls} calls a loop, median of {args.rounds} interleaved rounds")
    print("| row | us per call | over no kernel | launches |")
    print("| --- | --- | --- | --- |")
    for label, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {label} | {median * 1e6:.2f} | {(median - base) * 1e6:+.2f} | {len(launches[label])} |")
    if args.trace:
        for label, fn in jitted.items():
            events = sorted(host_events(fn, data, 50).items(), key=lambda item: -item[1][0])
            print(f"# {label}: host events per call (us, count)")
            for name, (us, count) in [e for e in events if e[1][1] >= 0.5][:12]:  # once-a-trace events left out
                print(f"#   {us:8.2f}  {count:4.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
