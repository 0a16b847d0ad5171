#include "graph_build.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <optional>
#include <vector>

#include "build_fallback.h"
#include "check.h"
#include "cudnn_frontend_version.h"
#include "cudnn_library.h"
#include "layouts.h"
#include "sizing.h"

// The same guard as CMakeLists.txt, for builds that do not go through it (BUILD): frontends before 1.28 size
// the ragged backward's head-major softmax_sum h_q times too small, and every gradient comes back zero.
#if (CUDNN_FRONTEND_MAJOR_VERSION * 100 + CUDNN_FRONTEND_MINOR_VERSION) < 128 && \
    !defined(JAX_RAGGED_ATTN_ALLOW_OLD_FRONTEND)
#error "cudnn-frontend >= 1.28 is required (define JAX_RAGGED_ATTN_ALLOW_OLD_FRONTEND only to test the fallback)"
#endif

namespace jax_ragged_attn {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

std::vector<int64_t> as_vector(const std::array<int64_t, 4>& a) { return {a.begin(), a.end()}; }
int64_t uid(TensorUid u) { return static_cast<int64_t>(u); }

fe::DataType_t io_data_type(const AttentionConfig& c) {
  return c.dtype == static_cast<int64_t>(DType::kFloat16) ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

// Tensors shared by the forward and the backward graph.
struct GraphInputs {
  TensorPtr seq_len_q, seq_len_kv;
  TensorPtr offset_q, offset_k, offset_v, offset_o, offset_stats;
  TensorPtr q, k, v;
};

TensorPtr index_tensor(fe::graph::Graph& g, TensorUid id, const char* name, int64_t n) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid(id))
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

TensorPtr ragged_tensor(fe::graph::Graph& g, TensorUid id, const char* name, const TensorLayout& layout,
                        const TensorPtr& offset, fe::DataType_t type) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid(id))
                      .set_dim(as_vector(layout.dim))
                      .set_stride(as_vector(layout.stride))
                      .set_ragged_offset(offset)
                      .set_data_type(type));
}

void mark_output(const TensorPtr& t, TensorUid id, const TensorLayout& layout, const TensorPtr& offset,
                 fe::DataType_t type) {
  t->set_output(true)
      .set_uid(uid(id))
      .set_dim(as_vector(layout.dim))
      .set_stride(as_vector(layout.stride))
      .set_ragged_offset(offset)
      .set_data_type(type);
}

GraphInputs declare_inputs(fe::graph::Graph& g, const AttentionConfig& c) {
  const int64_t b = c.num_seqs;
  const fe::DataType_t io = io_data_type(c);
  GraphInputs in;
  in.seq_len_q = index_tensor(g, TensorUid::kSeqLenQ, "seq_len_q", b);
  in.seq_len_kv = index_tensor(g, TensorUid::kSeqLenKV, "seq_len_kv", b);
  in.offset_q = index_tensor(g, TensorUid::kOffsetQ, "offset_q", b + 1);
  in.offset_k = index_tensor(g, TensorUid::kOffsetK, "offset_k", b + 1);
  in.offset_v = index_tensor(g, TensorUid::kOffsetV, "offset_v", b + 1);
  in.offset_o = index_tensor(g, TensorUid::kOffsetO, "offset_o", b + 1);
  in.offset_stats = index_tensor(g, TensorUid::kOffsetStats, "offset_stats", b + 1);
  in.q = ragged_tensor(g, TensorUid::kQ, "q", q_layout(c), in.offset_q, io);
  in.k = ragged_tensor(g, TensorUid::kK, "k", k_layout(c), in.offset_k, io);
  in.v = ragged_tensor(g, TensorUid::kV, "v", v_layout(c), in.offset_v, io);
  return in;
}

// Padding mask from the per-sequence lengths, and causal / window limits as cuDNN diagonal bands.
template <typename Attributes>
void apply_masking(Attributes& attributes, const AttentionConfig& c, const GraphInputs& in) {
  attributes.set_padding_mask(true).set_seq_len_q(in.seq_len_q).set_seq_len_kv(in.seq_len_kv);
  if (c.left_bound < 0 && c.right_bound < 0) return;
  attributes.set_diagonal_alignment(c.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                                   : fe::DiagonalAlignment_t::TOP_LEFT);
  // cuDNN keeps key j when j + left_bound > diagonal, so its bound counts the diagonal itself: ours + 1.
  if (c.left_bound >= 0) {
    attributes.set_diagonal_band_left_bound(static_cast<int>(std::min<int64_t>(c.left_bound + 1, INT_MAX)));
  }
  if (c.right_bound >= 0) {
    attributes.set_diagonal_band_right_bound(static_cast<int>(std::min<int64_t>(c.right_bound, INT_MAX)));
  }
}

