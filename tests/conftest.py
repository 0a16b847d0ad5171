"""Test-session settings, applied before any test module imports jax."""

import os

# `pytest -n 2` starts two processes; on a GPU each would otherwise preallocate 75 % of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
