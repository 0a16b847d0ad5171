"""cuDNN fused attention over packed variable-length sequences (THD / varlen) for JAX.

    out = jax_ragged_attn.ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv,
                                           max_seqlen_q=..., max_seqlen_kv=..., is_causal=True)
"""

from jax_ragged_attn.api import ragged_attention
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn._cudnn.extension import cudnn_unavailable_reason

__all__ = ["AttentionConfig", "cudnn_unavailable_reason", "ragged_attention"]
__version__ = "0.1.0"