// Logit soft-capping (c > 0): scores s = scale * q.k become c * tanh(s / c) through the SDPA's score modifier,
// and the backward's dS of the capped scores is multiplied by 1 - tanh^2 (score_mod_bprop) before the scale.
// cudnn-frontend refuses its built-in padding and band masks beside a score modifier ("Attention score mod
// enabled and hence other subgraphs are disabled"), so the modifier applies them itself, after the cap, with
// the frontend's own helpers and in its built-in order (modifier, padding mask, band mask). The lengths are
// still set on the attributes: they bound the matmuls of every sequence (m/n overrides).
using Softcap = fe::graph::attn::score_modifiers::Softcap;

template <typename Attributes>
void apply_softcap_and_masking(Attributes& attributes, const AttentionConfig& c, const GraphInputs& in,
                               const std::shared_ptr<Softcap>& softcap) {
  attributes.set_seq_len_q(in.seq_len_q).set_seq_len_kv(in.seq_len_kv);
  // A pass-by-value scalar: its value is part of the graph, hence of the cache key (attention_config.h).
  auto cap = std::make_shared<fe::graph::Tensor_attributes>(c.softcap);
  attributes.set_score_mod([c, seq_q = in.seq_len_q, seq_kv = in.seq_len_kv, softcap, cap](
                               std::shared_ptr<fe::graph::Graph> g, TensorPtr score) {
    namespace mods = fe::graph::attn::score_modifiers;
    score = mods::padding_mask(g, softcap->forward(g, score, cap), seq_kv, seq_q);
    if (c.left_bound < 0 && c.right_bound < 0) return score;
    // The bounds as apply_masking hands them to the built-in band: cuDNN's left bound counts the diagonal.
    std::optional<int64_t> left, right;
    if (c.left_bound >= 0) left = std::min<int64_t>(c.left_bound + 1, INT_MAX);
    if (c.right_bound >= 0) right = std::min<int64_t>(c.right_bound, INT_MAX);
    const auto alignment = c.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT : fe::DiagonalAlignment_t::TOP_LEFT;
    return mods::sliding_window_mask(g, score, alignment, left, right, c.max_seqlen_q, c.max_seqlen_kv, seq_q, seq_kv,
                                     /*cu_s_q_ptr=*/nullptr, /*cu_s_kv_ptr=*/nullptr);
  });
}

// The backward's half: dS * c, TANH_BWD against the pre-tanh scores the forward half saved in `softcap` while
// the backward graph recomputed them, / c (the frontend's Softcap::backward).
void apply_softcap_bprop(fe::graph::SDPA_backward_attributes& attributes, const AttentionConfig& c,
                         const std::shared_ptr<Softcap>& softcap) {
  auto cap = std::make_shared<fe::graph::Tensor_attributes>(c.softcap);
  attributes.set_score_mod_bprop([softcap, cap](std::shared_ptr<fe::graph::Graph> g, TensorPtr d_score) {
    return softcap->backward(g, d_score, cap);
  });
}

xla::ffi::Error finalize(InspectableGraph& g, cudnnHandle_t handle, const AttentionConfig& c, bool tuning,
                         CachedGraph* out) {
  return finalize_graph(g, handle, c.plan_index, c.describe(), tuning, out);
}

xla::ffi::Error build_forward(cudnnHandle_t handle, const AttentionConfig& c, bool tuning,
                              fe::AttentionImplementation_t implementation, CachedGraph* out) {
  auto g = std::make_shared<InspectableGraph>();
  g->set_io_data_type(io_data_type(c))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const GraphInputs in = declare_inputs(*g, c);

  fe::graph::SDPA_attributes attributes;
  attributes.set_name("ragged_sdpa_forward")
      .set_generate_stats(true)
      .set_attn_scale(c.scale)
      .set_implementation(implementation);
  apply_forward_masks(attributes, c, in.seq_len_q, in.seq_len_kv);
  auto [o, stats] = g->sdpa(in.q, in.k, in.v, attributes);
  mark_output(o, TensorUid::kO, o_layout(c), in.offset_o, io_data_type(c));
  mark_output(stats, TensorUid::kStats, stats_layout(c), in.offset_stats, fe::DataType_t::FLOAT);

  FFI_RETURN_IF_ERROR(finalize(*g, handle, c, tuning, out));
  out->graph = std::move(g);
  return xla::ffi::Error::Success();
}

