"""Decode benchmark: ragged_attention_with_kvcache against flash-attn3-jax's flash_mha_with_kvcache.

    python -m benchmarks.decode           # the decode grid, on a GPU
    python -m benchmarks.decode --quick   # small shapes, xla only: seconds, on a CPU

One query token per sequence, GQA 32/8, head dim 128, bf16; B in {8, 64, 256} x context L in {2k, 8k, 32k} with
cache_seqlens drawn in [L/2, L] (numpy.random.default_rng(0)); a contiguous cache [B, L, 8, 128] and the same
buffer as a paged cache (pages of 256 rows, the page table a shuffled permutation). Rows: each of our
implementations that serves the call (fa3, cudnn, xla), then the wheel's own flash_mha_with_kvcache where it
imports. cuDNN runs both through its paged SDPA graph (a contiguous cache viewed as pages; the ragged training
kernel over the flattened cache, slower on all but the smallest shape, only where the graph declines). Timing:
timing.plain_loop_seconds (a loop of jitted calls, then block_until_ready; median of the repetitions). GB/s
counts the K/V bytes the call must read, sum(cache_seqlens) x Hkv x (Dqk + Dv) x 2 bytes, over the time; % is
of the H200's 4.8 TB/s. A shape whose cache does not fit the device is skipped with a note.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import plain_loop_seconds
from jax_ragged_attn.backends.fa3 import kvcache as fa3_kvcache
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.ops.kvcache import kvcache_config, ragged_attention_with_kvcache

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e
IMPLEMENTATIONS = ("fa3", "cudnn", "xla")
FULL = dict(
    batches=(8, 64, 256),
    contexts=(2048, 8192, 32768),
    heads=(32, 8),
    head_dim=128,
    page_size=256,
    dtype="bfloat16",
    implementations=IMPLEMENTATIONS,
)
QUICK = dict(
    batches=(2, 4),
    contexts=(256, 512),
    heads=(4, 2),
    head_dim=32,
    page_size=64,
    dtype="float32",
    implementations=("xla",),
)


def _device_bytes() -> int | None:
    try:
        return int(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # noqa: BLE001 - CPU and some plugins report none
        return None


def _raw_fa3():
    """flash-attn3-jax's own flash_mha_with_kvcache, or the reason it cannot be used."""
    try:
        from flash_attn3_jax import flash_mha_with_kvcache
    except Exception as error:  # noqa: BLE001
        return None, f"flash_attn3_jax does not import: {type(error).__name__}: {error}"
    return flash_mha_with_kvcache, None


def _inputs(batch: int, context: int, shape: dict, rng):
    """(q, k, v, lengths, page_table, bytes read): the contiguous cache and the page table over the same buffer
    seen as pages."""
    hq, hkv = shape["heads"]
    d, page = shape["head_dim"], shape["page_size"]
    dtype = jnp.dtype(shape["dtype"])
    lengths = rng.integers(context // 2, context + 1, batch).astype(np.int32)
    key = jax.random.key(0)
    q = jax.random.normal(key, (batch, 1, hq, d), dtype)
    k = jax.random.normal(jax.random.fold_in(key, 1), (batch, context, hkv, d), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 2), (batch, context, hkv, d), dtype)
    per_seq = context // page
    table = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)
    bytes_read = int(lengths.sum()) * hkv * 2 * d * dtype.itemsize
    return q, k, v, jnp.asarray(lengths), jnp.asarray(table), bytes_read


def _time(function, args, calls: int, repetitions: int) -> float:
    compiled = jax.jit(function).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    return statistics.median(plain_loop_seconds(lambda: compiled(*args), calls, repetitions))


def _row(batch, context, layout, system, seconds, bytes_read, note=""):
    rate = bytes_read / seconds / 1e9
    print(
        f"{batch:>5} {context:>7} {layout:>10}  {system:<16} {seconds * 1e3:9.3f} {rate:9.0f} "
        f"{100 * rate * 1e9 / PEAK_BYTES_PER_S:6.1f}%  {note}",
        flush=True,
    )


