"""The xla path's own test hooks, not the user's: read when a call is traced, set by tests through
testing.backend_options (cudnn/options.py says why they live here)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class XlaOptions:
    # The backward as one fused pass (True) or two passes (False); None: fused on a CPU only (memory.py).
    xla_fused_backward: bool | None = None


OPTIONS = XlaOptions()