xla::ffi::Error build_backward(cudnnHandle_t handle, const AttentionConfig& c, bool max_total, bool tuning,
                               CachedGraph* out) {
  auto g = std::make_shared<InspectableGraph>();
  const fe::DataType_t io = io_data_type(c);
  g->set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const GraphInputs in = declare_inputs(*g, c);
  auto o = ragged_tensor(*g, TensorUid::kO, "o", o_layout(c), in.offset_o, io);
  auto d_o = ragged_tensor(*g, TensorUid::kDO, "d_o", o_layout(c), in.offset_o, io);
  auto stats = ragged_tensor(*g, TensorUid::kStats, "stats", stats_layout(c), in.offset_stats, fe::DataType_t::FLOAT);

  fe::graph::SDPA_backward_attributes attributes;
  attributes.set_name("ragged_sdpa_backward").set_attn_scale(c.scale).set_deterministic_algorithm(c.deterministic != 0);
  if (c.softcap > 0) {
    const auto softcap = std::make_shared<Softcap>();  // one object: the bprop reads what the forward half saved
    apply_softcap_and_masking(attributes, c, in, softcap);
    apply_softcap_bprop(attributes, c, softcap);
  } else {
    apply_masking(attributes, c, in);
  }
  if (max_total) {
    // The physical capacities, not the real token counts: offsets anywhere inside the buffers stay covered.
    attributes.set_max_total_seq_len_q(c.capacity_q).set_max_total_seq_len_kv(c.capacity_kv);
  }
  auto [d_q, d_k, d_v] = g->sdpa_backward(in.q, in.k, in.v, o, d_o, stats, attributes);
  mark_output(d_q, TensorUid::kDQ, q_layout(c), in.offset_q, io);
  mark_output(d_k, TensorUid::kDK, k_layout(c), in.offset_k, io);
  mark_output(d_v, TensorUid::kDV, v_layout(c), in.offset_v, io);

  FFI_RETURN_IF_ERROR(finalize(*g, handle, c, tuning, out));
  out->graph = std::move(g);
  out->max_total_seq_len_applied = max_total;
  return xla::ffi::Error::Success();
}

// The frontend silently drops max_total_seq_len in these cases (cudnn-frontend's infer_properties_node),
// and then lays the intermediates out densely; mirror it so the full-extent check compares like with like.
bool frontend_applies_max_total(const AttentionConfig& c, int sm_version) {
  const int major = sm_version / 10;
  const bool ampere_style = (major == 8 || major == 12) && cudnn_version() >= 91801;
  return c.use_max_total_seq_len && cudnn_version() >= 90600 && c.head_dim_qk % 16 == 0 && c.head_dim_v % 16 == 0 &&
         !ampere_style;
}

// Test-only switch (JAX_RAGGED_ATTN_DISABLE_FULL_EXTENT_FALLBACK=1 when the extension loads, or the module
// function): lets the sweep show that a short region is caught by the tests when nothing rebuilds the graph.
std::atomic<bool> full_extent_fallback_enabled{std::getenv("JAX_RAGGED_ATTN_DISABLE_FULL_EXTENT_FALLBACK") == nullptr};

xla::ffi::Error build_backward_checked(int device, cudnnHandle_t handle, const AttentionConfig& c,
                                       const BuildSettings& settings, bool tuning, CachedGraph* out) {
  int sm_version = 0;
  FFI_RETURN_IF_ERROR(compute_capability(device, &sm_version));
  const bool max_total = frontend_applies_max_total(c, sm_version);
  FFI_RETURN_IF_ERROR(build_backward(handle, c, max_total, tuning, out));
  if (!max_total) return xla::ffi::Error::Success();

  // The full-extent check: with max_total_seq_len set, the frontend sizes the ragged intermediates itself.
  // Frontends before 1.28 sized head-major stats h times too small and every gradient came back zero. If the
  // region it reserved is smaller than the full extent of what it lays out there, use the dense layout.
  out->frontend_region_bytes = out->graph->frontend_region_bytes();
  out->expected_intermediate_bytes = full_extent_backward_intermediates(c, settings.dp_workspace_limit_set).total();
  if (out->frontend_region_bytes >= out->expected_intermediate_bytes || !settings.full_extent_fallback) {
    return xla::ffi::Error::Success();
  }
  CachedGraph dense;
  FFI_RETURN_IF_ERROR(build_backward(handle, c, /*max_total=*/false, tuning, &dense));
  dense.frontend_region_bytes = out->frontend_region_bytes;
  dense.expected_intermediate_bytes = out->expected_intermediate_bytes;
  dense.fell_back = true;
  *out = std::move(dense);
  return xla::ffi::Error::Success();
}

}  // namespace

xla::ffi::Error frontend_status(fe::error_t status, const char* stage, const std::string& description) {
  if (status.is_good()) return xla::ffi::Error::Success();
  const bool unsupported = status.code == fe::error_code_t::GRAPH_NOT_SUPPORTED ||
                           status.code == fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED;
  return ErrorStream(unsupported ? xla::ffi::ErrorCode::kUnimplemented : xla::ffi::ErrorCode::kInternal)
         << "cuDNN " << stage << (unsupported ? " does not support this graph: " : " failed: ") << status.get_message()
         << " [" << description << "]";
}

