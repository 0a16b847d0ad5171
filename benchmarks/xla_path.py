"""The xla path's forward and forward+backward against jax.nn's padded XLA attention on the same sequences.

    python -m benchmarks.xla_path                               # the two CPU shapes, float32
    python -m benchmarks.xla_path --shape W1 --dtype bfloat16   # W1 on a GPU (an H200)
    git show <commit>:jax_ragged_attn/backends/xla/ragged.py > /tmp/xla_before.py
    python -m benchmarks.xla_path --before /tmp/xla_before.py   # adds the old xla.py's rows

Shapes (lengths drawn by workloads.seeded_lengths, numpy seed 0; causal):

    cpu-4k   15 sequences of 64..512 trimmed to 4,096 tokens, 4 heads, head dim 64
    cpu-8k   10 sequences of 128..2048 trimmed to 8,192 tokens, 8 heads, head dim 64
    W1       16 sequences of 128..4096 trimmed to 32,768 tokens (193..3980), 16 heads, head dim 128

Systems: "xla" is attention_xla (what implementation="xla" runs) on the packed [T, H, D] tokens; "jax.nn"
is jax.nn.dot_product_attention(implementation="xla", is_causal=True) on the same sequences padded to
[B, S_max, H, D], with query_seq_lengths / key_value_seq_lengths masking the padding. The padding is done
once, outside the timed call. forward+backward is jax.grad of the output's sum with respect to q, k and v.

Timing: each function is jitted, compiled and called twice untimed; then --repeats rounds, each timing one
plain loop of every (system, direction) in turn: a Python loop of N calls followed by block_until_ready (N
chosen so a loop lasts about --target seconds). The median loop time / N is reported. Interleaving keeps a
changing load on a shared machine from favouring one row; still, compare medians of one run only.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import interleaved_loop_seconds, plain_loop_seconds
from jax_ragged_attn.backends.xla import memory as xla_memory
from jax_ragged_attn.backends.xla import ragged as current_xla
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.index import cu_seqlens_from_lengths
from jax_ragged_attn.testing.workloads import seeded_lengths

# name: (num_seqs, low, high, total tokens, heads, head dim)
SHAPES = {
    "cpu-4k": (15, 64, 512, 4096, 4, 64),
    "cpu-8k": (10, 128, 2048, 8192, 8, 64),
    "W1": (16, 128, 4096, 32768, 16, 128),
}


def _load(path: str | None):
    if path is None:
        return current_xla
    spec = importlib.util.spec_from_file_location("xla_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def inputs(shape: str, dtype: str, seed: int = 0):
    """(lengths, q, k, v packed [T, H, D], cu_seqlens int32) drawn with numpy seed `seed`."""
    num_seqs, low, high, total, heads, dim = SHAPES[shape]
    lengths = seeded_lengths(num_seqs, low, high, total=total, seed=seed)
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((total, heads, dim), np.float32), dtype) for _ in range(3))
    return lengths, q, k, v, jnp.asarray(cu_seqlens_from_lengths(lengths))


def padded(x, lengths):
    """[T, H, D] packed -> [B, S_max, H, D], zeros after each sequence."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    s_max = max(lengths)
    rows = np.stack([np.minimum(s + np.arange(s_max), x.shape[0] - 1) for s in starts])
    keep = np.arange(s_max)[None, :] < np.asarray(lengths)[:, None]
    return jnp.where(jnp.asarray(keep)[..., None, None], x[jnp.asarray(rows)], 0)


def _calls(fn, args, target: float) -> int:
    """Compiles fn and calls it twice untimed; returns how many calls make a loop of about `target` seconds."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    one = plain_loop_seconds(lambda: fn(*args), 1, 1)[0]
    return max(1, min(50, round(target / max(one, 1e-6))))


def _time_all(entries: dict, repeats: int, target: float) -> dict:
    """{key: median seconds per call} of jitted fns {key: (fn, args)}. The timed loops are interleaved (one
    loop of every entry per repeat), so a load that changes during the run (a shared machine) shifts every
    entry alike instead of whichever happened to run then."""
    loops = {key: (functools.partial(fn, *args), _calls(fn, args, target)) for key, (fn, args) in entries.items()}
    return {key: statistics.median(t) for key, t in interleaved_loop_seconds(loops, repeats).items()}


def _with_grad(forward):
    """(forward, forward+backward) jitted: the second is grad of the output's float32 sum w.r.t. q, k, v."""
    loss = lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum()
    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def systems(shape: str, dtype: str, before: str | None):
    """(lengths, the xla path's config, {name: (forward, forward+backward, args)}) for this shape."""
    lengths, q, k, v, cu = inputs(shape, dtype)
    max_seqlen = max(lengths)
    config = make_config(
        q, k, v, cu, cu, AttentionOptions(is_causal=True), max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen
    )
    out = {}
    impls = [("xla", current_xla)] + ([("xla before", _load(before))] if before else [])
    for name, impl in impls:
        extra = {"memory_limit": "off"} if "memory_limit" in impl.attention_xla.__code__.co_varnames else {}
        fwd = lambda q, k, v, impl=impl, extra=extra: impl.attention_xla(q, k, v, cu, cu, config, **extra)[0]
        out[name] = (*_with_grad(fwd), (q, k, v))

    seq = jnp.asarray(lengths, jnp.int32)

    def dense(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, query_seq_lengths=seq, key_value_seq_lengths=seq, implementation="xla"
        )

    out["jax.nn padded"] = (*_with_grad(dense), tuple(padded(x, lengths) for x in (q, k, v)))
    return lengths, config, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="cpu-4k,cpu-8k", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops; the median is reported")
    parser.add_argument("--target", type=float, default=0.5, help="seconds a timed loop should last")
    parser.add_argument("--before", help="path of an older xla.py to time beside the current one")
    parser.add_argument("--directions", default="fwd,fwd+bwd")
    args = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, {args.dtype}")
    for shape in args.shape.split(","):
        lengths, config, table = systems(shape, args.dtype, args.before)
        _, _, _, total, heads, dim = SHAPES[shape]
        print(
            f"\n{shape}: {len(lengths)} sequences of {min(lengths)}..{max(lengths)} ({total:,} tokens), "
            f"{heads} heads, head dim {dim}, causal"
        )
        # What "xla" runs with, as xla.py resolves it at trace time (settings: jax_ragged_attn/backends/xla/memory.py).
        print(
            f"xla: {'fused' if xla_memory.fused_backward(config) else 'two_pass'} backward, "
            f"{xla_memory.matmul_dtype(config)} matmul operands, blocks {xla_memory.block_sizes(config)}"
        )
        wanted = args.directions.split(",")
        entries = {}
        for name, (fwd, both, fn_args) in table.items():
            if "fwd" in wanted:
                entries[name, "fwd"] = (fwd, fn_args)
            entries[name, "fwd+bwd"] = (both, fn_args)
        measured = _time_all(entries, args.repeats, args.target)
        times = {name: (measured.get((name, "fwd"), float("nan")), measured[name, "fwd+bwd"]) for name in table}
        ref = times["jax.nn padded"][1]
        print(f"{'system':<16}{'fwd ms':>10}{'fwd+bwd ms':>12}{'fwd+bwd/fwd':>13}{'vs jax.nn fwd+bwd':>19}")
        for name, (t_f, t_b) in times.items():
            print(f"{name:<16}{t_f * 1e3:>10.1f}{t_b * 1e3:>12.1f}{t_b / t_f:>13.2f}{t_b / ref:>19.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
