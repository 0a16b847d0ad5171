"""`python -m jax_ragged_attn.bench`: your own shapes timed on each implementation, forward and forward+backward.

    python -m jax_ragged_attn.bench --lengths 512,1024,4000 --heads 16 --kv-heads 4 --head-dim 128
    python -m jax_ragged_attn.bench --workload W1          # a named shape (jax_ragged_attn/testing/workloads.py)
    python -m jax_ragged_attn.bench --lengths 1,1,1 --kv-lengths 8192,3000,500 --no-causal   # decode-like

Each implementation (implementation="fa3", "cudnn", "xla") is timed as a training loop meets it: a plain Python
loop of --calls jitted calls, then one block_until_ready; the median of --repeats such loops, per call, after a
compiling call. TFLOP/s counts useful work over real tokens (4 * Sq * Skv * H * D per sequence, halved when
causal; backward 2.5 forwards). An implementation that cannot serve the call prints "skipped: <reason>".
The benchmarks against raw cuDNN, FlashAttention-3's own API and padded attention live in the repository's
benchmarks/ (benchmarks/README.md), outside the package.

The timing helpers here (plain_loop_seconds, the library's one timing loop, and the others below) are the ones
the main job and the repository's benchmarks time with.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

# The library's one timing loop, which autotune=True's choice uses too (the library may not import a tool).
from jax_ragged_attn.backends.tuning import median_loop_seconds, plain_loop_seconds

__all__ = ["device_bytes", "interleaved_loop_seconds", "main", "median_loop_seconds", "plain_loop_seconds"]


def interleaved_loop_seconds(entries: dict, repetitions: int) -> dict:
    """{key: [seconds per call of each timed loop]} for entries {key: (call, calls per loop)}: one plain loop of
    every entry per round, `repetitions` rounds. A load that changes during the run (a shared machine) then
    shifts every entry alike, instead of whichever happened to be timed then."""
    times = {key: [] for key in entries}
    for _ in range(repetitions):
        for key, (call, calls) in entries.items():
            times[key] += plain_loop_seconds(call, calls, 1)
    return times


def device_bytes(compiled) -> int | None:
    """Arguments + outputs + temporaries of a compiled executable (its peak device footprint)."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it; callers print "-"
        return None


def _lengths(text: str, flag: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not lengths or min(lengths) < 0:
        raise SystemExit(f"{flag} needs at least one length, none negative, got {text!r}")
    return lengths


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jax_ragged_attn.bench",
        description=__doc__.split("\n\nThe ")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--lengths", help="comma-separated sequence lengths (default: W1 on a GPU, tiny elsewhere)")
    parser.add_argument("--kv-lengths", help="the keys' lengths, one per sequence (default: --lengths)")
    parser.add_argument("--workload", help="a named shape instead of --lengths: W1, W2, W3, W5, W6, tiny, ...")
    parser.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--implementations", default=None, help="comma-separated, in the order timed (default: every registered one)"
    )
    parser.add_argument("--calls", type=int, default=10, help="jitted calls per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops; the median is reported")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        parser.error(f"--calls and --repeats must be >= 1, got {args.calls} and {args.repeats}")
    return args


