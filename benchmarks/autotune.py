"""Tunes the benchmark workloads' cuDNN graphs and prints what autotuning gains
(jax_ragged_attn/backends/cudnn/autotune.py).

    python -m benchmarks.autotune --workloads W1,W2,W3
"""

from __future__ import annotations

import argparse
import sys

from jax_ragged_attn.backends.cudnn.autotune import tune
from jax_ragged_attn.backends.shared import extension


def _report(names: str) -> int:
    import jax
    import jax.numpy as jnp

    from jax_ragged_attn.backends.cudnn import ragged as cudnn
    from jax_ragged_attn.config import AttentionOptions, make_config
    from jax_ragged_attn.testing import workloads

    reason = extension.cudnn_unavailable_reason()
    if reason is not None:
        print(f"autotuning needs the cuDNN path: {reason}")
        return 0
    print(f"{'workload':13} {'direction':9} {'plans':>5}  {'heuristic':>10}  {'tuned':>10}  {'gain':>6}  tuned plan")
    for w in workloads.select(names):
        t, b = w.total_tokens, w.num_seqs
        shape = lambda h: jax.ShapeDtypeStruct((t, h, w.head_dim), jnp.dtype(w.dtype))
        cu = jax.ShapeDtypeStruct((b + 1,), jnp.int32)
        config = make_config(
            shape(w.num_heads_q),
            shape(w.num_heads_kv),
            shape(w.num_heads_kv),
            cu,
            cu,
            AttentionOptions(is_causal=w.causal, diagonal_alignment="bottom_right"),
            max_seqlen_q=w.max_seqlen,
            max_seqlen_kv=w.max_seqlen,
        )
        for direction in ("forward", "backward"):
            # The graph that runs: for the backward, the intermediate layout strategy="fastest" picks.
            entry = tune(direction, cudnn.ffi_attributes(config, direction), cudnn.device_ordinal())
            ran = sum(p["ok"] for p in entry["plans"])
            gain = entry["heuristic_ms"] / entry["chosen_ms"]
            print(
                f"{w.name:13} {direction:9} {ran:>2}/{len(entry['plans']):<2}  {entry['heuristic_ms']:>8.3f}ms"
                f"  {entry['chosen_ms']:>8.3f}ms  {gain:>5.2f}x  {entry['plan_name']}",
                flush=True,
            )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.autotune", description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="W1,W2,W3", help="comma-separated workload names (bench's)")
    args = parser.parse_args(argv)
    return _report(args.workloads)


if __name__ == "__main__":
    sys.exit(main())
