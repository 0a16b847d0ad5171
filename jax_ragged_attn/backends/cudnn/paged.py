"""cuDNN's paged SDPA forward (ffi/paged_graph.h) for ragged_attention_with_kvcache: dense queries against
K/V caches read through a page table, one FFI handler of its own (ffi/paged_handler.cc). Packed queries
(`attend_packed`, a serving step's prefill chunks and decode rows) run the same graph with ragged offsets on Q,
O and the stats (token-major [T, Hq], as TransformerEngine's paged THD attention): offset_q[b] =
cu_seqlens_q[b] * Hq * Dqk, seq_len_q[b] = n_b. cuDNN is never told T, and a query tile of the last sequence may
load rows past its end (the frontend's own tests over-allocate packed buffers): q is padded by
PACKED_SPARE_ROWS zero rows and o and the stats get as many, sliced off after.

A paged cache [num_pages, page_size, Hkv, D] is cuDNN's page container as it is (cuDNN takes page sizes that
are powers of 2); a contiguous one [B, L, Hkv, D] is the same viewed as pages of P rows, P the largest power of
2 dividing L (num_pages = B * L / P, table[b] = b * L / P + [0, 1, ...]: a free reshape), which lifts the
ragged route's int32 offsets bound (kvcache.py chooses the route). What the handler gets, per sequence b:

    seq_len_kv[b] = the rows to read, within [0, capacity]       (kvcache.py passes each sequence's head)
    seq_len_q[b]  = Sq, or 0 where seq_len_kv[b] = 0              (no softmax to take: no query is run)
    table[b]      = page_table[b] with entries outside [0, num_pages) replaced by page 0 (safe_page_table),
                    so cuDNN never addresses memory outside the cache

and query i sits at seq_len_kv[b] - Sq + i (cuDNN's bottom-right diagonal over the padding mask's lengths).

    B = 2, Sq = 1, page_size 4, cache_seqlens [6, 0], page_table [[3, 1], [7, -1]]
      -> seq_len_kv [6, 0], seq_len_q [1, 0], table [[3, 1], [0, 0]] (num_pages = 4: 7 and -1 become 0)

Decode steps (Sq = 1) get graphs built for s_q = 1, unlike the ragged graphs (graphs.py: s_q = 1 writes
wrong stats there on the H200, cuDNN 9.19). The paged ones pass every case of tests/test_kvcache.py against
the float64 reference, stats included, on the H200, and cuDNN picks decode kernels for them: 2.8x faster
than the same graphs padded to s_q = 2 (docs/PERFORMANCE.md#what-the-measurements-found, "cuDNN decode graphs").
They are not bit-reproducible: two H200 runs of one call once gave stats one float32 ulp apart (within
every tolerance; the padded graphs have not shown it). MIN_SEQLEN_Q = 2 would pad the queries again
(zeros; seq_len_q keeps the real count). The
workspace is an extra uint8 result sized at trace time, as launch.py does for the training graphs. Rows
cuDNN does not write (queries without keys, padding) hold anything: ops/kvcache.py masks them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.backends.cudnn.graphs import CUDNN_DTYPES, MAX_HEAD_DIM, device_ordinal
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import KVCacheConfig
from jax_ragged_attn.index import row_positions, sanitize_cu_seqlens, sequence_lengths
from jax_ragged_attn.index.kvcache import safe_page_table

TARGET = extension.PAGED_FORWARD_TARGET
# Query rows the graph is built for at least (see the module docstring): 1, true decode graphs.
MIN_SEQLEN_Q = 1
# A packed graph's query dim (max_seqlen_q) is at least 2: its stats are ragged, and a ragged-stats graph of
# one query row with grouped heads writes the stats of the first head of each KV group only (cudnn-frontend
# #1083; cuDNN 9.19 on the H200 shows it too, as the ragged graphs do: graphs.MIN_GRAPH_SEQLEN). The merge
# of head and tail reads those stats, so a decode-only packed step (max_seqlen_q = 1) would come out wrong for
# every head but the first of each group (CudnnPackedTest decode_only checks it). The dim only bounds the rows:
# seq_len_q and the ragged offsets keep each sequence to its own, and the spare rows cover a tile's overreach.
PACKED_MIN_SEQLEN_Q = 2
INT_MAX = 2**31 - 1  # cuDNN's max_seq_len_kv is an int
# Rows past the last query that q, o and the stats of a packed call carry: at least cuDNN's widest query tile
# (128 rows on Hopper), twice it for margin (see the module docstring).
PACKED_SPARE_ROWS = 256
_ATTRIBUTE_TYPES = {"int64": np.int64, "float32": np.float32}


def graph_seqlen_q(config: KVCacheConfig) -> int:
    """Query rows per sequence the graph sees: Sq, padded up to MIN_SEQLEN_Q; packed graphs at least
    PACKED_MIN_SEQLEN_Q."""
    return max(config.seqlen_q, PACKED_MIN_SEQLEN_Q if config.packed else MIN_SEQLEN_Q)


def contiguous_page_size(capacity: int) -> int:
    """The page a contiguous cache of `capacity` rows is viewed in: the largest power of 2 dividing it."""
    return capacity & -capacity


def as_paged(config: KVCacheConfig) -> KVCacheConfig:
    """The paged config cuDNN sees: `config` itself when paged, else the contiguous cache's page view."""
    if config.paged:
        return config
    page = contiguous_page_size(config.capacity)
    per_sequence = config.capacity // page
    return dataclasses.replace(
        config, paged=True, page_size=page, num_pages=config.batch * per_sequence, max_pages=per_sequence
    )


