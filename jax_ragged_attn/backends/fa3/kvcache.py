"""implementation="fa3" for ragged_attention_with_kvcache: FlashAttention-3's kvcache kernels.

The flash-attn3-jax wheel's `flash_mha_with_kvcache` is its forward handler `flash_mha_fwd` called in batch
mode (no cu_seqlens) with cache_seqlens as seqused_k and, for a paged cache, the page table; this module calls
that handler itself, registered under our own name by backends/fa3/ragged.py (`_registered`), with the same inputs
and attributes the wheel's lowering passes. Forward only (the wheel has no kvcache backward either).

- Lengths: cache_seqlens clamped into [0, capacity] (index.kvcache.clamped_lengths) as seqused_k; FA3 aligns
  its causal mask and windows bottom-right, which is the op's query position (cache_seqlens - Sq + i).
- Page table: entries outside [0, num_pages) are replaced by page 0 before the kernel sees them (by the op
  layer, with the lengths' clamp in one launch: READS_TABLE_UNCHECKED), so it never addresses memory outside
  the cache; the rows of such an entry are then page 0's (the xla path leaves them
  out instead), so the result of a sequence that uses one is unspecified: check=True names the entry.
- Split-KV: `num_splits` (FA3's flash decoding) from the heuristic in `num_splits`, where B x Hkv query tiles
  would leave most of the GPU's 132 SMs idle; the wheel's caller-sized accumulators come back as outputs.
- Rows with no key, sinks and the stats layout are applied by ops/kvcache.py; out's rows with no key are
  FA3's own zeros on the one call (zeroes_rows_without_keys: one launch fewer a decode step).

- Unused rows, one call where FA3 zero-fills them: FA3's paged loader without TMA reads keys and values with
  cp.async predicated on the sequence's length, filling rows past it with zeros, and masks their scores, so a
  NaN in an unused row never reaches the result. FA3 takes that loader for a paged cache whenever Sq x group
  query rows fit in one query tile (get_pagedkv_tma: TMA only past kBlockM rows, 64 or 128 for head dim
  128), which is every decode step. There the op is one FA3 call over the full lengths, a contiguous cache
  read as a paged one with one page per sequence (page_size = L, page_table[b] = b: a free reshape).
- Unused rows, everywhere else (Sq x group > ZERO_FILL_MAX_ROWS, or the route pinned to "head_tail"): FA3
  loads whole key tiles with TMA and masks only the scores of rows past the sequence's length, so a NaN in
  such a row of the last tile reaches the output (0 * NaN; measured on the H200 with NaN-poisoned
  caches, as for the varlen kernel in backends/fa3/ragged.py). So FA3 reads only each sequence's head and the xla
  path its last TAIL rows (TAIL at least FA3's widest key tile), merged through their log-sum-exps
  (shared/head_tail.py, shared with cuDNN's paged route). A left window shorter than TAIL that still reaches
  the head is declined.

Declined, with the reason: dtypes other than bfloat16/float16, head dims other than 128 (the wheel's kernels),
softcap, a left window in (TAIL - Sq, TAIL) on the head / tail route, the wheel not installed, no Hopper GPU.
Tests pin the head / tail route through FA3's options, route="head_tail" (testing.backend_options).
The one call is faster than cuDNN's decode where both serve (docs/PERFORMANCE.md#decode).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.backends.fa3 import options
from jax_ragged_attn.backends.fa3 import ragged as fa3
from jax_ragged_attn.backends.shared import head_tail as kvcache_head_tail
from jax_ragged_attn.backends.shared import known_issues
from jax_ragged_attn.config import KVCacheConfig
from jax_ragged_attn.index.kvcache import query_tiles, rows_with_keys

NAME = "fa3"
# FA3 reads cache_seqlens and the page table without bounds: the op layer hands attend both made safe, in one
# launch on a GPU (backends/shared/cache_index.py).
READS_TABLE_UNCHECKED = True
# implementation=None picks FA3's kvcache kernels wherever they serve the call: the fastest decode here, at
# 72-79 % of the H200's bandwidth and ahead of cuDNN on every row (docs/PERFORMANCE.md#decode).
AUTO = True
NUM_SMS = 132  # H200
BLOCK_M, BLOCK_N = 128, 128  # FA3's tile for head dim 128 (query rows packed across a GQA group)
MAX_SPLITS = 128
MIN_SPLIT_TILES = 16  # key tiles a split holds at least (2,048 keys): see num_splits
# Rows of each sequence's end that FA3 never reads (see the module docstring): at least FA3's widest key tile
# (176 rows for head dim 128 on Hopper), so a tile that starts inside the head ends inside the sequence.
TAIL = 256
# Query rows (Sq x group: FA3 packs a GQA group into one query tile) up to which FA3 reads a paged cache without
# TMA, zero-filling rows past each length. FA3 takes TMA only where Sq x group exceeds its query tile kBlockM
# (get_pagedkv_tma, with a page size that is a multiple of its key tile). Upstream FA3 has a 64-row query tile for
# head dim 128 (one MMA warpgroup, for short queries) beside the 128-row one, so 64 rows are safe on any build;
# the audited flash-attn3-jax 0.2.3 has the 128-row tile only (tile_size_fwd_sm90 in the wheel's sources), so
# 128 rows are safe there. The fixed form's one call keeps 64 (its routes were measured with it); the packed tiles take
# zero_fill_rows(): 128 on the audited wheel, 64 on any other, where a smaller tile could turn TMA on and let a
# NaN in an unused row reach the result.
ZERO_FILL_MAX_ROWS = 64
AUDITED_WHEEL, AUDITED_ZERO_FILL_ROWS = (0, 2, 3), 128


def zero_fill_rows() -> int:
    """The most query rows a tile may hold with FA3's zero-filling loader certain (see above)."""
    return AUDITED_ZERO_FILL_ROWS if known_issues.fa3_version() == AUDITED_WHEEL else ZERO_FILL_MAX_ROWS


