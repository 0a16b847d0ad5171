import sys

from jax_ragged_attn.tools.bench.cli import main

sys.exit(main())
