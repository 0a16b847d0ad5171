"""Mixed serving step: packed queries over a paged cache, ours against FlashAttention-3's own kernel.

    python -m benchmarks.kvcache_mixed           # the serving shapes, on a GPU (FA3 wheel installed)
    python -m benchmarks.kvcache_mixed --quick   # small shapes, xla only: seconds, on a CPU

Mixed step: B = 64 sequences, 4 prefilling chunks of 512 queries and 60 decoding one each, their contexts
(cache_seqlens, the chunk included) drawn in [2k, 16k] (numpy.random.default_rng(0)); GQA 32/8, head dim 128,
bf16, pages of 256 rows in a shuffled page table. Rows:

  ours-<impl>         ragged_attention_with_kvcache(q [T, Hq, D], ..., cu_seqlens_q, max_seqlen_q=512,
                      page_table) through `impl`, the whole op (index arithmetic, masking) timed
  fa3-varlen          the wheel's forward handler called directly with cu_seqlens_q, the page table and
                      seqused_k (FlashAttention's flash_attn_with_kvcache with varlen queries), where the
                      handler takes it (flash-attn3-jax 0.2.3 reads the value head dim off v's third dim in
                      varlen-q mode, so with a paged cache it refuses head dim 128: the row says so)
  fa3-padded          the same handler in batch mode on the same batch: q already padded to [B, 512, Hq, D]
                      (built outside the timing), seqused_q = each sequence's queries, seqused_k, the page
                      table; FA3's kernel alone, the reference the 1.10x target reads

Decode-only (no slower than today's decode rows): B in {8, 64, 256} x context {2k, 8k}, one query per sequence,
`ours-fa3-packed` (cu_seqlens_q = 0, 1, .., B; max_seqlen_q = 1) beside `ours-fa3` (q [B, 1, Hq, D], the
fixed form: benchmarks/decode.py's row). Timing: timing.plain_loop_seconds (a loop of jitted calls, then
block_until_ready; the median of the repetitions).
"""

from __future__ import annotations

import argparse
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import plain_loop_seconds
from jax_ragged_attn.backends.fa3 import ragged as fa3
from jax_ragged_attn.ops.kvcache import ragged_attention_with_kvcache

FULL = dict(
    prefill=4,
    chunk=512,
    decode=60,
    contexts=(2048, 16384),
    heads=(32, 8),
    head_dim=128,
    page_size=256,
    dtype="bfloat16",
    implementations=("fa3", "cudnn", "xla"),
    decode_batches=(8, 64, 256),
    decode_contexts=(2048, 8192),
)
QUICK = dict(
    prefill=2,
    chunk=16,
    decode=6,
    contexts=(64, 256),
    heads=(4, 2),
    head_dim=32,
    page_size=16,
    dtype="float32",
    implementations=("xla",),
    decode_batches=(4,),
    decode_contexts=(128,),
)


def _time(function, args, calls: int, repetitions: int) -> float:
    compiled = jax.jit(function).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    return statistics.median(plain_loop_seconds(lambda: compiled(*args), calls, repetitions))


def mixed_inputs(shape: dict, rng):
    """(q [T, Hq, D], k, v [num_pages, page, Hkv, D], cache_seqlens [B], cu_seqlens_q [B + 1], page_table,
    counts [B]): prefilling sequences first, then the decoding ones."""
    hq, hkv = shape["heads"]
    d, page, dtype = shape["head_dim"], shape["page_size"], jnp.dtype(shape["dtype"])
    counts = np.array([shape["chunk"]] * shape["prefill"] + [1] * shape["decode"], np.int32)
    low, high = shape["contexts"]
    lengths = rng.integers(low, high + 1, counts.size).astype(np.int32)
    max_pages = math.ceil(high / page)
    used = -(-lengths // page)
    num_pages = int(used.sum())
    order = rng.permutation(num_pages)
    table = np.zeros((counts.size, max_pages), np.int32)  # entries past a sequence's pages: page 0, never read
    at = 0
    for b, n in enumerate(used):
        table[b, :n] = order[at : at + n]
        at += n
    key = jax.random.key(0)
    q = jax.random.normal(key, (int(counts.sum()), hq, d), dtype)
    k = jax.random.normal(jax.random.fold_in(key, 1), (num_pages, page, hkv, d), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 2), (num_pages, page, hkv, d), dtype)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return q, k, v, jnp.asarray(lengths), jnp.asarray(cu), jnp.asarray(table), counts