def tail(config: KVCacheConfig) -> int:
    return kvcache_head_tail.tail_rows(config, TAIL)


def route(config: KVCacheConfig) -> str:
    """ "one_call" where FA3's zero-filling paged loader serves the call (module docstring), else "head_tail"
    (also where a test pinned it: OPTIONS.route)."""
    if options.OPTIONS.route != "head_tail" and config.seqlen_q * config.group_size <= ZERO_FILL_MAX_ROWS:
        return "one_call"
    return "head_tail"


def unsupported_reason(config: KVCacheConfig) -> str | None:
    if config.packed:
        reason = packed_reason(config)
        if reason is not None:
            return reason
    if config.dtype not in fa3.FA3_DTYPES:
        return f"FlashAttention-3 takes bfloat16 or float16 inputs, got {config.dtype}"
    if config.head_dim_qk != fa3.FA3_HEAD_DIM or config.head_dim_v != fa3.FA3_HEAD_DIM:
        return (
            f"the {fa3.WHEEL} wheel's kernels are built for head dim {fa3.FA3_HEAD_DIM} only (Dqk = Dv = "
            f"{fa3.FA3_HEAD_DIM}), got Dqk={config.head_dim_qk}, Dv={config.head_dim_v}"
        )
    if config.softcap:
        return (
            f"the {fa3.WHEEL} wheel's kernels are called with softcap 0 (its binding hard-codes it), got "
            f"softcap={config.softcap}"
        )
    if not config.packed and route(config) == "head_tail":
        reason = kvcache_head_tail.window_reason(config, tail(config), "FA3")
        if reason is not None:
            return reason
    return fa3.unavailable_reason()


def auto_candidate(config: KVCacheConfig) -> bool:
    return AUTO