def run(shape: dict, calls: int, repetitions: int) -> None:
    rng = np.random.default_rng(0)
    raw, raw_reason = _raw_fa3()
    limit = _device_bytes()
    print(
        f"# {jax.devices()[0].device_kind}; heads {shape['heads'][0]}/{shape['heads'][1]}, d {shape['head_dim']}, "
        f"{shape['dtype']}, page {shape['page_size']}; flash-attn3-jax: {raw_reason or 'imported'}"
    )
    print(f"{'B':>5} {'L':>7} {'layout':>10}  {'system':<16} {'ms':>9} {'GB/s':>9} {'peak':>7}  note")
    for batch in shape["batches"]:
        for context in shape["contexts"]:
            hkv, d = shape["heads"][1], shape["head_dim"]
            cache_bytes = 2 * batch * context * hkv * d * jnp.dtype(shape["dtype"]).itemsize
            if limit is not None and 1.5 * cache_bytes > limit:
                print(
                    f"# B={batch} L={context}: skipped, K+V {cache_bytes / 2**30:.1f} GiB does not fit "
                    f"{limit / 2**30:.1f} GiB with room to run"
                )
                continue
            q, k, v, lengths, table, bytes_read = _inputs(batch, context, shape, rng)
            paged_k = k.reshape(-1, shape["page_size"], *k.shape[2:])  # the same buffer, seen as pages
            paged_v = v.reshape(-1, shape["page_size"], *v.shape[2:])
            for layout, args in (
                ("contiguous", (q, k, v, lengths, None)),
                (f"paged{shape['page_size']}", (q, paged_k, paged_v, lengths, table)),
            ):
                for name in shape["implementations"]:
                    label = name

                    def ours(q, k, v, lengths, table, name=name):
                        return ragged_attention_with_kvcache(q, k, v, lengths, page_table=table, implementation=name)

                    try:
                        seconds = _time(ours, args, calls, repetitions)
                    except NotImplementedError as error:
                        print(f"# B={batch} L={context} {layout} {label}: declined: {error}")
                        continue
                    except Exception as error:  # noqa: BLE001 - one failing row must not end the table
                        print(f"# B={batch} L={context} {layout} {label}: failed: {type(error).__name__}: {error}")
                        continue
                    note = ""
                    if name == "fa3":
                        config = kvcache_config(*args[:4], args[4], AttentionOptions(is_causal=True))
                        note = f"route={fa3_kvcache.route(config)}, num_splits={fa3_kvcache.num_splits(config)}"
                    _row(batch, context, layout, f"ours-{label}", seconds, bytes_read, note)
                if raw is not None:

                    def wheel(q, k, v, lengths, table):
                        return raw(q, k, v, cache_seqlens=lengths, page_table=table, is_causal=True)

                    try:
                        _row(
                            batch,
                            context,
                            layout,
                            "flash-attn3-jax",
                            _time(wheel, args, calls, repetitions),
                            bytes_read,
                            "num_splits=1",
                        )
                    except Exception as error:  # noqa: BLE001
                        print(
                            f"# B={batch} L={context} {layout} flash-attn3-jax: failed: {type(error).__name__}: {error}"
                        )
            del q, k, v, paged_k, paged_v


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, xla only (runs on a CPU in seconds)")
    parser.add_argument(
        "--implementations", default=None, help=f"comma-separated subset of {','.join(IMPLEMENTATIONS)}"
    )
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the decode grid)")
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths (default: the grid)")
    parser.add_argument("--calls", type=int, default=None, help="jitted calls per timed loop (default 50; quick 3)")
    parser.add_argument("--repetitions", type=int, default=None, help="timed loops; the median is reported")
    args = parser.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    if args.implementations:
        shape["implementations"] = tuple(args.implementations.split(","))
    for axis in ("batches", "contexts"):
        if getattr(args, axis):
            shape[axis] = tuple(int(n) for n in getattr(args, axis).split(","))
    run(shape, args.calls or (3 if args.quick else 50), args.repetitions or (3 if args.quick else 7))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
