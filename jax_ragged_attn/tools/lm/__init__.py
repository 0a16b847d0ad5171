"""The main job (`python -m jax_ragged_attn`), one module per job; this package re-exports their names."""

from jax_ragged_attn.tools.lm.cli import *  # noqa: F401,F403
from jax_ragged_attn.tools.lm.cli import __doc__, _nll  # noqa: F401
