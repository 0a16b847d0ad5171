"""Input layouts beside plain q, k, v and the helpers that make them: fused projections read in place
(packed.py), segment ids (segments.py), FlashAttention's function names (flash_attn.py) and documents packed
into fixed-size rows (data.py). Each entry point builds its options and hands the buffers to ops.ragged.attend."""
