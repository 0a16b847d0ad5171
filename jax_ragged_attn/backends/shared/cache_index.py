"""A KV cache's lengths and page table made safe for a kernel that reads them without bounds, in one launch.

FlashAttention-3's kvcache kernel (backends/fa3/kvcache.py) takes cache_seqlens as the rows of each sequence
and reads page_table[b, row // page_size] for every row below it, then that page of the cache: a length past
the capacity or an entry outside the cache would make it read outside its buffers. So it is given
cache_seqlens clamped into [0, capacity] and the table with every entry outside [0, num_pages) replaced by
page 0 (a sequence that uses such an entry gets an unspecified result; check=True names the entry).

As two jnp expressions that is two XLA kernels (shapes [B] and [B, P]: XLA fuses neither into the other), a
launch each; at 8 x 2k decode, where a call is tens of microseconds and mostly launches, that is one launch
in four (docs/PERFORMANCE.md#what-the-measurements-found, "Host overhead"). On a GPU the extension's clamp
kernel (ffi/own_kernels.cu) does both in one. Elsewhere (the CPU, where the tests' FA3 stand-in runs; a GPU
where the kernel cannot load) the two expressions, which `reference` also is.
"""

from __future__ import annotations

import jax
import numpy as np

from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import KVCacheConfig
from jax_ragged_attn.index.kvcache import clamped_lengths, safe_page_table


def reference(cache_seqlens: jax.Array, page_table: jax.Array, config: KVCacheConfig) -> tuple[jax.Array, jax.Array]:
    """(lengths, table) as jnp expressions: what the kernel computes."""
    return clamped_lengths(cache_seqlens, config), safe_page_table(page_table, config)


def safe_cache_index(
    cache_seqlens: jax.Array, page_table: jax.Array, config: KVCacheConfig
) -> tuple[jax.Array, jax.Array]:
    """(lengths int32 like cache_seqlens, table int32 like page_table): the module docstring's clamps."""
    target = extension.own_kernel_target("clamp_cache_index")
    if target is None:
        return reference(cache_seqlens, page_table, config)
    types = (jax.ShapeDtypeStruct(cache_seqlens.shape, np.int32), jax.ShapeDtypeStruct(page_table.shape, np.int32))
    # Elementwise over each flat array: a vmapped call's batch axes are served as they lie.
    call = jax.ffi.ffi_call(target, types, vmap_method="broadcast_all")
    lengths, table = call(
        cache_seqlens.astype(np.int32),
        page_table.astype(np.int32),
        capacity=np.int64(config.capacity),
        num_pages=np.int64(config.num_pages),
    )
    return lengths, table
