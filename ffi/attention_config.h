// The static configuration of one ragged attention call. It arrives as the FFI call's attributes (decoded
// by name into this struct) and, at trace time, from Python; it is the graph-cache key.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>

namespace jax_ragged_attn {

enum class DType : int64_t { kBFloat16 = 0, kFloat16 = 1 };

// How q, k and v lie in memory. Packed layouts are the fused projections' outputs, read (and their
// gradients written) in place through strides: no split, no concatenate.
enum class Packing : int64_t {
  kSeparate = 0,  // q [Tq, Hq, Dqk], k [Tkv, Hkv, Dqk], v [Tkv, Hkv, Dv]
  kKV = 1,        // q [Tq, Hq, D], kv [Tkv, 2, Hkv, D]
  kQKV = 2,       // qkv [T, 3, H, D] (Tq = Tkv, Hq = Hkv)
};

struct AttentionConfig {
  int64_t num_seqs = 0;     // B
  int64_t capacity_q = 0;   // Tq: rows of q, padding included
  int64_t capacity_kv = 0;  // Tkv
  int64_t num_heads_q = 0;
  int64_t num_heads_kv = 0;
  int64_t head_dim_qk = 0;
  int64_t head_dim_v = 0;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_kv = 0;
  int64_t dtype = 0;  // DType
  float scale = 1.0f;
  int64_t bottom_right = 0;        // diagonal alignment: 0 top-left, 1 bottom-right
  int64_t left_bound = -1;         // keys at most this far left of the diagonal; -1 unbounded
  int64_t right_bound = -1;        // keys at most this far right of the diagonal; -1 unbounded
  int64_t stats_token_major = 0;   // 0: stats [H, T]; 1: stats [T, H]
  int64_t use_max_total_seq_len = 1;  // backward: bound the ragged intermediates by the capacities
  int64_t deterministic = 0;          // backward: cuDNN's deterministic algorithm (bit-identical dQ/dK/dV)
  int64_t plan_index = -1;            // which of cuDNN's candidate plans runs; -1: the heuristic's first choice
  int64_t packing = 0;                // Packing

  auto key() const {
    return std::make_tuple(num_seqs, capacity_q, capacity_kv, num_heads_q, num_heads_kv, head_dim_qk, head_dim_v,
                           max_seqlen_q, max_seqlen_kv, dtype, scale, bottom_right, left_bound, right_bound,
                           stats_token_major, use_max_total_seq_len, deterministic, plan_index, packing);
  }
  bool operator==(const AttentionConfig& other) const { return key() == other.key(); }
  bool operator<(const AttentionConfig& other) const { return key() < other.key(); }

  std::string describe() const {
    std::ostringstream s;
    s << "B=" << num_seqs << " Tq=" << capacity_q << " Tkv=" << capacity_kv << " Hq=" << num_heads_q
      << " Hkv=" << num_heads_kv << " Dqk=" << head_dim_qk << " Dv=" << head_dim_v << " max_seqlen_q=" << max_seqlen_q
      << " max_seqlen_kv=" << max_seqlen_kv << " dtype=" << (dtype == 0 ? "bfloat16" : "float16") << " scale=" << scale
      << " alignment=" << (bottom_right ? "bottom_right" : "top_left") << " left_bound=" << left_bound
      << " right_bound=" << right_bound << " stats=" << (stats_token_major ? "token_major" : "head_major")
      << " max_total_seq_len=" << (use_max_total_seq_len ? "capacity" : "unset")
      << " deterministic=" << deterministic << " plan=" << plan_index
      << " packing=" << (packing == 2 ? "qkv" : packing == 1 ? "kv" : "none");
    return s.str();
  }
};

}  // namespace jax_ragged_attn
