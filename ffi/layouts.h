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

// q, k, v, o and their gradients: [T, H, D] token-major rows.
inline TensorLayout token_layout(int64_t b, int64_t h, int64_t s, int64_t d) {
  return {{b, h, s, d}, {s * h * d, d, h * d, 1}};
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
