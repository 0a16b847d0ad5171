"""Input layouts beside plain q, k, v and the helpers that make them: fused projections read in place
(packed.py), segment ids (segments.py), documents packed into fixed-size rows (data.py) and a KV cache
(kvcache.py). Each entry point builds its options and hands the buffers to api.attend."""
