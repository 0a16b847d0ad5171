// The static configuration of one paged KV-cache forward (paged_graph.h): the FFI call's attributes, the
// dict Python hands the trace-time query, and the key of the cached graph.
//
// Fields are declared once, in JAX_RAGGED_ATTN_PAGED_FIELDS; the struct, its key, describe(), the attribute
// decoding (paged_handler.cc), the dict decoding and the exported field list (module.cc) come from it. Python
// builds the values in jax_ragged_attn/backends/cudnn/paged.py (`attributes`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>

#include "attention_config.h"

namespace jax_ragged_attn {

// X(type, name, label in describe()). The order is the struct's and the exported list's.
#define JAX_RAGGED_ATTN_PAGED_FIELDS(X)                                                                         \
  X(int64_t, num_seqs, "B")                                                                                     \
  X(int64_t, seqlen_q, "Sq") /* query rows per sequence as the graph sees them (packed: max_seqlen_q) */        \
  X(int64_t, num_heads_q, "Hq")                                                                                 \
  X(int64_t, num_heads_kv, "Hkv")                                                                               \
  X(int64_t, head_dim_qk, "Dqk")                                                                                \
  X(int64_t, head_dim_v, "Dv")                                                                                  \
  X(int64_t, num_pages, "num_pages") /* pages in the cache (a contiguous cache: B) */                           \
  X(int64_t, page_size, "page_size") /* rows per page (a contiguous cache: L) */                                \
  X(int64_t, max_pages, "max_pages") /* page-table entries per sequence (a contiguous cache: 1) */              \
  X(int64_t, dtype, "dtype")         /* DType: 0 bfloat16, 1 float16 */                                         \
  X(float, scale, "scale")                                                                                      \
  X(float, softcap, "softcap")           /* > 0: scores capped to softcap * tanh(s / softcap); 0: no cap */     \
  X(int64_t, left_bound, "left_bound")   /* keys at most this far left of the query's position; -1 unbounded */ \
  X(int64_t, right_bound, "right_bound") /* at most this far right (0: causal); -1 unbounded */                 \
  X(int64_t, total_q, "T") /* packed queries: q, o [T, Hq, D] at ragged offsets; 0: dense [B, Sq, Hq, D] */

struct PagedConfig {
#define JAX_RAGGED_ATTN_PAGED_MEMBER(type, name, label) type name = 0;
  JAX_RAGGED_ATTN_PAGED_FIELDS(JAX_RAGGED_ATTN_PAGED_MEMBER)
#undef JAX_RAGGED_ATTN_PAGED_MEMBER

  // Every field: a graph is reused only for a configuration equal in all of them.
  auto key() const {
#define JAX_RAGGED_ATTN_PAGED_KEY(type, name, label) std::make_tuple(name),
    return std::tuple_cat(JAX_RAGGED_ATTN_PAGED_FIELDS(JAX_RAGGED_ATTN_PAGED_KEY) std::tuple<>());
#undef JAX_RAGGED_ATTN_PAGED_KEY
  }
  bool operator<(const PagedConfig& other) const { return key() < other.key(); }
  bool operator==(const PagedConfig& other) const { return key() == other.key(); }

  // Calls f(name, field) for every field of `self`, in order (as AttentionConfig::for_each_field).
  template <typename Self, typename F>
  static void for_each_field(Self& self, F&& f) {
#define JAX_RAGGED_ATTN_PAGED_VISIT(type, name, label) f(#name, self.name);
    JAX_RAGGED_ATTN_PAGED_FIELDS(JAX_RAGGED_ATTN_PAGED_VISIT)
#undef JAX_RAGGED_ATTN_PAGED_VISIT
  }

  int64_t max_seq_len_kv() const { return max_pages * page_size; }
  bool packed() const { return total_q > 0; }
  // Rows of the q and o buffers: T packed, B * Sq dense.
  int64_t query_rows() const { return packed() ? total_q : num_seqs * seqlen_q; }

  // "paged B=2 Sq=2 ...": every field, for error messages.
  std::string describe() const {
    std::ostringstream s;
    s << "paged";
#define JAX_RAGGED_ATTN_PAGED_DESCRIBE(type, name, label) s << " " << label << "=" << name;
    JAX_RAGGED_ATTN_PAGED_FIELDS(JAX_RAGGED_ATTN_PAGED_DESCRIBE)
#undef JAX_RAGGED_ATTN_PAGED_DESCRIBE
    return s.str();
  }
};

#define JAX_RAGGED_ATTN_PAGED_ENTRY(type, name, label) {#name, attribute_type<type>()},
inline constexpr ConfigField kPagedConfigFields[] = {JAX_RAGGED_ATTN_PAGED_FIELDS(JAX_RAGGED_ATTN_PAGED_ENTRY)};
#undef JAX_RAGGED_ATTN_PAGED_ENTRY

}  // namespace jax_ragged_attn