def cache_view(k_cache, v_cache, config: KVCacheConfig):
    """(k, v) as as_paged's view sees them: a paged cache as it is, a contiguous one reshaped (no copy)."""
    if config.paged:
        return k_cache, v_cache
    view = as_paged(config)
    return (
        k_cache.reshape(view.num_pages, view.page_size, *k_cache.shape[2:]),
        v_cache.reshape(view.num_pages, view.page_size, *v_cache.shape[2:]),
    )


def attributes(config: KVCacheConfig, bounds: tuple | None = None) -> dict:
    """The handler's configuration (ffi/paged_config.h's fields, in order) for a call, paged or contiguous
    (as_paged's view). bounds: (left, right), None for no bound; default the config's own."""
    left, right = (config.left_bound, config.right_bound) if bounds is None else bounds
    config = as_paged(config)
    return dict(
        num_seqs=config.batch,
        seqlen_q=graph_seqlen_q(config),
        num_heads_q=config.num_heads_q,
        num_heads_kv=config.num_heads_kv,
        head_dim_qk=config.head_dim_qk,
        head_dim_v=config.head_dim_v,
        num_pages=config.num_pages,
        page_size=config.page_size,
        max_pages=config.max_pages,
        dtype=CUDNN_DTYPES.index(config.dtype),
        scale=float(config.scale),
        softcap=float(config.softcap),
        left_bound=-1 if left is None else int(left),
        right_bound=-1 if right is None else int(right),
        total_q=config.total_q,
    )


def ffi_kwargs(config: KVCacheConfig, bounds: tuple | None = None) -> dict:
    """attributes(), each typed as the extension declares its field."""
    values = attributes(config, bounds)
    fields = extension.module().paged_config_fields()
    if list(values) != [name for name, _ in fields]:
        raise RuntimeError(
            f"paged.attributes builds the fields {list(values)}, but the extension declares "
            f"{[name for name, _ in fields]} (ffi/paged_config.h): the two lists must match"
        )
    return {name: _ATTRIBUTE_TYPES[kind](values[name]) for name, kind in fields}


def static_reason(config: KVCacheConfig) -> str | None:
    """Why the paged graph cannot serve `config` whatever the GPU (dtype, head dims, sizes), or None."""
    if config.dtype not in CUDNN_DTYPES:
        return f"the cuDNN path takes bfloat16 or float16 inputs, got {config.dtype}"
    for name, dim in (("Dqk", config.head_dim_qk), ("Dv", config.head_dim_v)):
        if dim % 8 or dim > MAX_HEAD_DIM:
            return f"cuDNN needs head dims that are multiples of 8 up to {MAX_HEAD_DIM}, got {name}={dim}"
    if config.paged and config.page_size & (config.page_size - 1):
        return f"cuDNN's paged graph takes page sizes that are powers of 2, got page_size={config.page_size}"
    if config.capacity > INT_MAX:
        return (
            f"cuDNN's paged graph takes a capacity (max_pages * page_size = {config.max_pages} * "
            f"{config.page_size}) of at most 2**31 - 1 rows"
        )
    return None


def graph_info(config: KVCacheConfig, bounds: tuple | None = None) -> dict:
    """Builds or finds the graph; raises NotImplementedError if cuDNN cannot run it here."""
    info = extension.module().paged_graph_info(device_ordinal(), attributes(config, bounds))
    if info["status"] == "unsupported":
        raise NotImplementedError(f"cuDNN cannot run this paged configuration: {info['message']}")
    if info["status"] != "ok":
        raise RuntimeError(f"building the cuDNN paged graph failed: {info['message']}")
    return info


def unsupported_reason(config: KVCacheConfig, bounds: tuple | None = None) -> str | None:
    """None when the paged graph serves `config` (with `bounds`) here; else why not (cuDNN's absence first)."""
    reason = extension.cudnn_unavailable_reason()
    if reason is not None:
        return reason
    if "paged_forward" not in extension.module().targets():
        return "the built extension predates the paged handler: rebuild it (scripts/install.sh)"
    reason = static_reason(config)
    if reason is not None:
        return reason
    try:
        graph_info(config, bounds)
    except NotImplementedError as error:
        return str(error)
    return None


