"""FlashAttention-3 next to this op on the GPU: a check of how _fa3.py reads the wheel, then a timing table.

    python -m benchmarks.fa3_compare [--probe-only] [--workloads W1,W2]

Probe: small ragged batches (GQA, an empty sequence, capacity padding, rows cut by max_seqlen, seqused)
through implementation="fa3" (its flat log-sum-exp buffer and max_seqlen grids), against implementation="xla"
in float32: out, both stats layouts, and the gradients of a loss of out and stats.

Timing: for each workload, forward and forward+backward of ragged_attention(implementation="cudnn"),
ragged_attention(implementation="fa3") and the wheel's own flash_mha_varlen: a plain Python loop of 20
jitted calls, then block_until_ready; the median of 7 such loops, per call.

--inputs computed: q, k and v are made inside the jitted function (each jit argument times a traced scalar), as
in a model where they come out of a projection, instead of being the jit's arguments (and so is the
output's cotangent, as a loss's backward makes it). Every system pays the
same elementwise prologue; the difference to raw FA3 (the table's last column) is then what this op adds when
its inputs are intermediates: the padding clearing zeroes rows in place there, where a jit argument must first
be copied by XLA (backends/shared/row_zeroing.py).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_loop_seconds
from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.testing import workloads as workloads_module

CALLS, LOOPS = 20, 7


def _probe_batch(seed=0):
    rng = np.random.default_rng(seed)
    lengths_q, lengths_kv = np.array([100, 0, 200, 37, 130]), np.array([130, 50, 200, 0, 90])
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(lengths_kv)]).astype(np.int32)
    tq, tkv = int(cu_q[-1]) + 29, int(cu_kv[-1]) + 11
    # bfloat16 values held in float32: the float32 reference sees exactly what FA3 sees.
    q, k, v = (
        np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16), np.float32)
        for shape in ((tq, 8, 128), (tkv, 2, 128), (tkv, 2, 128))
    )
    d_out = rng.standard_normal((tq, 8, 128)).astype(np.float32)
    d_stats = rng.standard_normal((tq, 8)).astype(np.float32)
    return q, k, v, cu_q, cu_kv, d_out, d_stats


def _run(implementation, dtype, args, options):
    q, k, v, cu_q, cu_kv, d_out, d_stats = args

    def loss(q, k, v):
        out, stats = ragged_attention(
            q,
            k,
            v,
            cu_q,
            cu_kv,
            return_stats=True,
            stats_layout="token_major",
            implementation=implementation,
            **options,
        )
        finite = jnp.isfinite(stats)
        return (
            jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(jnp.where(finite, stats * d_stats, 0.0)),
            (out, stats),
        )

    cast = [jnp.asarray(x, dtype) for x in (q, k, v)]
    (_, (out, stats)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*cast)
    return [np.asarray(x, np.float64) for x in (out, stats, *grads)]


def probe() -> bool:
    args = _probe_batch()
    cases = {
        "causal bottom-right": dict(
            max_seqlen_q=200, max_seqlen_kv=200, is_causal=True, diagonal_alignment="bottom_right"
        ),
        "window (16, 8) bottom-right, cut at 150/120": dict(
            max_seqlen_q=150, max_seqlen_kv=120, local_window_size=(16, 8), diagonal_alignment="bottom_right"
        ),
        "no mask": dict(max_seqlen_q=200, max_seqlen_kv=200),
        "causal bottom-right, seqused": dict(
            max_seqlen_q=200,
            max_seqlen_kv=200,
            is_causal=True,
            diagonal_alignment="bottom_right",
            seqused_q=np.array([90, 0, 200, 10, 5], np.int32),
            seqused_kv=np.array([100, 3, 150, 0, 90], np.int32),
        ),
    }
    ok = True
    names = ("out", "stats", "dq", "dk", "dv")
    for case, options in cases.items():
        want = _run("xla", jnp.float32, args, options)
        scale = [max(np.abs(np.nan_to_num(w, neginf=0)).max(), 1e-6) for w in want]
        try:
            got = _run("fa3", jnp.bfloat16, args, options)
        except Exception as error:  # noqa: BLE001 - report and go on
            print(f"probe {case}: error {type(error).__name__}: {str(error)[:300]}")
            ok = False
            continue
        errors = []
        for name, g, w, s in zip(names, got, want, scale):
            same_inf = np.array_equal(np.isneginf(g), np.isneginf(w))
            err = np.abs(np.where(np.isfinite(w), g - w, 0)).max() / s if same_inf else np.inf
            errors.append(f"{name} {err:.1e}" + ("" if np.isfinite(g[np.isfinite(w)]).all() else " NaN!"))
            ok &= bool(err < 3e-2)
        print(f"probe {case}: relative max error " + ", ".join(errors), flush=True)
    return ok


def _time(fn, *args) -> float:
    jax.block_until_ready(fn(*args))  # compile; median_loop_seconds warms up once more
    return median_loop_seconds(fn, args, CALLS, LOOPS)


def _systems(workload):
    options = dict(is_causal=workload.causal)

    def ours(implementation, **extra):
        def f(q, k, v, cu):
            return ragged_attention(
                q,
                k,
                v,
                cu,
                cu,
                max_seqlen_q=workload.max_seqlen,
                max_seqlen_kv=workload.max_seqlen,
                implementation=implementation,
                **options,
                **extra,
            )

        return f

    def raw(q, k, v, cu):
        from flash_attn3_jax import flash_mha_varlen

        return flash_mha_varlen(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen_q=workload.max_seqlen,
            max_seqlen_k=workload.max_seqlen,
            is_causal=workload.causal,
        )

    # "ours default": implementation=None, as a user meets it (the shipped policy, backends/policy.py);
    # "ours autotune": implementation=None with autotune=True, which times cuDNN against FA3 once (at trace) and
    # runs the faster (backends/tuning.py).
    return {
        "ours default": ours(None),
        "ours cuDNN": ours("cudnn"),
        "ours fa3": ours("fa3"),
        "ours autotune": ours(None, autotune=True),
        "flash-attn3-jax": raw,
    }


def steps(f, inputs: str = "arguments"):
    """Jitted (forward(q, k, v, cu, s), forward + backward(q, k, v, cu, s, d_out)) of f(q, k, v, cu). With
    inputs="computed" q, k, v and d_out enter as x * s (intermediates, as a projection's output and a loss's
    backward make them); with "arguments" they reach f as they are and s is unused."""

    def made(x, s):
        return x * s.astype(x.dtype) if inputs == "computed" else x

    def forward(q, k, v, cu, s):
        return f(*(made(x, s) for x in (q, k, v)), cu)

    def both(q, k, v, cu, s, d_out):
        return jax.vjp(lambda q, k, v: forward(q, k, v, cu, s), q, k, v)[1](made(d_out, s))

    return jax.jit(forward), jax.jit(both)


def timing(names, inputs: str = "arguments") -> list[str]:
    lines = [
        f"{'workload':<10} {'system':<34} {'fwd ms':>8} {'fwd+bwd ms':>11} {'bwd ms':>8} {'fwd+bwd / FA3':>14} "
        f"{'- FA3 ms':>9}"
    ]
    for name in names:
        workload = workloads_module.WORKLOADS[name]
        q, k, v, cu = workload.packed_inputs()
        d_out = jax.random.normal(jax.random.key(1), q.shape, q.dtype)
        scale = jnp.float32(1.0)  # traced, so XLA cannot fold x * scale away (inputs="computed")
        results = {}
        for system, f in _systems(workload).items():
            try:
                forward, both = steps(f, inputs)
                results[system] = (_time(forward, q, k, v, cu, scale), _time(both, q, k, v, cu, scale, d_out))
            except Exception as error:  # noqa: BLE001
                lines.append(f"{name:<10} {system:<34} error {type(error).__name__}: {str(error)[:200]}")
        base = results.get("flash-attn3-jax", (None, None))[1]
        for system, (fwd, both) in results.items():
            ratio = f"{both / base:.3f}" if base else "-"
            extra = f"{(both - base) * 1e3:+9.3f}" if base else f"{'-':>9}"
            lines.append(
                f"{name:<10} {system:<34} {fwd * 1e3:8.3f} {both * 1e3:11.3f} {(both - fwd) * 1e3:8.3f} "
                f"{ratio:>14} {extra}"
            )
        print("\n".join(lines[-len(results) :]), flush=True)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe-only", action="store_true")
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument(
        "--inputs",
        choices=("arguments", "computed"),
        default="arguments",
        help="q, k, v as the jit's arguments, or made inside it (see the module docstring)",
    )
    args = parser.parse_args(argv)
    reason = _fa3.unavailable_reason()
    print(f"jax {jax.__version__}, devices {jax.devices()}; FA3: {reason or 'available'}", flush=True)
    if reason is not None:
        return 1
    ok = True
    if not args.no_probe:
        ok = probe()
        print(f"probe: {'all within tolerance' if ok else 'FAILURES above'}", flush=True)
    if not args.probe_only:
        print(f"inputs: {args.inputs}", flush=True)
        print("\n".join(timing([w.strip() for w in args.workloads.split(",") if w.strip()], args.inputs)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
