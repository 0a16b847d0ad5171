"""implementation="xla" for ragged_attention_with_kvcache: the blocked online softmax in jnp
(shared/cache_attention.py), which serves every call everywhere."""

from __future__ import annotations

from jax_ragged_attn.backends.shared.cache_attention import attend
from jax_ragged_attn.backends.shared.kvcache_config import KVCacheConfig

NAME = "xla"

__all__ = ["NAME", "attend", "unsupported_reason"]


def unsupported_reason(config: KVCacheConfig) -> str | None:
    return None
