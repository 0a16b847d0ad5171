// Byte sizes of the float32 intermediates that cuDNN's ragged SDPA backward lays out on the strides
// of a user tensor. Pure arithmetic, no cuDNN: exported to Python and unit-tested on machines without a GPU.
#pragma once

#include <array>
#include <cstdint>

#include "attention_config.h"

namespace jax_ragged_attn {

using Dims4 = std::array<int64_t, 4>;

// Bytes spanned by a [B, H, S, D] tensor whose batch axis is replaced by ragged offsets and whose token
// axis runs over at most `max_total_seq_len` rows. Every axis contributes its own extent:
//
//   ((max_total - 1) * stride[2] + (dim[1] - 1) * stride[1] + (dim[3] - 1) * stride[3] + 1) * elem_size
//
// cudnn-frontend up to 1.27 sized these buffers as `max_total * stride[2] * elem_size`, which is only
// right when the token axis is the outermost one (token-major). For head-major stats (stride[2] == 1)
// that is h times too small, the backward overwrites the engine state stored after it, and every
// gradient comes back zero with no error.
int64_t ragged_span_bytes(int64_t max_total_seq_len, const Dims4& dim, const Dims4& stride, int64_t elem_size);

// What the pre-1.28 frontend reserved for the same tensor; kept to show (and test) the difference.
int64_t token_stride_only_bytes(int64_t max_total_seq_len, const Dims4& stride, int64_t elem_size);

struct BackwardIntermediates {
  int64_t softmax_sum = 0;  // float32 on the Stats strides
  int64_t dq_accum = 0;     // float32 on the dQ strides
  int64_t dk_fullhead = 0;  // float32 dK per query head (GQA/MQA only)
  int64_t dv_fullhead = 0;  // float32 dV per query head (GQA/MQA only)
  int64_t total() const { return softmax_sum + dq_accum + dk_fullhead + dv_fullhead; }
};

// The full-extent sizes of every intermediate a ragged backward graph with max_total_seq_len set to the
// buffer capacities needs; the frontend's own workspace region must be at least `total()`.
// `dp_workspace_limit_set`: CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT is set (BuildSettings), which can make a
// deterministic backward accumulate dQ too.
BackwardIntermediates full_extent_backward_intermediates(const AttentionConfig& config, bool dp_workspace_limit_set);

}  // namespace jax_ragged_attn
