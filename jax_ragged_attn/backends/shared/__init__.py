"""What several kernel families share; any family may import it, it imports no family.

extension.py        loads the compiled extension (cuDNN handlers and the row-zeroing kernel)
row_zeroing.py      zeroes the rows no sequence uses, in place (the padding safety of cuDNN and FA3)
head_groups.py      a call split into groups of heads (the int32 offsets' bound)
stats_grad.py       the stats' gradient folded into a widened value (one backward pass)
known_issues.py     upstream bugs fenced per library version, GPU and feature
cache_index.py      the KV-cache lengths and page table clamped into the cache in one launch
cache_attention.py  attention over a KV cache in jnp (the xla family's, and the kernels' tail)
head_tail.py        a cache call split into a kernel's head and a jnp tail, merged by log-sum-exp
options.py          the knobs of those two (rows a step, queries a tile, the tail): testing.backend_options
"""