def num_splits(config: KVCacheConfig) -> int:
    """Key splits so that B x Hkv x query tiles x splits fills the SMs in one wave (1 where the tiles alone
    come near): a second, partial wave costs more than it splits. Each split keeps at least MIN_SPLIT_TILES key
    tiles: below that the combine kernel costs more than the parallelism gains
    (docs/PERFORMANCE.md#what-the-measurements-found, "FA3's key splits"; tests set OPTIONS.num_splits)."""
    if options.OPTIONS.num_splits is not None:
        return options.OPTIONS.num_splits
    tiles = config.batch * config.num_heads_kv * math.ceil(config.seqlen_q * config.group_size / BLOCK_M)
    if tiles >= 0.8 * NUM_SMS:
        return 1
    return max(1, min(NUM_SMS // tiles, math.ceil(config.capacity / BLOCK_N) // MIN_SPLIT_TILES, MAX_SPLITS))


def _fa3_call(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig, window, used_q=None):
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq]) from FA3's forward handler in batch mode over `lengths` rows of
    each sequence, with the mask `window` = (is_causal, left, right) in FA3's terms. used_q: None, or int32
    [B], FA3's seqused_q: sequence b's queries are its first used_q[b] rows, aligned bottom-right on them.
    page_table: every entry a page of the cache (READS_TABLE_UNCHECKED: the op layer's, or _as_paged's)."""
    batch, seqlen_q, heads_q, dim = q.shape
    is_causal, left, right = window
    # With seqused_q (packed tiles), FA3's split-KV gives results that differ run to run on the H200
    # (flash-attn3-jax 0.2.3: 13 % of a decode-row call's outputs, and NaN from NaN-poisoned caches in some
    # runs, none with the same call without seqused_q): one split there. A mixed step's tiles fill the GPU
    # without splits (num_splits' heuristic gives 1 there anyway); decode rows alone take the fixed form.
    splits = 1 if used_q is not None else num_splits(config)
    empty_i32, empty_f32, empty_like_q = (
        jnp.zeros((0,), jnp.int32),
        jnp.zeros((0,), jnp.float32),
        jnp.zeros((0,), q.dtype),
    )
    table = empty_i32 if page_table is None else page_table
    accumulators = (
        [(splits, batch, heads_q, seqlen_q, dim), (splits, batch, heads_q, seqlen_q)]
        if splits > 1
        else [(1, 1, 1, 1), (1, 1, 1)]
    )
    result_types = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((batch, heads_q, seqlen_q), jnp.float32),
        *(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in accumulators),
    ]
    out, lse, _, _ = jax.ffi.ffi_call(
        fa3.TARGET_PREFIX + "flash_mha_fwd",
        result_types,
        has_side_effect=False,
        vmap_method="sequential",
        input_layouts=[None] * 21,
        output_layouts=[None] * 4,
    )(
        q,
        k_cache,
        v_cache,
        empty_like_q,
        empty_like_q,
        empty_like_q,  # k_new, v_new, q_v
        empty_i32,
        empty_i32,
        empty_i32,  # cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new: batch mode
        empty_i32 if used_q is None else used_q,
        lengths,  # seqused_q, seqused_k (= cache_seqlens)
        table,
        empty_i32,
        empty_i32,  # page_table, kv_batch_idx, leftpad_k
        empty_like_q,
        empty_like_q,
        empty_i32,  # rotary_cos, rotary_sin, seqlens_rotary
        empty_f32,
        empty_f32,
        empty_f32,  # q/k/v descale
        empty_i32,  # scheduler_metadata
        # The wheel's lowering: max_seqlen_k is the contiguous cache's L; a paged one's FA3 reads off the table.
        max_seqlen_q=seqlen_q,
        max_seqlen_q_has_value=True,
        max_seqlen_k=0 if config.paged else config.capacity,
        max_seqlen_k_has_value=not config.paged,
        softmax_scale_val=float(config.scale),
        softmax_scale_has_value=True,
        pack_gqa_val=False,
        pack_gqa_has_value=False,
        is_causal=is_causal,
        window_size_left=left,
        window_size_right=right,
        attention_chunk=0,
        softcap=0.0,
        is_rotary_interleaved=True,
        num_splits=splits,
        sm_margin=0,
    )
    return out, lse


def attend(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig):
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq]) through the route that keeps unused rows out (module docstring)."""
    if route(config) == "one_call":
        return _one_call(q, k_cache, v_cache, lengths, page_table, config)
    return _head_tail(q, k_cache, v_cache, lengths, page_table, config)


