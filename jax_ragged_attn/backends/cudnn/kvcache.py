"""implementation="cudnn" for ragged_attention_with_kvcache: cuDNN's paged SDPA forward, or the ragged kernel.

Two routes, both forward only:

- "paged": cuDNN's paged SDPA (page tables, cuDNN >= 9.5) through its own handler (backends/cudnn/paged.py,
  ffi/paged_graph.h). Every paged cache goes this way; a contiguous cache [B, L, Hkv, D] can too, viewed as
  pages (paged.as_paged). Page-table entries outside [0, num_pages) are replaced by page 0 before cuDNN sees
  them (never an address outside the cache; the result of a sequence that uses such an entry is then
  unspecified, as on the fa3 path: check=True names the entry). cuDNN's paged kernel loads whole key tiles
  and multiplies the values of rows past a sequence's length by their zero probability (measured on the
  H200, cuDNN 9.19: a NaN-poisoned unused row or page makes the sequence's output NaN), so it reads each
  sequence's head only and the xla path its last TAIL rows (shared/head_tail.py, as FA3's head / tail
  route).
- "ragged": the ragged training kernel over a contiguous cache flattened into a packed buffer [B * L, Hkv, D]
  of fixed-size slots: cu_seqlens_kv = b * L, seqused_kv = cache_seqlens, and the queries [B, Sq, Hq, D] are
  [B * Sq, Hq, D] with cu_seqlens_q = b * Sq. A bottom-right mask puts query i of sequence b on diagonal
  i + cache_seqlens[b] - Sq, the op's query position. Both reshapes are free (no copy).

    B = 2, Sq = 1, L = 4, cache_seqlens [3, 1] -> cu_seqlens_q [0, 1, 2], cu_seqlens_kv [0, 4, 8], seqused_kv [3, 1]

Packed queries (q [T, Hq, D] over cu_seqlens_q, a serving step) take the paged route, with ragged offsets on
the graph's Q, O and stats (paged.attend_packed) and the same head / tail split per row (head_tail.attend_packed); a
contiguous cache through its page view. tests/test_kvcache_varlen.py's CudnnPackedTest passes on it (cuDNN
9.19, H200), decode-only cases included thanks to the packed graphs' 2-row floor (paged.PACKED_MIN_SEQLEN_Q:
one-row graphs with grouped heads get every head but the first of each KV group wrong), so implementation=None
takes this route where FA3 declines a packed call; the main job's serving runs on it
(docs/PERFORMANCE.md#serving-step).

A contiguous cache takes the paged route where it serves the call, else the ragged one. Measured on the
H200 (cuDNN 9.19, decode: one query, GQA 32/8, d 128, bf16, plain loop of jitted calls), paged / ragged in
ms: 8 x 2k 0.095 / 0.085, 8 x 32k 0.675 / 0.824, 64 x 2k 0.247 / 0.470, 256 x 8k 2.06 / 9.97, 64 x 32k
2.05 / 10.16, 256 x 32k 7.55 / out of memory. The ragged kernel zeroes the rows past each length in place,
which on a cache XLA must keep (a jit argument) is a copy of the whole cache per call. Tests pin either
through cuDNN's options, `route` (testing.backend_options).

The ragged kernel keeps NaN in rows past seqused out of its results (tests/test_kvcache.py's
CudnnKVCacheTest, NaN-poisoned caches); tests/test_kvcache_cudnn.py checks the paged route the same way.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_ragged_attn.backends.cudnn import options, paged
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension, known_issues
from jax_ragged_attn.backends.shared import head_tail as kvcache_head_tail
from jax_ragged_attn.config import AttentionConfig, KVCacheConfig
from jax_ragged_attn.index import RaggedIndex

NAME = "cudnn"
ROUTES = ("paged", "ragged")  # OPTIONS.route values this backend reads (tests); others' are not its own
# Rows of each sequence's end the paged kernel never reads (shared/head_tail.py): at least cuDNN's widest key
# tile (128 rows on Hopper), twice that for margin.
TAIL = 256


def tail(config: KVCacheConfig) -> int:
    return kvcache_head_tail.tail_rows(config, TAIL)


def pinned_route(config: KVCacheConfig) -> str | None:
    """The route the tests pinned (OPTIONS.route "paged" or "ragged", contiguous caches), or None."""
    return options.OPTIONS.route if options.OPTIONS.route in ROUTES else None


def ragged_config(config: KVCacheConfig) -> AttentionConfig:
    """The ragged call a contiguous cache becomes (see the module docstring): B sequences of Sq query rows and
    `capacity` key rows each, bottom-right aligned, with the cache call's mask, scale and softcap."""
    return AttentionConfig(
        num_seqs=config.batch,
        capacity_q=config.batch * config.seqlen_q,
        capacity_kv=config.batch * config.capacity,
        num_heads_q=config.num_heads_q,
        num_heads_kv=config.num_heads_kv,
        head_dim_qk=config.head_dim_qk,
        head_dim_v=config.head_dim_v,
        max_seqlen_q=config.seqlen_q,
        max_seqlen_kv=config.capacity,
        dtype=config.dtype,
        scale=config.scale,
        is_causal=config.is_causal,
        diagonal_alignment="bottom_right",
        window_left=config.window_left,
        window_right=config.window_right,
        stats_layout="head_major",
        softcap=config.softcap,
    )


