"""The stacklevel that points a warning at the user's line, however deep inside the package it is raised."""

from __future__ import annotations

import os
import sys
import types

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jax_ragged_attn/, not features/


def users_stacklevel() -> int:
    """warnings.warn's stacklevel, seen from our caller, of the first frame outside jax_ragged_attn: the user's
    call. Counted, not written down per call site, so moving code between modules cannot point a warning at
    the package's own lines."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
