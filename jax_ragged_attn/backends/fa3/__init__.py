"""The fa3 family: FlashAttention-3's Hopper kernels from an optional wheel, its provider.

providers.py ragged_attention's backend (implementation="fa3"): the providers, the first serving or the named
ragged.py    FA3's wrapper (padding safety, masks, stats, the stats gradient), the flash-attn3-jax provider
dew.py       the dew-flash-attn provider: its kernel calls over the same wrapper
kvcache.py   ragged_attention_with_kvcache's backend: flash-attn3-jax's kvcache kernels (contiguous and paged)
options.py   its knobs and test hooks (KV-cache route, key splits, packed tile rows): testing.backend_options
"""
