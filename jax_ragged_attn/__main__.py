"""`python -m jax_ragged_attn` runs the training demo; `python -m jax_ragged_attn.selfcheck` checks the op."""

import sys

from jax_ragged_attn.demo import main

sys.exit(main())