def _as_paged(k_cache, v_cache, page_table, config: KVCacheConfig):
    """A contiguous cache [B, L, Hkv, D] as a paged one of B pages of L rows, page_table[b] = b (no copy; the
    table a NumPy constant, which XLA embeds: no kernel computes it)."""
    if config.paged:
        return k_cache, v_cache, page_table, config
    table = np.arange(config.batch, dtype=np.int32)[:, None]
    paged = dataclasses.replace(config, paged=True, page_size=config.capacity, num_pages=config.batch, max_pages=1)
    return k_cache, v_cache, table, paged


def _one_call(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig):
    """One FA3 call over each sequence's full length, through the paged loader that zero-fills past it."""
    k_cache, v_cache, page_table, paged = _as_paged(k_cache, v_cache, page_table, config)
    left, right = config.left_bound, config.right_bound
    # Bottom-right over the full lengths: the op's masks are FA3's own (causal: no left bound, right bound 0).
    window = (left is None and right == 0, -1 if left is None else left, -1 if right is None else right)
    out, lse = _fa3_call(q, k_cache, v_cache, lengths, page_table, paged, window)
    # A query without keys (a band that misses its sequence): FA3's lse is +inf there, the op's -inf. Its out is
    # FA3's own 0 where zeroes_rows_without_keys says so (the op layer masks it everywhere else).
    has_keys = rows_with_keys(lengths, config)  # [B, Sq]
    return out, jnp.where(has_keys[:, None, :], lse, -jnp.inf)


def zeroes_rows_without_keys(config: KVCacheConfig) -> bool:
    """True where attend's out is exactly 0 on a query without keys, so the op layer need not mask it (one
    launch fewer: at 8 x 2k decode a call is tens of microseconds, mostly launches). The one call on the
    audited wheel only: FA3 stores zeros where a query tile has no key tile (a sequence of length 0); in a tile
    with keys for other rows it multiplies the row's probabilities, all exactly 0 (every score masked, the
    softmax's -inf guard), by value rows that are the sequence's own or zero-filled past its length (the module
    docstring), and scales by a finite inverse sum; its split combine gives a row whose splits all have lse -inf
    the scale 0. Exact as long as the rows in use hold finite values, which a query with keys needs as well.
    tests/test_kvcache.py checks the zeros of such queries on NaN-poisoned caches (lengths 0 and below Sq)."""
    return not config.packed and route(config) == "one_call" and known_issues.fa3_version() == AUDITED_WHEEL


def _head_tail(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig):
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq]): FA3 over each sequence's head, the xla path over its last TAIL
    rows (shared/head_tail.py)."""

    def head_call(q, k_cache, v_cache, head, page_table, config, left, right):
        window = (False, -1 if left is None else left, -1 if right is None else right)
        return _fa3_call(q, k_cache, v_cache, head, page_table, config, window)

    return kvcache_head_tail.attend(q, k_cache, v_cache, lengths, page_table, config, head_call, tail(config))


# ---- packed queries (config.packed) ------------------------------------------------------------------------
#
# The wheel's forward handler cannot take cu_seqlens_q with a paged cache: in varlen-q mode it reads the value
# head dim off v's third dimension (head_size_v = v.dimensions()[2], csrc/flash_attn/flash.cpp), which for a
# cache [num_pages, page_size, Hkv, D] is Hkv, and its check on differing head dims then refuses head dim 128.
# So the packed rows run in batch mode, as tiles (index.kvcache.query_tiles): tile n holds up to `size`
# consecutive queries of one sequence, q [N, size, Hq, D] gathered from the packed rows, seqused_q = its
# query count, its sequence's page-table row, and seqused_k = its last query's position + 1, so that FA3's
# bottom-right diagonal (seqused_k - seqused_q + i) is each query's position. size x group <= packed_tile_rows()
# keeps every tile one of FA3's query tiles (GQA packed into it, as FA3's own varlen kernel packs it), so a
# sequence's chunk of queries reads its keys once per 128 query rows, as in FA3's own varlen call, and FA3
# takes its paged loader without TMA (get_pagedkv_tma: seqlen_q x group > kBlockM only), which zero-fills
# rows past seqused_k: no NaN in an unused row or page reaches the result, whatever the page size.
#
# Cutting a sequence's keys at its tile's last query keeps every key a causal query attends (none lies right
# of it). A mask with keys right of the diagonal (non-causal, a right window) cannot be cut so: there each
# sequence is one tile (size = max_seqlen_q), served where max_seqlen_q x group fits one query tile.
#
# Decode rows only (max_seqlen_q = 1): the tiles are the sequences that have a query, run through the fixed
# form's attend (q [N, 1, Hq, D], N <= B: today's decode call, its split-KV heuristic included).


def packed_tile_rows(config: KVCacheConfig) -> int:
    """Query rows a packed tile holds: zero_fill_rows() (FA3's 128-row query tile for head dim 128 on the audited
    wheel), or the tests' smaller one (OPTIONS.packed_tile_rows)."""
    return options.OPTIONS.packed_tile_rows or zero_fill_rows()


