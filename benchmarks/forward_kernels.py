"""The kernels of one cached forward of the op on the GPU, by name and time, beside the call's wall time.

    python -m benchmarks.forward_kernels [--workloads W3,W5,W1] [--implementation cudnn] [--steps 20]

A measurement aid (issue 33, item 3: the cuDNN path's forward against raw cuDNN). It records `steps` jitted
forward calls with jax.profiler (benchmarks/cp_device_profile.py's kernel_ms) and prints each kernel's ms per
call, so the fixed per-call kernels around cuDNN's own (index arithmetic, row zeroing, masks) show with their cost.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.testing.workloads import WORKLOADS

from benchmarks.cp_device_profile import kernel_ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W3,W5,W1")
    parser.add_argument("--implementation", default="cudnn")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        q, k, v, cu = w.packed_inputs()
        f = jax.jit(functools.partial(ragged_attention, max_seqlen_q=w.max_seqlen, max_seqlen_kv=w.max_seqlen,
                                      is_causal=w.causal, implementation=args.implementation))
        kernels, wall = kernel_ms(f, (q, k, v, cu, cu), args.steps)
        print(f"\n{name} ({w.summary()}), forward: {sum(kernels.values()):.3f} ms of kernels, {wall:.3f} ms from the "
              f"first kernel to the last, per call; {len(kernels)} kernel names")
        for kernel, ms in sorted(kernels.items(), key=lambda item: -item[1]):
            print(f"  {ms * 1e3:9.1f} us  {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
