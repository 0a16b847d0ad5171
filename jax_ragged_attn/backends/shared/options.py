"""The knobs of what several families share over a KV cache, not the user's: read when a call is traced, set
by tests through testing.backend_options (cudnn/options.py says why they live here)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    block_rows: int | None = None  # cache rows a step of the jnp path reads (cache_attention.block_rows)
    query_tile: int | None = None  # its queries a packed tile (cache_attention.QUERY_TILE)
    # The head / tail split's tail on FA3 and cuDNN (head_tail.tail_rows); tests make it small so that heads and
    # tails both carry keys.
    tail_rows: int | None = None


OPTIONS = CacheOptions()
