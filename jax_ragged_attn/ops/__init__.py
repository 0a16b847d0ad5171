"""The ops, one module each: ragged.py (ragged_attention over packed sequences) and kvcache.py
(ragged_attention_with_kvcache and kvcache_append over a KV cache). Each validates its arguments into its config
(config.py), runs the features around one backend call and picks the backend with backends.choose."""
