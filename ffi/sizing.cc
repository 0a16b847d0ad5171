#include "sizing.h"

#include "layouts.h"

namespace jax_ragged_attn {

int64_t ragged_span_bytes(int64_t max_total_seq_len, const Dims4& dim, const Dims4& stride, int64_t elem_size) {
  if (max_total_seq_len <= 0) return 0;
  return ((max_total_seq_len - 1) * stride[2] + (dim[1] - 1) * stride[1] + (dim[3] - 1) * stride[3] + 1) * elem_size;
}

int64_t token_stride_only_bytes(int64_t max_total_seq_len, const Dims4& stride, int64_t elem_size) {
  return max_total_seq_len * stride[2] * elem_size;
}

BackwardIntermediates full_extent_backward_intermediates(const AttentionConfig& c, bool dp_workspace_limit_set) {
  constexpr int64_t kFloat = 4;
  BackwardIntermediates sizes;
  const TensorLayout stats = stats_layout(c);
  sizes.softmax_sum = ragged_span_bytes(c.capacity_q, stats.dim, stats.stride, kFloat);
  // The deterministic algorithm keeps dP in a dense workspace of its own instead of accumulating dQ, unless
  // CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT opts into the ordered dQ accumulation; count dQ_accum then too
  // (over-counting only costs the dense fallback, under-counting could hide a short region).
  if (!c.deterministic || dp_workspace_limit_set) {
    const TensorLayout dq = q_layout(c);  // on dQ's strides, packed ones included
    sizes.dq_accum = ragged_span_bytes(c.capacity_q, dq.dim, dq.stride, kFloat);
  }
  if (c.num_heads_q != c.num_heads_kv) {
    // dK and dV are first produced per query head on the dK/dV strides with the token stride scaled by the
    // group size (packed strides included), then reduced over the group.
    const int64_t group = c.num_heads_q / c.num_heads_kv;
    TensorLayout dk = k_layout(c), dv = v_layout(c);
    dk.dim[1] = dv.dim[1] = c.num_heads_q;
    dk.stride[2] *= group;
    dv.stride[2] *= group;
    sizes.dk_fullhead = ragged_span_bytes(c.capacity_kv, dk.dim, dk.stride, kFloat);
    sizes.dv_fullhead = ragged_span_bytes(c.capacity_kv, dv.dim, dv.stride, kFloat);
  }
  return sizes;
}

}  // namespace jax_ragged_attn
