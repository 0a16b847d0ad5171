"""cuDNN fused attention over packed variable-length sequences (THD / varlen) for JAX.

    out = jax_ragged_attn.ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv,
                                           max_seqlen_q=..., max_seqlen_kv=..., is_causal=True)
"""

import jax as _jax

# jax.shard_map(check_vma=) and jax.reshard arrived in jax 0.10: with an older jax (installed with --no-deps, or
# pinned by another package) say so here rather than fail later inside the op.
if tuple(int(part) for part in _jax.__version__.split(".")[:2]) < (0, 10):
    raise ImportError(f"jax_ragged_attn needs jax 0.10 or newer, found {_jax.__version__}: pip install -U 'jax>=0.10'")

from jax_ragged_attn.api import ragged_attention
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn._cudnn.extension import cudnn_unavailable_reason

__all__ = ["AttentionConfig", "cudnn_unavailable_reason", "ragged_attention"]
__version__ = "0.1.0"
