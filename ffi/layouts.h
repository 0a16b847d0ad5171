// Dims and strides of every tensor as cuDNN sees it: logical [B, H, S, D] over the packed THD buffers.
//
// A packed buffer [T, H, D] holds sequence b at rows cu[b]..cu[b+1]. cuDNN addresses element (b, h, s, d)
// at ragged_offset[b] + h*stride[1] + s*stride[2] + d*stride[3], so the batch stride is unused and the
// ragged offset of sequence b is cu[b] times the token stride (H*D), in elements.
#pragma once

#include <array>
#include <cstdint>

#include "attention_config.h"

namespace jax_ragged_attn {

struct TensorLayout {
  std::array<int64_t, 4> dim;
  std::array<int64_t, 4> stride;
};

// q, k, v, o and their gradients: token-major rows of `token_stride` elements (H*D when the tensor has its
// own buffer; 2*H*D or 3*H*D when it is one part of a packed kv or qkv buffer).
inline TensorLayout token_layout(int64_t b, int64_t h, int64_t s, int64_t d, int64_t token_stride) {
  return {{b, h, s, d}, {s * token_stride, d, token_stride, 1}};
}
inline TensorLayout token_layout(int64_t b, int64_t h, int64_t s, int64_t d) { return token_layout(b, h, s, d, h * d); }

// Elements from one token's row to the next, and where in that row each part starts, per packing.
inline int64_t parts(const AttentionConfig& c, bool kv_side) {
  if (c.packing == static_cast<int64_t>(Packing::kQKV)) return 3;
  return kv_side && c.packing == static_cast<int64_t>(Packing::kKV) ? 2 : 1;
}
inline int64_t q_token_stride(const AttentionConfig& c) { return parts(c, false) * c.num_heads_q * c.head_dim_qk; }
inline int64_t k_token_stride(const AttentionConfig& c) { return parts(c, true) * c.num_heads_kv * c.head_dim_qk; }
inline int64_t v_token_stride(const AttentionConfig& c) { return parts(c, true) * c.num_heads_kv * c.head_dim_v; }
// Start of k and v within a packed row, in elements (q always starts at 0): [q | k | v] or [k | v].
inline int64_t k_part_offset(const AttentionConfig& c) {
  return c.packing == static_cast<int64_t>(Packing::kQKV) ? c.num_heads_q * c.head_dim_qk : 0;
}
inline int64_t v_part_offset(const AttentionConfig& c) {
  return k_part_offset(c) +
         (c.packing == static_cast<int64_t>(Packing::kSeparate) ? 0 : c.num_heads_kv * c.head_dim_qk);
}

// What a packed layout relies on, or nullptr: the parts share one row, so they share its head dim (and,
// for qkv, its rows and heads). Any other combination would make a part's strides run past its buffer.
inline const char* packing_violation(const AttentionConfig& c) {
  if (c.packing < 0 || c.packing > 2) return "packing must be 0 (separate), 1 (kv) or 2 (qkv)";
  if (c.packing != static_cast<int64_t>(Packing::kSeparate) && c.head_dim_qk != c.head_dim_v) {
    return "packed k and v need Dqk == Dv";
  }
  if (c.packing == static_cast<int64_t>(Packing::kQKV) &&
      (c.num_heads_q != c.num_heads_kv || c.capacity_q != c.capacity_kv)) {
    return "packed qkv needs Hq == Hkv and Tq == Tkv";
  }
  return nullptr;
}

// q/dq, k/dk, v/dv and o/do as cuDNN addresses them.
inline TensorLayout q_layout(const AttentionConfig& c) {
  return token_layout(c.num_seqs, c.num_heads_q, c.max_seqlen_q, c.head_dim_qk, q_token_stride(c));
}
inline TensorLayout k_layout(const AttentionConfig& c) {
  return token_layout(c.num_seqs, c.num_heads_kv, c.max_seqlen_kv, c.head_dim_qk, k_token_stride(c));
}
inline TensorLayout v_layout(const AttentionConfig& c) {
  return token_layout(c.num_seqs, c.num_heads_kv, c.max_seqlen_kv, c.head_dim_v, v_token_stride(c));
}
inline TensorLayout o_layout(const AttentionConfig& c) {
  return token_layout(c.num_seqs, c.num_heads_q, c.max_seqlen_q, c.head_dim_v);
}

// The softmax log-sum-exp, float32, one value per (token, head).
//   head-major [H, T]:  (b, h, s) at cu[b] + h*T + s   -> strides [H*T, T, 1, 1], offsets cu
//   token-major [T, H]: (b, h, s) at (cu[b] + s)*H + h -> strides [S*H, 1, H, 1], offsets cu*H
inline TensorLayout stats_layout(const AttentionConfig& c) {
  const int64_t b = c.num_seqs, h = c.num_heads_q, s = c.max_seqlen_q, t = c.capacity_q;
  if (c.stats_token_major) return {{b, h, s, 1}, {s * h, 1, h, 1}};
  return {{b, h, s, 1}, {h * t, t, 1, 1}};
}

}  // namespace jax_ragged_attn
