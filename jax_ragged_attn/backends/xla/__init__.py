"""The xla family: pure-JAX implementations that run everywhere (CPU included) and serve every call.

ragged.py    ragged_attention's backend: memory-efficient blocked attention over the packed token axis
kvcache.py   ragged_attention_with_kvcache's backend: a blocked online softmax over the cache
memory.py    the working-set estimate and limit that keeps the ragged path within device memory
options.py   its test hook (the fused or two-pass backward), set through testing.backend_options
"""
