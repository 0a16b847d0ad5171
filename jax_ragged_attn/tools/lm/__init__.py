"""The main job, `python -m jax_ragged_attn` (cli.py's docstring says what it does), one module per job:

    model.py       Setup, the decoder (Block, ByteLM) with its attention passed in, the losses
    corpus.py      the standard library's files, windows of them, packed and padded batches
    training.py    the jitted step over flat parameters, the training loop, the held-out evaluation
    profiling.py   Timing (one method for every figure printed) and --profile's step breakdown
    progress.py    the progress bar (tqdm when installed)
    compare.py     the side-by-side: packed against padded (jax.nn.dot_product_attention)
    generation.py  batched prompts through a paged KV cache, timed against a full forward per byte
    serving.py     a request queue served by continuous batching (packed queries over the paged cache), beside
                   the fixed-batch generation on the same requests
    cli.py         the flags, the presets and main()

Every name is re-exported here, so `from jax_ragged_attn.tools import lm; lm.ByteLM` keeps working.
"""

try:
    import optax  # noqa: F401
    from flax import nnx  # noqa: F401

    from jax_ragged_attn.flax import RaggedSelfAttention  # noqa: F401
except ImportError as error:
    raise SystemExit(f"the main job needs flax and optax: pip install 'jax_ragged_attn[flax]' ({error})") from None

from jax_ragged_attn.tools.lm.cli import PRESETS, attention_implementation, main, parse_args, plot_losses  # noqa: F401
from jax_ragged_attn.tools.lm.compare import (  # noqa: F401
    SYSTEMS,
    XLA_SCORES_LIMIT_BYTES,
    SystemResult,
    measure_system,
    side_by_side,
    system_batches,
    system_unavailable,
)
from jax_ragged_attn.tools.lm.corpus import (  # noqa: F401
    device_batch,
    packed_batches,
    padded_batch,
    padded_batches,
    padded_pieces,
    padded_rows,
    stdlib_files,
    windows,
)
from jax_ragged_attn.tools.lm.generation import (  # noqa: F401
    PAGE_SIZE,
    decode,
    empty_caches,
    generate,
    page_table_for,
    prefill,
    sample_and_time,
    sample_prompts,
)
from jax_ragged_attn.tools.lm.model import (  # noqa: F401
    VOCAB,
    Block,
    ByteLM,
    Setup,
    _nll,
    eval_nll,
    packed_attend,
    packed_loss,
    padded_attend,
    padded_loss,
    split_heads,
)
from jax_ragged_attn.tools.lm.profiling import Timing, matmul_parameters, profile, step_flops, time_calls  # noqa: F401
from jax_ragged_attn.tools.lm.serving import (  # noqa: F401
    PagePool,
    Request,
    Served,
    ServingConfig,
    make_requests,
    serve,
    serve_and_compare,
    serve_fixed,
)
from jax_ragged_attn.tools.lm.training import Trainer, evaluate, make_trainer, make_tx, train, unigram_bits_per_byte  # noqa: F401
