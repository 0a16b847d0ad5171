"""The fa3 family: FlashAttention-3's Hopper kernels through the optional flash-attn3-jax wheel.

    ragged.py    ragged_attention's backend: the varlen kernels, with this package's padding safety
    kvcache.py   ragged_attention_with_kvcache's backend: the kvcache kernels (contiguous and paged)
"""
