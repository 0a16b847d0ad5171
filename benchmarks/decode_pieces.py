"""Few-sequence decode (issue 48, item 4): would splitting each sequence's keys into pieces fill the GPU better
than FA3's own key splits? An experiment outside the library, to decide before building it in.

    python -m benchmarks.decode_pieces            # 8 x 32k and 8 x 2k paged on the H200 (fa3 and cudnn)
    python -m benchmarks.decode_pieces --quick    # small shapes on the xla path: checks the merge, on a CPU

8 sequences x 8 KV heads make 64 (sequence, head) pairs, too few CTAs for 132 SMs: the 8 x 32k decode read the
cache at 64 % of HBM (docs/PERFORMANCE.md), and FA3's own split heuristic (fa3/kvcache.py num_splits) stopped
at 2 because a third split's partial second wave cost more (0.249 against 0.299 ms). The pieces here are made
through the page table, with no copy: piece p of sequence b is pages [p * n, (p + 1) * n) of its table row
(n = max_pages / P), a sequence of its own in a batch of B x P, its length clip(len_b - p * n * page_size, 0,
n * page_size). One query row attends every key of its sequence (causal, no window), so each piece is a
full attention over its rows; the pieces are merged by their log-sum-exps in jnp, as the head / tail split
merges (backends/shared/head_tail.py merge). Rows of the table:

    P = 1 (today's call) with the backend's own split choice, and FA3's num_splits pinned 1 .. 4;
    P = 2, 4, 8 pieces, each with the backend's own splits (and FA3's pinned to 1).

Each row checks its output against P = 1's (max |diff|) so a wrong merge cannot pass as a fast one. Timing as
benchmarks/decode.py: a loop of jitted calls then block_until_ready, the median of the repetitions; GB/s counts
sum(lengths) x Hkv x (Dqk + Dv) x 2 bytes. If a P > 1 row wins, the op would route few-sequence decode that way
(a KV-cache feature around any backend's call); if none does, item 4 is missed with this table as the cause.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn import ragged_attention_with_kvcache
from jax_ragged_attn.testing.private_config import backend_options

from benchmarks.timing import plain_loop_seconds

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e
FULL = dict(shapes=((8, 32768), (8, 2048)), heads=(32, 8), head_dim=128, page_size=256, dtype="bfloat16",
            implementations=("fa3", "cudnn"), pieces=(1, 2, 4, 8), splits=(1, 2, 3, 4))
QUICK = dict(shapes=((2, 512), (3, 256)), heads=(4, 2), head_dim=32, page_size=32, dtype="float32",
             implementations=("xla",), pieces=(1, 2, 4), splits=())


def pieces_call(q, k_cache, v_cache, lengths, page_table, pieces: int, **options):
    """(out [B, 1, Hq, Dv]) of a one-query decode through `pieces` pieces of each sequence's page-table row,
    merged by their log-sum-exps (see the module docstring)."""
    batch, max_pages = page_table.shape
    if max_pages % pieces:
        raise ValueError(f"max_pages = {max_pages} is not a multiple of pieces = {pieces}")
    per_piece = max_pages // pieces
    rows = per_piece * k_cache.shape[1]
    table = page_table.reshape(batch * pieces, per_piece)  # row b * P + p: piece p of sequence b
    starts = jnp.arange(pieces, dtype=jnp.int32) * rows
    piece_lengths = jnp.clip(lengths[:, None] - starts[None, :], 0, rows).reshape(-1)
    out, stats = ragged_attention_with_kvcache(jnp.repeat(q, pieces, axis=0), k_cache, v_cache, piece_lengths,
                                               page_table=table, return_stats=True, **options)
    out = out.reshape(batch, pieces, *out.shape[1:]).astype(jnp.float32)  # [B, P, 1, Hq, Dv]
    stats = stats.reshape(batch, pieces, *stats.shape[1:])  # [B, P, Hq, 1]
    total = jax.nn.logsumexp(stats, axis=1, keepdims=True)
    weight = jnp.exp(stats - jnp.where(jnp.isfinite(total), total, 0.0))  # 0 for an empty piece
    merged = jnp.sum(weight.transpose(0, 1, 3, 2)[..., None] * out, axis=1)  # [B, 1, Hq, Dv]
    return merged.astype(q.dtype)


def _inputs(batch: int, context: int, shape: dict, rng):
    hq, hkv = shape["heads"]
    d, page = shape["head_dim"], shape["page_size"]
    dtype = jnp.dtype(shape["dtype"])
    lengths = rng.integers(context // 2, context + 1, batch).astype(np.int32)
    per_seq = context // page
    key = jax.random.key(0)
    q = jax.random.normal(key, (batch, 1, hq, d), dtype)
    k = jax.random.normal(jax.random.fold_in(key, 1), (batch * per_seq, page, hkv, d), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 2), (batch * per_seq, page, hkv, d), dtype)
    table = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)
    return q, k, v, jnp.asarray(lengths), jnp.asarray(table), int(lengths.sum()) * hkv * 2 * d * dtype.itemsize


def _time(function, args, calls: int, repetitions: int):
    compiled = jax.jit(function).lower(*args).compile()
    out = jax.block_until_ready(compiled(*args))
    return statistics.median(plain_loop_seconds(lambda: compiled(*args), calls, repetitions)), out


def run(shape: dict, calls: int, repetitions: int) -> list[str]:
    rows = ["| shape | implementation | pieces | FA3 splits | ms | GB/s | % of 4.8 TB/s | max diff to P=1 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rng = np.random.default_rng(0)
    for batch, context in shape["shapes"]:
        q, k, v, lengths, table, bytes_read = _inputs(batch, context, shape, rng)
        for implementation in shape["implementations"]:
            reference = None
            variants = [(pieces, None) for pieces in shape["pieces"]]
            if implementation == "fa3":
                variants += [(1, s) for s in shape["splits"]] + [(p, 1) for p in shape["pieces"] if p > 1]
            for pieces, splits in variants:
                label = f"{batch} x {context // 1024}k" if context >= 1024 else f"{batch} x {context}"
                try:
                    with backend_options(num_splits=splits):
                        call = lambda q, k, v, n, t, p=pieces: pieces_call(  # noqa: E731
                            q, k, v, n, t, p, implementation=implementation)
                        seconds, out = _time(call, (q, k, v, lengths, table), calls, repetitions)
                except NotImplementedError as error:
                    rows.append(f"| {label} | {implementation} | {pieces} | {splits or 'own'} | declined: "
                                f"{str(error)[:90]} | | | |")
                    continue
                out = np.asarray(out, np.float32)
                if reference is None:
                    reference = out
                diff = float(np.abs(out - reference).max())
                rate = bytes_read / seconds
                rows.append(f"| {label} | {implementation} | {pieces} | {splits or 'own'} | {seconds * 1e3:.3f} | "
                            f"{rate / 1e9:.0f} | {100 * rate / PEAK_BYTES_PER_S:.1f} | {diff:.2g} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes on the xla path (a CPU)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    print(f"devices: {jax.devices()}")
    print("\n".join(run(shape, args.calls if not args.quick else 3, args.repetitions if not args.quick else 2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
