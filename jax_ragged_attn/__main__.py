"""`python -m jax_ragged_attn` runs the main job: a byte-level language model trained on the Python standard
library's source (jax_ragged_attn/tools/lm/). The reversal demo, in the repository: `python examples/reversal.py`."""

import sys

from jax_ragged_attn.tools.lm import main

sys.exit(main())
