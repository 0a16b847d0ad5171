"""cuDNN's own knobs and test hooks, not the user's: read when a call is traced, set by tests and benchmarks
through testing.backend_options, so that they are neither fields of the user's config nor cache keys of
every call. A function jitted around the op keeps what it was traced with: trace it inside the block."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CudnnOptions:
    # Fill every output with NaN before the handler zeroes the rows no sequence owns, so a row cuDNN should
    # write but skips reads NaN, not 0 (launch.py).
    poison_outputs: bool = False
    # A contiguous KV cache's route, "paged" or "ragged" (kvcache.py route); None: the backend decides. Another
    # backend's route ("head_tail") is not this one's.
    route: str | None = None


OPTIONS = CudnnOptions()
