// cuDNN's paged SDPA forward for a KV cache (decoding): dense queries against K/V caches read through a page
// table, built once per (device, PagedConfig) and cached. The training graphs' masks, finalisation and cuDNN
// handle are shared (graph_build.h, graph_cache.h); only the tensors differ:
//
//   q        [B, Sq, Hq, Dqk]                  as cuDNN's (b, h, s, d): strides [Sq*Hq*Dqk, Dqk, Hq*Dqk, 1]
//   k_cache  [num_pages, page_size, Hkv, Dqk]  a container of pages (b = page): strides of that array
//   v_cache  [num_pages, page_size, Hkv, Dv]
//   table    int32 [B, max_pages]              cuDNN's [B, 1, max_pages, 1], one table for K and V
//   seq_len_q, seq_len_kv  int32 [B]           the padding mask; bottom-right: query i of sequence b sits at
//                                              seq_len_kv[b] - seq_len_q[b] + i
//   o        [B, Sq, Hq, Dv]                   like q
//   stats    float32 [B, Hq, Sq]               natural-log log-sum-exp
//
// Packed queries (total_q = T > 0, a serving step's prefill chunks and decode rows in one call): q, o and the
// stats are token-major rows with cuDNN's ragged offsets, q [T, Hq, Dqk], o [T, Hq, Dv], stats float32 [T, Hq],
// sequence b's queries at rows cu[b] .. cu[b] + seq_len_q[b] - 1 (offset_q = cu * Hq * Dqk, offset_o =
// cu * Hq * Dv, offset_stats = cu * Hq, int32 [B + 1], elements), Sq being max_seqlen_q. cuDNN takes ragged
// Q/O beside page tables from 9.7 (cudnn-frontend's sdpa_support_surface.h; its sample from 9.8) and ragged
// stats from 9.6: TransformerEngine's paged THD attention is this graph. The caller keeps seq_len_q[b] <=
// cu[b + 1] - cu[b] and cu within the real rows, and gives the buffers rows to spare past them (Python pads
// q by PACKED_SPARE_ROWS): cuDNN is never told T, and a query tile of the last sequence may load rows past its
// end. T only sizes the buffers: the graph cache keys on whether the queries are packed, not on T.
//
// A contiguous cache [B, L, Hkv, D] is the container with one page per sequence (num_pages = B, page_size = L,
// table[b] = b). cuDNN reads every table entry of a sequence's first ceil(seq_len_kv / page_size) pages: the
// caller keeps them inside [0, num_pages) (Python's safe_page_table).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "graph_build.h"
#include "paged_config.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ragged_attn {

// Tensor UIDs of the paged graph's variant pack.
enum class PagedUid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kPageTable,
  kSeqLenQ,
  kSeqLenKV,
  kOffsetQ,      // packed queries only: cu_seqlens_q * Hq * Dqk
  kOffsetO,      // cu_seqlens_q * Hq * Dv
  kOffsetStats,  // cu_seqlens_q * Hq
};

// Why `config` describes no valid call ("" when it does): sizes below 1, Hq not a multiple of Hkv, an
// unknown dtype, bounds below -1, a capacity past cuDNN's int32 max_seq_len_kv, a negative total_q, packed
// offsets past int32.
std::string paged_config_problem(const PagedConfig& config);

// The cached graph for `config` on `device`, built first on a miss (with the thread in relaxed stream-capture
// mode, as graph_cache.cc builds in a handler). Not-supported configurations come back as kUnimplemented.
xla::ffi::Error paged_graph(int device, const PagedConfig& config, std::shared_ptr<const CachedGraph>* out);

}  // namespace jax_ragged_attn
