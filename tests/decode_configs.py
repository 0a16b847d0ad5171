"""KVCacheConfig values for the tests that read a route, a decline, a tile size or an index plan off a config
rather than off a call."""

from jax_ragged_attn.config import KVCacheConfig

_DECODE = dict(
    batch=2,
    seqlen_q=1,
    num_heads_q=8,
    num_heads_kv=2,
    head_dim_qk=128,
    head_dim_v=128,
    dtype="bfloat16",
    paged=True,
    page_size=64,
    num_pages=16,
    max_pages=8,
    scale=0.1,
    is_causal=True,
    window_left=None,
    window_right=None,
)


def decode_config(**fields) -> KVCacheConfig:
    """A paged bfloat16 decode step (2 sequences, 8 query heads over 2 KV heads, head dim 128, 16 pages of 64
    rows, causal) with `fields` in place of its values."""
    return KVCacheConfig(**{**_DECODE, **fields})