def _handler(q, k, v, cu_q, used_q, used_k, table, max_q: int, lse_shape):
    """The wheel's forward handler (registered under our name by backends/fa3/ragged.py), num_splits 1."""
    e32, ef, eq = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32), jnp.zeros((0,), q.dtype)
    types = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(lse_shape, jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1), jnp.float32),
    ]
    return jax.ffi.ffi_call(
        fa3.TARGET_PREFIX + "flash_mha_fwd",
        types,
        has_side_effect=False,
        input_layouts=[None] * 21,
        output_layouts=[None] * 4,
    )(
        q,
        k,
        v,
        eq,
        eq,
        eq,
        cu_q,
        e32,
        e32,
        used_q,
        used_k,
        table,
        e32,
        e32,
        eq,
        eq,
        e32,
        ef,
        ef,
        ef,
        e32,
        max_seqlen_q=max_q,
        max_seqlen_q_has_value=True,
        max_seqlen_k=0,
        max_seqlen_k_has_value=False,
        softmax_scale_val=1.0 / math.sqrt(q.shape[-1]),
        softmax_scale_has_value=True,
        pack_gqa_val=False,
        pack_gqa_has_value=False,
        is_causal=True,
        window_size_left=-1,
        window_size_right=0,
        attention_chunk=0,
        softcap=0.0,
        is_rotary_interleaved=True,
        num_splits=1,
        sm_margin=0,
    )[:2]


def _row(name: str, seconds: float, reference: float | None, note: str = "") -> None:
    ratio = f"{seconds / reference:6.3f}x" if reference else "      "
    print(f"  {name:<22} {seconds * 1e3:9.3f} ms  {ratio}  {note}", flush=True)


def mixed(shape: dict, calls: int, repetitions: int) -> None:
    q, k, v, lengths, cu, table, counts = mixed_inputs(shape, np.random.default_rng(0))
    max_q = shape["chunk"]
    print(
        f"# mixed step: {shape['prefill']} x {shape['chunk']}-query chunks + {shape['decode']} decode rows, "
        f"contexts {shape['contexts'][0]}-{shape['contexts'][1]}, heads {shape['heads'][0]}/{shape['heads'][1]}, "
        f"d {shape['head_dim']}, {shape['dtype']}, pages of {shape['page_size']} ({k.shape[0]} pages); "
        f"{jax.devices()[0].device_kind}"
    )
    reference, rows = None, []
    fa3_reason = fa3.unavailable_reason()
    if fa3_reason is None:
        try:
            reference = _time(
                lambda q, k, v, cu, n, t: _handler(
                    q, k, v, cu, jnp.zeros((0,), jnp.int32), n, t, max_q, (1, q.shape[1], q.shape[0])
                ),
                (q, k, v, cu, lengths, table),
                calls,
                repetitions,
            )
            rows.append(("fa3-varlen", reference, "the wheel's handler, cu_seqlens_q + page table"))
        except Exception as error:  # noqa: BLE001 - the wheel refuses it: say so, time the padded form
            print(
                f"# fa3-varlen: the wheel's handler refuses it: {type(error).__name__}: "
                f"{str(error).splitlines()[0][:240]}"
            )
        index = np.concatenate([np.arange(c) + s for c, s in zip(counts, np.asarray(cu)[:-1])])
        padded = (
            jnp.zeros((counts.size, max_q) + q.shape[1:], q.dtype)
            .at[np.repeat(np.arange(counts.size), counts), np.concatenate([np.arange(c) for c in counts])]
            .set(q[index])
        )
        padded_s = _time(
            lambda q, k, v, used_q, n, t: _handler(
                q, k, v, jnp.zeros((0,), jnp.int32), used_q, n, t, max_q, (q.shape[0], q.shape[2], max_q)
            ),
            (padded, k, v, jnp.asarray(counts), lengths, table),
            calls,
            repetitions,
        )
        rows.append(("fa3-padded", padded_s, "FA3's kernel alone, q pre-padded to [B, max_seqlen_q]"))
        reference = reference or padded_s
        del padded
    else:
        print(f"# FA3's own kernel: not run ({fa3_reason})")
    for name in shape["implementations"]:

        def ours(q, k, v, n, cu, t, name=name):
            return ragged_attention_with_kvcache(
                q, k, v, n, cu_seqlens_q=cu, max_seqlen_q=max_q, page_table=t, implementation=name
            )

        try:
            rows.append((f"ours-{name}", _time(ours, (q, k, v, lengths, cu, table), calls, repetitions), ""))
        except NotImplementedError as error:
            print(f"# ours-{name}: declined: {error}")
        except Exception as error:  # noqa: BLE001 - one failing row must not end the table
            print(f"# ours-{name}: failed: {type(error).__name__}: {str(error).splitlines()[0][:240]}")
    print(f"  {'system':<22} {'time':>12}  {'/ FA3':>7}")
    for name, seconds, note in rows:
        _row(name, seconds, reference, note)