def shape_of(args: argparse.Namespace) -> dict:
    """The batch to time: lengths of queries and keys, heads, head dim, dtype, causal."""
    from jax_ragged_attn.testing.workloads import WORKLOADS

    if args.workload and args.lengths:
        raise SystemExit("give --workload or --lengths, not both")
    name = args.workload or (None if args.lengths else "W1" if jax.default_backend() == "gpu" else "tiny")
    if name is not None:
        if name not in WORKLOADS:
            raise SystemExit(f"--workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
        w = WORKLOADS[name]
        return dict(
            name=name,
            q=w.seqlens,
            kv=w.seqlens,
            heads=w.num_heads_q,
            kv_heads=w.num_heads_kv,
            head_dim=w.head_dim,
            dtype=w.dtype,
            causal=w.causal,
        )
    q = _lengths(args.lengths, "--lengths")
    kv = _lengths(args.kv_lengths, "--kv-lengths") if args.kv_lengths else q
    if len(kv) != len(q):
        raise SystemExit(f"--kv-lengths needs one length per sequence: {len(q)}, got {len(kv)}")
    return dict(
        name="your shape",
        q=q,
        kv=kv,
        heads=args.heads,
        kv_heads=args.kv_heads or args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        causal=args.causal,
    )


def forward_flops(shape: dict) -> float:
    """Useful forward FLOPs: 4 * Sq * Skv * H * D per sequence (q.k and p.v), halved when causal."""
    flops = sum(4.0 * sq * skv * shape["heads"] * shape["head_dim"] for sq, skv in zip(shape["q"], shape["kv"]))
    return flops / 2 if shape["causal"] else flops


def _inputs(shape: dict):
    dtype = jnp.dtype(shape["dtype"])
    tq, tkv, d = sum(shape["q"]), sum(shape["kv"]), shape["head_dim"]
    kq, kk, kv, ko = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (max(tq, 1), shape["heads"], d), dtype)
    k = jax.random.normal(kk, (max(tkv, 1), shape["kv_heads"], d), dtype)
    v = jax.random.normal(kv, (max(tkv, 1), shape["kv_heads"], d), dtype)
    cu_q, cu_kv = (jnp.asarray(np.concatenate([[0], np.cumsum(n)]), jnp.int32) for n in (shape["q"], shape["kv"]))
    return (q, k, v, cu_q, cu_kv), jax.random.normal(ko, q.shape, dtype)


def time_implementation(implementation: str, shape: dict, calls: int, repeats: int) -> dict[str, float | str]:
    """{"forward": s, "forward+backward": s} per call, or the reason it was skipped or failed, per direction."""
    from jax_ragged_attn.ops.ragged import ragged_attention

    args, d_out = _inputs(shape)

    def attend(q, k, v, cu_q, cu_kv):
        return ragged_attention(
            q,
            k,
            v,
            cu_q,
            cu_kv,
            max_seqlen_q=max(max(shape["q"]), 1),
            max_seqlen_kv=max(max(shape["kv"]), 1),
            is_causal=shape["causal"],
            implementation=implementation,
        )

    def forward_backward(q, k, v, cu_q, cu_kv, d_out):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, cu_q, cu_kv), q, k, v)
        return out, pullback(d_out)

    results = {}
    for direction, function, arguments in (
        ("forward", attend, args),
        ("forward+backward", forward_backward, (*args, d_out)),
    ):
        try:
            results[direction] = median_loop_seconds(jax.jit(function), arguments, calls, repeats)
        except NotImplementedError as error:  # this implementation cannot serve the call here: the reason
            results[direction] = f"skipped: {str(error).split('cannot serve this call: ', 1)[-1]}"
        except Exception as error:  # noqa: BLE001 - one failing implementation must not hide the others
            results[direction] = f"error: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
    return results


def _cell(result, flops: float) -> str:
    if isinstance(result, str):
        return result
    return f"{result * 1e3:10.3f} ms {flops / result / 1e12:8.3g} TFLOP/s"


def main(argv=None) -> int:
    from jax_ragged_attn.backends import REGISTRY

    args = parse_args(argv)
    shape = shape_of(args)
    names = [n.strip() for n in (args.implementations or ",".join(REGISTRY)).split(",") if n.strip()]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise SystemExit(f"--implementations: unknown {unknown}, choose from {', '.join(REGISTRY)}")
    q, kv = shape["q"], shape["kv"]
    kv_text = "" if kv == q else f", keys {min(kv)}..{max(kv)} ({sum(kv):,} tokens)"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(
        f"{shape['name']}: {len(q)} sequences of {min(q)}..{max(q)} ({sum(q):,} tokens){kv_text}, "
        f"{shape['heads']}/{shape['kv_heads']} heads, head dim {shape['head_dim']}, {shape['dtype']}, "
        f"{'causal' if shape['causal'] else 'non-causal'}"
    )
    print(f"plain loop of {args.calls} jitted calls then block_until_ready; median of {args.repeats} loops, per call")
    flops = forward_flops(shape)
    print(f"{'implementation':15} {'forward':>31}   {'forward+backward':>31}")
    for name in names:
        result = time_implementation(name, shape, args.calls, args.repeats)
        forward, both = result["forward"], result["forward+backward"]
        if isinstance(forward, str) and forward == both:  # one reason for both directions: say it once
            print(f"{name:15} {forward}", flush=True)
        else:
            print(f"{name:15} {_cell(forward, flops):>31}   {_cell(both, 3.5 * flops):>31}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
