"""`python -m jax_ragged_attn` runs the main job, the training demo (jax_ragged_attn/tools/demo.py)."""

import sys

from jax_ragged_attn.tools.demo import main

sys.exit(main())
