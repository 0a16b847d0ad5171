"""Where implementation="fa3" spends time over its provider's own call (--implementation fa3: flash-attn3-jax's
flash_mha_varlen; dew: dew-flash-attn's).

    python -m benchmarks.wrapper_overhead [--workloads W5,W1] [--implementation fa3|dew]
                                          [--inputs arguments|computed] [--calls 20] [--loops 7]

benchmarks/peers.py measured (H100, 2026-12-06) W5's forward with jit-argument inputs at 0.80 ms through
implementation="fa3" against 0.61 ms for the flash-attn3-jax wheel's own call, while with inputs made in the jit
the two were 2 % apart. This probe times the wrapper with its parts switched off one at a time, which makes
the results wrong on padded batches (a probe, never a fix): the input clearing (fa3/ragged.py `_cleared`), then
also the output row masking (`_owned_query_rows`); for "dew", the gap sequences (dew.with_gaps's offsets,
[2B + 1] without seqused, replaced by the plain ones: right on these workloads, every slot used and within
max_seqlen). The first figures of 2026-12-06 (seventh session) timed "dew" against flash-attn3-jax's call;
docs/PERFORMANCE.md quotes dew-flash-attn's own from benchmarks/peers.py beside them.
Each figure is benchmarks/timing.py's plain loop of jitted calls; the last lines list the compiled forward's
custom calls and fusions, so a copy XLA inserted shows up by name.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import jax
import jax.numpy as jnp

from benchmarks.capture import entry_launches
from benchmarks.fa3_compare import steps
from benchmarks.timing import median_loop_seconds
from jax_ragged_attn import ragged_attention
from jax_ragged_attn.testing import implementation_options, workloads


def _ours(w, implementation):
    def f(q, k, v, cu):
        return ragged_attention(q, k, v, cu, cu, max_seqlen_q=w.max_seqlen, max_seqlen_kv=w.max_seqlen,
                                is_causal=w.causal, **implementation_options(
                                    "dew-flash-attn" if implementation == "dew" else "flash-attn3-jax"))
    return f


def _wheel(w, implementation):
    if implementation == "dew":
        from benchmarks.peers import _dew

        return _dew(w)
    from flash_attn3_jax import flash_mha_varlen

    def f(q, k, v, cu):
        return flash_mha_varlen(q, k, v, cu, cu, max_seqlen_q=w.max_seqlen, max_seqlen_k=w.max_seqlen,
                                is_causal=w.causal)
    return f


@contextlib.contextmanager
def _without(*parts):
    from jax_ragged_attn.backends.fa3 import ragged as fa3

    patches = []
    if "clearing" in parts:
        patches.append(mock.patch.object(fa3, "_cleared", lambda buffers, cu, used: tuple(buffers)))
    if "row masking" in parts:
        patches.append(mock.patch.object(fa3, "_owned_query_rows", lambda x, *args: x))
    if "gap sequences" in parts:  # dew: the plain offsets (right only where every slot is used and fits)
        from jax_ragged_attn.backends.fa3 import dew

        patches.append(mock.patch.object(dew, "with_gaps", lambda cu, used, side, paired=False: cu))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def _ops(fn, args) -> str:
    text = fn.lower(*args).compile().as_text()
    calls = sorted({line.split('custom_call_target="')[1].split('"')[0] for line in text.splitlines()
                    if 'custom_call_target="' in line})
    return f"custom calls {calls}; {len(entry_launches(text))} launching ops"


def _profile(args) -> int:
    """Per-kernel ms of one fwd+bwd step, the wheel's own call beside ours (cp_device_profile.kernel_ms)."""
    from benchmarks.cp_device_profile import kernel_ms

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; inputs: {args.inputs}", flush=True)
    for name in args.workloads.split(","):
        w = workloads.WORKLOADS[name]
        q, k, v, cu = w.packed_inputs()
        d_out = jax.random.normal(jax.random.key(1), q.shape, q.dtype)
        call = (q, k, v, cu, jnp.float32(1.0), d_out)
        wheel = kernel_ms(steps(_wheel(w, args.implementation), args.inputs)[1], call, args.calls)
        ours = kernel_ms(steps(_ours(w, args.implementation), args.inputs)[1], call, args.calls)
        print(f"\n{name}: wheel's call {sum(wheel[0].values()):.3f} ms of kernels ({wheel[1]:.3f} ms first to last), "
              f"ours {sum(ours[0].values()):.3f} ms ({ours[1]:.3f} ms)")
        for kernel in sorted(set(wheel[0]) | set(ours[0]), key=lambda n: -max(wheel[0].get(n, 0), ours[0].get(n, 0))):
            print(f"  {wheel[0].get(kernel, 0):8.4f} {ours[0].get(kernel, 0):8.4f}  {kernel}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wrapper_overhead")
    parser.add_argument("--workloads", default="W5,W1")
    parser.add_argument("--implementation", default="fa3")
    parser.add_argument("--inputs", default="arguments", choices=("arguments", "computed"),
                        help="q, k, v as jit arguments, or made in the jit (fa3_compare.steps)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--loops", type=int, default=7)
    parser.add_argument("--profile", action="store_true",
                        help="instead: GPU kernels by name, ms per fwd+bwd step, the wheel's call against ours "
                             "(jax.profiler; the difference's parts by name)")
    args = parser.parse_args(argv)
    if args.profile:
        return _profile(args)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; inputs: {args.inputs}", flush=True)
    lines = []
    for name in args.workloads.split(","):
        w = workloads.WORKLOADS[name]
        q, k, v, cu = w.packed_inputs()
        d_out = jax.random.normal(jax.random.key(1), q.shape, q.dtype)
        scale = jnp.float32(1.0)
        variants = [("wheel's own call", _wheel(w, args.implementation), ())] + [
            (f"ours {args.implementation}" + (f" without {' and '.join(p)}" if p else ""),
             _ours(w, args.implementation), p) for p in ((), ("clearing",), ("clearing", "row masking"))
            + ((("gap sequences",), ("clearing", "row masking", "gap sequences")) if args.implementation == "dew"
               else ())]
        for label, f, parts in variants:
            with _without(*parts):
                forward, both = steps(f, args.inputs)
                fwd = median_loop_seconds(forward, (q, k, v, cu, scale), args.calls, args.loops) * 1e3
                fb = median_loop_seconds(both, (q, k, v, cu, scale, d_out), args.calls, args.loops) * 1e3
                ops = _ops(forward, (q, k, v, cu, scale))
            lines.append(f"{name:<4} {label:<48} fwd {fwd:7.3f} ms  fwd+bwd {fb:7.3f} ms  | fwd: {ops}")
            print(lines[-1], flush=True)
    print("\n".join(["", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
