import sys

from jax_ragged_attn.selfcheck import main

sys.exit(main())
