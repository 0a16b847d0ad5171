"""implementation="xla" for ragged_attention_with_kvcache: the blocked online softmax in jnp
(shared/cache_attention.py), which serves every call everywhere, packed queries included."""

from __future__ import annotations

from jax_ragged_attn.backends.shared.cache_attention import attend, attend_packed
from jax_ragged_attn.config import KVCacheConfig

NAME = "xla"

__all__ = ["NAME", "attend", "attend_packed", "unsupported_reason"]


def unsupported_reason(config: KVCacheConfig) -> str | None:
    return None
