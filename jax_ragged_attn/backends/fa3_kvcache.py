"""implementation="fa3" for ragged_attention_with_kvcache: FlashAttention-3's kvcache kernels.

The flash-attn3-jax wheel's `flash_mha_with_kvcache` is its forward handler `flash_mha_fwd` called in batch
mode (no cu_seqlens) with cache_seqlens as seqused_k and, for a paged cache, the page table; this module calls
that handler itself, registered under our own name by backends/fa3.py (`_registered`), with the same inputs
and attributes the wheel's lowering passes. Forward only (the wheel has no kvcache backward either).

- Lengths: cache_seqlens clamped into [0, capacity] (kvcache_config.clamped_lengths) as seqused_k; FA3 aligns
  its causal mask and windows bottom-right, which is the op's query position (cache_seqlens - Sq + i).
- Page table: entries outside [0, num_pages) are replaced by page 0 before the kernel sees them, so it never
  addresses memory outside the cache; the rows of such an entry are then page 0's (the xla path leaves them
  out instead), so the result of a sequence that uses one is unspecified: check=True names the entry.
- Split-KV: `num_splits` (FA3's flash decoding) from the heuristic in `num_splits`, where B x Hkv query tiles
  would leave most of the GPU's 132 SMs idle; the wheel's caller-sized accumulators come back as outputs.
- Rows with no key, sinks and the stats layout are applied by inputs/kvcache.py.

Caveat, to be measured on the H200 (tests/test_kvcache.py Fa3KVCacheTest, NaN-poisoned unused rows): FA3 loads
whole key tiles and masks only the scores of rows past cache_seqlens, so a NaN in such a row of the last tile
may reach the output (0 * NaN), as measured for the varlen kernel (backends/fa3.py `_cleared`). A cache that
is zero-initialised and filled by kvcache_append holds no NaN there.

Declined, with the reason: dtypes other than bfloat16/float16, head dims other than 128 (the wheel's kernels),
the wheel not installed, no Hopper GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_ragged_attn.backends import fa3
from jax_ragged_attn.backends.kvcache_config import KVCacheConfig, safe_page_table

NAME = "fa3"
# implementation=None picks FA3's kvcache kernels wherever they serve the call: the issue's measurements put
# them at 70-81 % of the H200's bandwidth, 2-4x the ragged cuDNN kernel over a flat cache.
AUTO = True
# Splits of the keys (flash decoding); None: the heuristic below.
NUM_SPLITS: int | None = None
NUM_SMS = 132  # H200
BLOCK_M, BLOCK_N = 128, 128  # FA3's tile for head dim 128 (query rows packed across a GQA group)
MAX_SPLITS = 128


def unsupported_reason(config: KVCacheConfig) -> str | None:
    if config.dtype not in fa3.FA3_DTYPES:
        return f"FlashAttention-3 takes bfloat16 or float16 inputs, got {config.dtype}"
    if config.head_dim_qk != fa3.FA3_HEAD_DIM or config.head_dim_v != fa3.FA3_HEAD_DIM:
        return (f"the {fa3.WHEEL} wheel's kernels are built for head dim {fa3.FA3_HEAD_DIM} only (Dqk = Dv = "
                f"{fa3.FA3_HEAD_DIM}), got Dqk={config.head_dim_qk}, Dv={config.head_dim_v}")
    if config.softcap:
        return (f"the {fa3.WHEEL} wheel's kernels are called with softcap 0 (its binding hard-codes it), got "
                f"softcap={config.softcap}")
    return fa3.unavailable_reason()


def auto_candidate(config: KVCacheConfig) -> bool:
    return AUTO


def num_splits(config: KVCacheConfig) -> int:
    """Key splits so that B x Hkv x query tiles x splits covers the SMs (1 where the tiles alone do)."""
    if NUM_SPLITS is not None:
        return NUM_SPLITS
    tiles = config.batch * config.num_heads_kv * math.ceil(config.seqlen_q * config.group_size / BLOCK_M)
    if tiles >= 0.8 * NUM_SMS:
        return 1
    return max(1, min(math.ceil(NUM_SMS / tiles), math.ceil(config.capacity / BLOCK_N), MAX_SPLITS))


def _window(config: KVCacheConfig) -> tuple[bool, int, int]:
    left = -1 if config.left_bound is None else config.left_bound
    right = -1 if config.right_bound is None else config.right_bound
    return left < 0 and right == 0, left, right


def attend(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig):
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq]) from FA3's forward handler in batch mode."""
    batch, seqlen_q, heads_q, dim = q.shape
    is_causal, left, right = _window(config)
    splits = num_splits(config)
    empty_i32, empty_f32, empty_like_q = (jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32),
                                          jnp.zeros((0,), q.dtype))
    table = empty_i32 if page_table is None else safe_page_table(page_table, config)
    accumulators = ([(splits, batch, heads_q, seqlen_q, dim), (splits, batch, heads_q, seqlen_q)] if splits > 1
                    else [(1, 1, 1, 1), (1, 1, 1)])
    result_types = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                    jax.ShapeDtypeStruct((batch, heads_q, seqlen_q), jnp.float32),
                    *(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in accumulators)]
    out, lse, _, _ = jax.ffi.ffi_call(fa3.TARGET_PREFIX + "flash_mha_fwd", result_types, has_side_effect=False,
                                      vmap_method="sequential", input_layouts=[None] * 21,
                                      output_layouts=[None] * 4)(
        q, k_cache, v_cache,
        empty_like_q, empty_like_q, empty_like_q,  # k_new, v_new, q_v
        empty_i32, empty_i32, empty_i32,  # cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new: batch mode
        empty_i32, lengths,  # seqused_q, seqused_k (= cache_seqlens)
        table, empty_i32, empty_i32,  # page_table, kv_batch_idx, leftpad_k
        empty_like_q, empty_like_q, empty_i32,  # rotary_cos, rotary_sin, seqlens_rotary
        empty_f32, empty_f32, empty_f32,  # q/k/v descale
        empty_i32,  # scheduler_metadata
        # The wheel's lowering: max_seqlen_k is the contiguous cache's L; a paged one's FA3 reads off the table.
        max_seqlen_q=seqlen_q, max_seqlen_q_has_value=True,
        max_seqlen_k=0 if config.paged else config.capacity, max_seqlen_k_has_value=not config.paged,
        softmax_scale_val=float(config.scale), softmax_scale_has_value=True,
        pack_gqa_val=False, pack_gqa_has_value=False,
        is_causal=is_causal, window_size_left=left, window_size_right=right,
        attention_chunk=0, softcap=0.0, is_rotary_interleaved=True, num_splits=splits, sm_margin=0,
    )
    return out, lse