def decode_only(shape: dict, calls: int, repetitions: int) -> None:
    print("# decode-only: packed (cu_seqlens_q = 0..B, max_seqlen_q = 1) beside the fixed form q [B, 1, Hq, D]")
    hq, hkv = shape["heads"]
    d, page, dtype = shape["head_dim"], shape["page_size"], jnp.dtype(shape["dtype"])
    rng = np.random.default_rng(0)
    implementation = shape["implementations"][0]
    for batch in shape["decode_batches"]:
        for context in shape["decode_contexts"]:
            lengths = jnp.asarray(rng.integers(context // 2, context + 1, batch).astype(np.int32))
            per_seq = context // page
            table = jnp.asarray(rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32))
            key = jax.random.key(1)
            q = jax.random.normal(key, (batch, 1, hq, d), dtype)
            k = jax.random.normal(jax.random.fold_in(key, 1), (batch * per_seq, page, hkv, d), dtype)
            v = jax.random.normal(jax.random.fold_in(key, 2), (batch * per_seq, page, hkv, d), dtype)
            cu = jnp.arange(batch + 1, dtype=jnp.int32)

            def fixed(q, k, v, n, t):
                return ragged_attention_with_kvcache(q, k, v, n, page_table=t, implementation=implementation)

            def packed(q, k, v, n, t, cu):
                return ragged_attention_with_kvcache(
                    q[:, 0], k, v, n, cu_seqlens_q=cu, max_seqlen_q=1, page_table=t, implementation=implementation
                )

            try:
                fixed_s = _time(fixed, (q, k, v, lengths, table), calls, repetitions)
                packed_s = _time(packed, (q, k, v, lengths, table, cu), calls, repetitions)
            except NotImplementedError as error:
                print(f"# B={batch} L={context}: declined: {error}")
                continue
            print(
                f"  B={batch:<4} L={context:<6} ours-{implementation} {fixed_s * 1e3:8.3f} ms   "
                f"ours-{implementation}-packed {packed_s * 1e3:8.3f} ms  ({packed_s / fixed_s:.3f}x)",
                flush=True,
            )
            del k, v


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, xla only (runs on a CPU in seconds)")
    parser.add_argument("--implementations", default=None, help="comma-separated subset of fa3,cudnn,xla")
    parser.add_argument("--calls", type=int, default=None, help="jitted calls per timed loop (default 30; quick 2)")
    parser.add_argument("--repetitions", type=int, default=None, help="timed loops; the median is reported")
    parser.add_argument("--no-decode", action="store_true", help="the mixed step only")
    args = parser.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    if args.implementations:
        shape["implementations"] = tuple(args.implementations.split(","))
    calls, repetitions = args.calls or (2 if args.quick else 30), args.repetitions or (2 if args.quick else 7)
    mixed(shape, calls, repetitions)
    if not args.no_decode:
        decode_only(shape, calls, repetitions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