def route(config: KVCacheConfig) -> str:
    """ "paged" or "ragged": how this call runs (see the module docstring). Packed queries: "paged" always."""
    pin = pinned_route(config)
    if config.paged or config.packed or pin == "paged":
        return "paged"
    if pin == "ragged":
        return "ragged"
    if paged_reason(config) is None:
        return "paged"
    return "ragged" if cudnn.unsupported_reason(ragged_config(config)) is None else "paged"


def paged_reason(config: KVCacheConfig) -> str | None:
    """Why the paged route (the graph over each sequence's head, shared/head_tail.py) cannot serve `config`."""
    reason = kvcache_head_tail.window_reason(config, tail(config), "cuDNN's paged graph")
    bounds = kvcache_head_tail.head_bounds(config, tail(config))
    if reason is None and bounds is not None:
        # Upstream bugs of the loaded cuDNN in the paged graph (known_issues.py): a contiguous cache then takes
        # the ragged route, a paged one another backend.
        reason = known_issues.fence("cudnn", "kvcache", config) or paged.unsupported_reason(config, bounds)
    return reason


def attend_packed(q, k_cache, v_cache, lengths, cu_seqlens_q, page_table, config: KVCacheConfig):
    """(out [T, Hq, Dv], lse [Hq, T]) of packed queries (a serving step): the paged graph with ragged Q and O
    over each sequence's head (a contiguous cache through its page view), the xla path over its last TAIL rows,
    merged per row (shared/head_tail.py attend_packed), as the fixed form's paged route."""

    def head_call(q, k_cache, v_cache, head, cu_seqlens_q, page_table, config, left, right):
        return paged.attend_packed(q, k_cache, v_cache, head, cu_seqlens_q, page_table, config, bounds=(left, right))

    return kvcache_head_tail.attend_packed(
        q, k_cache, v_cache, lengths, cu_seqlens_q, page_table, config, head_call, tail(config)
    )


# cuDNN takes ragged Q / O beside page tables from 9.7 (cudnn-frontend's sdpa_support_surface.h); the frontend's
# own paged-prefill sample runs the combination from 9.8.0 only, so below that it is not taken here.
PACKED_MIN_CUDNN = (9, 8, 0)


def packed_version_reason() -> str | None:
    """Why the loaded cuDNN is too old for packed queries over pages, or None."""
    loaded = known_issues.loaded_versions().cudnn
    if loaded is not None and loaded < PACKED_MIN_CUDNN:
        return (
            f"cuDNN {known_issues.format_version(loaded)} is loaded; packed queries (cu_seqlens_q) over a paged "
            f"cache take cuDNN {known_issues.format_version(PACKED_MIN_CUDNN)} or newer here"
        )
    return None


def unsupported_reason(config: KVCacheConfig) -> str | None:
    reason = extension.cudnn_unavailable_reason() or paged.static_reason(config)
    if reason is not None:
        return reason
    if config.packed:  # the paged graph with ragged Q / O, for a contiguous cache too (its page view)
        return packed_version_reason() or paged_reason(config)
    if route(config) == "ragged":
        return cudnn.unsupported_reason(ragged_config(config))
    reason = paged_reason(config)
    if reason is not None and not config.paged and pinned_route(config) is None:
        ragged = cudnn.unsupported_reason(ragged_config(config))
        return (
            f"neither cuDNN route serves this contiguous cache: the ragged kernel ({ragged}) nor the paged graph "
            f"({reason})"
        )
    return reason


def attend(q, k_cache, v_cache, lengths, page_table, config: KVCacheConfig):
    """(out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) from the route `route` picks."""
    if route(config) == "paged":

        def head_call(q, k_cache, v_cache, head, page_table, config, left, right):
            return paged.attend(q, k_cache, v_cache, head, page_table, config, bounds=(left, right))

        return kvcache_head_tail.attend(q, k_cache, v_cache, lengths, page_table, config, head_call, tail(config))
    return _ragged_attend(q, k_cache, v_cache, lengths, config)


def _ragged_attend(q, k_cache, v_cache, lengths, config: KVCacheConfig):
    """(out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) from the ragged cuDNN kernel over the flattened cache."""
    batch, seqlen_q, capacity = config.batch, config.seqlen_q, config.capacity
    ragged = ragged_config(config)
    slots = jnp.arange(batch + 1, dtype=jnp.int32)
    index = RaggedIndex(slots * seqlen_q, slots * capacity, None, lengths)
    flat = (
        q.reshape(batch * seqlen_q, *q.shape[2:]),
        k_cache.reshape(batch * capacity, *k_cache.shape[2:]),
        v_cache.reshape(batch * capacity, *v_cache.shape[2:]),
    )
    # forward_only: the cache op has no gradient, so head groups are sized for the forward's tensors alone.
    out, stats = cudnn.attend(flat, index, ragged, stats=True, forward_only=True)  # stats head-major [Hq, B * Sq]
    out = out.reshape(batch, seqlen_q, config.num_heads_q, config.head_dim_v)
    return out, stats.reshape(config.num_heads_q, batch, seqlen_q).transpose(1, 0, 2)
