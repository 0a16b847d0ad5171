"""FlashAttention-3's own knobs and test hooks, not the user's: read when a call is traced, set by tests and
benchmarks through testing.backend_options (cudnn/options.py says why they live here)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Fa3Options:
    route: str | None = None  # "head_tail": the KV-cache split pinned (kvcache.py route); None: the backend decides
    num_splits: int | None = None  # the KV-cache kernel's key splits (kvcache.py num_splits); None: its heuristic
    packed_tile_rows: int | None = None  # query rows a packed tile holds (kvcache.py packed_tile_rows)


OPTIONS = Fa3Options()
