"""FA3 kvcache key splits (flash decoding) swept on the decode benchmark's small shapes, to set
fa3_kvcache.num_splits' heuristic from measurements: one query per sequence, GQA 32/8, d 128, bf16.

    python -m benchmarks.sweep_decode_splits   # on the H200; one line per shape, ms per split count
"""

from __future__ import annotations

import sys

import numpy as np

from jax_ragged_attn import ragged_attention_with_kvcache
from jax_ragged_attn.backends.fa3 import kvcache as fa3_kvcache
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.ops.kvcache import kvcache_config
from jax_ragged_attn.testing.private_config import backend_options

from benchmarks import decode

SHAPES = [(8, 2048), (8, 8192), (8, 32768), (32, 2048), (64, 2048), (16, 32768)]
SPLITS = (1, 2, 3, 4, 6, 8, 16)


def main(argv: list[str]) -> int:
    shape = dict(decode.FULL)
    rng = np.random.default_rng(0)
    raw, _ = decode._raw_fa3()
    print("B x L, layout: ms at num_splits " + " ".join(f"{s:>6}" for s in SPLITS) + "   raw  heuristic")
    for batch, context in SHAPES:
        q, k, v, lengths, table, _ = decode._inputs(batch, context, shape, rng)
        paged_k = k.reshape(-1, shape["page_size"], *k.shape[2:])
        paged_v = v.reshape(-1, shape["page_size"], *v.shape[2:])
        for layout, args in (("contiguous", (q, k, v, lengths, None)), ("paged", (q, paged_k, paged_v, lengths, table))):
            times = []
            for splits in SPLITS:
                with backend_options(num_splits=splits):  # FA3's option (backends/fa3/options.py)
                    def ours(q, k, v, lengths, table):
                        return ragged_attention_with_kvcache(q, k, v, lengths, page_table=table, implementation="fa3")
                    times.append(decode._time(ours, args, 20, 5) * 1e3)
            wheel = (lambda q, k, v, n, t: raw(q, k, v, cache_seqlens=n, page_table=t, is_causal=True))
            raw_ms = decode._time(wheel, args, 20, 5) * 1e3 if raw is not None else float("nan")
            config = kvcache_config(*args[:4], args[4], AttentionOptions(is_causal=True))
            print(f"{batch:>3} x {context:>5} {layout:>10}: " + " ".join(f"{t:6.3f}" for t in times)
                  + f" {raw_ms:6.3f}  {fa3_kvcache.num_splits(config)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