def page_table(page_table, config: KVCacheConfig) -> jax.Array:
    """int32 [B, max_pages] the kernel reads: the caller's with entries outside the cache replaced by page 0,
    or, for a contiguous cache (page_table None), its page view's: row b is b * n, ..., b * n + n - 1."""
    if page_table is None:
        per_sequence = as_paged(config).max_pages
        return jnp.arange(config.batch * per_sequence, dtype=jnp.int32).reshape(config.batch, per_sequence)
    return safe_page_table(page_table.astype(jnp.int32), config)


def seq_lens(lengths, config: KVCacheConfig) -> tuple[jax.Array, jax.Array]:
    """(seq_len_q, seq_len_kv) int32 [B]: Sq queries where the sequence has keys, none where it has none."""
    lengths = lengths.astype(jnp.int32)
    return jnp.where(lengths > 0, jnp.int32(config.seqlen_q), jnp.int32(0)), lengths


def attend(q, k_cache, v_cache, lengths, page_table_, config: KVCacheConfig, bounds: tuple | None = None):
    """(out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32) from the paged graph over `lengths` rows of each
    sequence (within [0, capacity]), masks bottom-right on them with `bounds` (left, right), default the
    config's. Rows of queries without keys hold anything."""
    rows = graph_seqlen_q(config)
    workspace = graph_info(config, bounds)["workspace_bytes"]
    k_cache, v_cache = cache_view(k_cache, v_cache, config)
    if rows > config.seqlen_q:
        q = jnp.pad(q, ((0, 0), (0, rows - config.seqlen_q), (0, 0), (0, 0)))
    batch, heads_q = config.batch, config.num_heads_q
    types = (
        jax.ShapeDtypeStruct((batch, rows, heads_q, config.head_dim_v), q.dtype),
        jax.ShapeDtypeStruct((batch, heads_q, rows), jnp.float32),
        jax.ShapeDtypeStruct((workspace,), jnp.uint8),
    )
    seq_len_q, seq_len_kv = seq_lens(lengths, config)
    call = jax.ffi.ffi_call(TARGET, types, vmap_method="sequential")
    no_offsets = jnp.zeros((0,), jnp.int32)  # dense queries: the handler's offsets are unused
    out, lse, _ = call(
        q,
        k_cache,
        v_cache,
        page_table(page_table_, config),
        seq_len_q,
        seq_len_kv,
        no_offsets,
        no_offsets,
        no_offsets,
        **ffi_kwargs(config, bounds),
    )
    return out[:, : config.seqlen_q], lse[:, :, : config.seqlen_q]


def attend_packed(
    q, k_cache, v_cache, lengths, cu_seqlens_q, page_table_, config: KVCacheConfig, bounds: tuple | None = None
):
    """(out [T, Hq, Dv], lse [Hq, T] float32) of packed queries q [T, Hq, D] (config.packed) from the paged
    graph with ragged Q and O (ffi/paged_graph.h): sequence b's n_b queries (its slot of the sanitised
    cu_seqlens_q, at most max_seqlen_q) over `lengths` rows, bottom-right on them (query i on diagonal
    lengths[b] - n_b + i) with `bounds`. Rows of queries without keys, and rows that are no query, hold
    anything in out (cuDNN leaves them unwritten) and -inf in lse."""
    total, heads_q = config.total_q, config.num_heads_q
    padded = dataclasses.replace(config, total_q=total + PACKED_SPARE_ROWS)  # the buffers' rows
    workspace = graph_info(padded, bounds)["workspace_bytes"]
    k_cache, v_cache = cache_view(k_cache, v_cache, config)
    cu = sanitize_cu_seqlens(cu_seqlens_q.astype(jnp.int32), total)
    counts = sequence_lengths(cu, config.seqlen_q)  # <= cu[b + 1] - cu[b]: no row past the real ones is a query
    lengths = lengths.astype(jnp.int32)
    seq_len_q = jnp.where(lengths > 0, counts, jnp.int32(0))  # no keys: no softmax to take
    types = (
        jax.ShapeDtypeStruct((padded.total_q, heads_q, config.head_dim_v), q.dtype),
        jax.ShapeDtypeStruct((padded.total_q, heads_q), jnp.float32),
        jax.ShapeDtypeStruct((workspace,), jnp.uint8),
    )
    call = jax.ffi.ffi_call(TARGET, types, vmap_method="sequential")
    out, lse, _ = call(
        jnp.pad(q, ((0, PACKED_SPARE_ROWS), (0, 0), (0, 0))),
        k_cache,
        v_cache,
        page_table(page_table_, config),
        seq_len_q,
        lengths,
        cu * (heads_q * config.head_dim_qk),
        cu * (heads_q * config.head_dim_v),
        cu * heads_q,
        **ffi_kwargs(padded, bounds),
    )
    owned = row_positions(cu, total, config.seqlen_q)[2]  # rows that are queries (the others hold anything)
    return out[:total], jnp.where(owned[:, None], lse[:total], -jnp.inf).T