xla::ffi::Error build_forward_auto_then_composite(
    const std::function<xla::ffi::Error(fe::AttentionImplementation_t)>& build) {
  return build_first_that_works(build, fe::AttentionImplementation_t::AUTO, fe::AttentionImplementation_t::COMPOSITE,
                                "the frontend's AUTO implementation");
}

// Validates the graph and asks cuDNN for candidate plans. Then builds one: the heuristic's first choice, or
// the candidate plan_index names (an autotuned choice). When tuning, builds none: tune_plans builds
// and times every candidate itself.
xla::ffi::Error finalize_graph(InspectableGraph& g, cudnnHandle_t handle, int64_t plan_index,
                               const std::string& description, bool tuning, CachedGraph* out) {
  const auto from_frontend = [&description](fe::error_t status, const char* stage) {
    return frontend_status(status, stage, description);
  };
  FFI_RETURN_IF_ERROR(from_frontend(g.validate(), "validate"));
  FFI_RETURN_IF_ERROR(from_frontend(g.build_operation_graph(handle), "build_operation_graph"));
  FFI_RETURN_IF_ERROR(
      from_frontend(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_plans"));
  FFI_RETURN_IF_ERROR(from_frontend(g.check_support(handle), "check_support"));
  if (tuning) return xla::ffi::Error::Success();
  int64_t workspace = 0;
  if (plan_index >= 0) {
    FFI_CHECK(plan_index < g.get_execution_plan_count())
        << "plan_index " << plan_index << " is out of range: cuDNN offers " << g.get_execution_plan_count()
        << " plans for this graph (a stale autotuning cache?) [" << description << "]";
    FFI_RETURN_IF_ERROR(from_frontend(g.build_plan_at_index(plan_index), "build_plan_at_index"));
    FFI_RETURN_IF_ERROR(from_frontend(g.get_workspace_size_plan_at_index(plan_index, workspace), "get_workspace_size"));
    if (g.get_plan_name_at_index(plan_index, out->plan_name).is_bad()) out->plan_name = "?";
  } else {
    FFI_RETURN_IF_ERROR(from_frontend(g.build_plans(handle), "build_plans"));
    FFI_RETURN_IF_ERROR(from_frontend(g.get_workspace_size(workspace), "get_workspace_size"));
    if (g.get_plan_name(out->plan_name).is_bad()) out->plan_name = "?";
  }
  out->workspace_bytes = workspace;
  out->plan_index = plan_index;
  return xla::ffi::Error::Success();
}

// Exported for the paged graph (paged_graph.cc): the same masks as the training forward's.
void apply_forward_masks(fe::graph::SDPA_attributes& attributes, const AttentionConfig& c, TensorPtr seq_len_q,
                         TensorPtr seq_len_kv) {
  GraphInputs in;
  in.seq_len_q = std::move(seq_len_q);
  in.seq_len_kv = std::move(seq_len_kv);
  if (c.softcap > 0) {
    apply_softcap_and_masking(attributes, c, in, std::make_shared<Softcap>());
  } else {
    apply_masking(attributes, c, in);
  }
}

xla::ffi::Error check_packing(const AttentionConfig& c) {
  if (const char* violation = packing_violation(c)) {
    return ErrorStream(xla::ffi::ErrorCode::kInvalidArgument) << violation << " [" << c.describe() << "]";
  }
  return xla::ffi::Error::Success();
}

BuildSettings current_build_settings(Direction direction) {
  BuildSettings settings;
  if (direction == Direction::kForward) return settings;
  settings.full_extent_fallback = full_extent_fallback_enabled.load();
  // Read once, at the first backward lookup, not at every launch: a getenv per launch would race Python's
  // setenv (undefined behaviour in glibc), cost a scan of the environment in the hot path, and let a value
  // changed after tracing build a graph whose workspace differs from the one XLA allocated. Set it before the
  // first cuDNN call of the process (docs/ENVIRONMENT.md).
  static const std::pair<bool, std::string> dp_limit = [] {
    const char* limit = std::getenv("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT");
    return std::make_pair(limit != nullptr, std::string(limit ? limit : ""));
  }();
  settings.dp_workspace_limit_set = dp_limit.first;
  settings.dp_workspace_limit = dp_limit.second;
  return settings;
}

xla::ffi::Error build_graph(int device, cudnnHandle_t handle, Direction direction, const AttentionConfig& config,
                            const BuildSettings& settings, bool tuning, CachedGraph* out) {
  if (direction == Direction::kForward) {
    return build_forward_auto_then_composite([&](fe::AttentionImplementation_t implementation) {
      return build_forward(handle, config, tuning, implementation, out);
    });
  }
  return build_backward_checked(device, handle, config, settings, tuning, out);
}

void set_full_extent_fallback_enabled(bool enabled) { full_extent_fallback_enabled.store(enabled); }

}  // namespace jax_ragged_attn