def packed_tile(config: KVCacheConfig) -> int:
    """Queries per tile of a packed call (see above)."""
    if config.right_bound != 0:
        return config.seqlen_q
    return max(1, min(config.seqlen_q, packed_tile_rows(config) // config.group_size))


def packed_reason(config: KVCacheConfig) -> str | None:
    """Why FA3 cannot serve packed queries with this config (beyond unsupported_reason's), or None."""
    rows = packed_tile_rows(config)
    if config.group_size > rows:
        return (
            f"FA3 serves packed queries in tiles of at most {rows} query rows with the GQA group "
            f"packed in; a group of {config.group_size} query heads per kv head does not fit one"
        )
    if config.right_bound != 0 and config.seqlen_q * config.group_size > rows:
        return (
            f"packed queries with keys right of the diagonal (is_causal=False or a right window) run on FA3 "
            f"as one tile per sequence, which needs max_seqlen_q x (Hq / Hkv) <= {rows} (beyond it "
            f"FA3 loads whole key tiles with TMA and a NaN in an unused cache row would reach the result), got "
            f"{config.seqlen_q} x {config.group_size}; use is_causal=True or implementation='xla'"
        )
    return None


def attend_packed(q, k_cache, v_cache, lengths, cu_seqlens_q, page_table, config: KVCacheConfig):
    """(out [T, Hq, D], lse [Hq, T]) of packed queries q [T, Hq, D]: one FA3 call over tiles (see above)."""
    size = packed_tile(config)
    tiles = query_tiles(cu_seqlens_q, lengths, config, size)
    k_cache, v_cache, page_table, paged = _as_paged(k_cache, v_cache, page_table, config)
    page_table = jnp.asarray(page_table)  # gathered by tile below (a traced index)
    length = lengths[tiles.sequence]
    if config.seqlen_q == 1:  # decode rows only: the fixed form's call (today's decode kernel) on the tiles
        tile_config = dataclasses.replace(paged, batch=tiles.count, seqlen_q=1, total_q=0)
        out, lse = attend(tiles.gather(q), k_cache, v_cache, length, page_table[tiles.sequence], tile_config)
        return tiles.to_rows(out, 0), tiles.to_rows(lse.transpose(0, 2, 1), -jnp.inf).T
    # The tile's keys end at its last query's position (causal), or at the sequence's end (one tile each).
    keys = length if config.right_bound != 0 else jnp.clip(tiles.first_position + tiles.used, 0, length)
    tile_config = dataclasses.replace(paged, batch=tiles.count, seqlen_q=size, total_q=0)
    left, right = config.left_bound, config.right_bound
    window = (left is None and right == 0, -1 if left is None else left, -1 if right is None else right)
    out, lse = _fa3_call(
        tiles.gather(q), k_cache, v_cache, keys, page_table[tiles.sequence], tile_config, window, used_q=tiles.used
    )
    # A query without keys holds FA3's lse +inf and anything in out: the op layer masks those rows (the
    # backend Protocol), so the rows are gathered as they come.
    return tiles.to_rows(out, 0), tiles.to_rows(lse.transpose(0, 2, 1), -jnp.inf).T
