#include "graphs.h"

#include "cudnn_frontend_version.h"

#include <atomic>
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <list>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "autotune.h"
#include "check.h"
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

enum class Direction { kForward, kBackward };

std::vector<int64_t> as_vector(const std::array<int64_t, 4>& a) { return {a.begin(), a.end()}; }
int64_t uid(TensorUid u) { return static_cast<int64_t>(u); }

fe::DataType_t io_data_type(const AttentionConfig& c) {
  return c.dtype == static_cast<int64_t>(DType::kFloat16) ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

xla::ffi::Error from_frontend(fe::error_t status, const char* stage, const AttentionConfig& c) {
  if (status.is_good()) return xla::ffi::Error::Success();
  const bool unsupported = status.code == fe::error_code_t::GRAPH_NOT_SUPPORTED ||
                           status.code == fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED;
  return ErrorStream(unsupported ? xla::ffi::ErrorCode::kUnimplemented : xla::ffi::ErrorCode::kInternal)
         << "cuDNN " << stage << (unsupported ? " does not support this graph: " : " failed: ") << status.get_message()
         << " [" << c.describe() << "]";
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

// Validates the graph and asks cuDNN for candidate plans. Then builds one: the heuristic's first choice, or
// the candidate config.plan_index names (an autotuned choice). When tuning, builds none: tune_plans builds
// and times every candidate itself.
xla::ffi::Error finalize(InspectableGraph& g, cudnnHandle_t handle, const AttentionConfig& c, bool tuning,
                         CachedGraph* out) {
  FFI_RETURN_IF_ERROR(from_frontend(g.validate(), "validate", c));
  FFI_RETURN_IF_ERROR(from_frontend(g.build_operation_graph(handle), "build_operation_graph", c));
  FFI_RETURN_IF_ERROR(
      from_frontend(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_plans", c));
  FFI_RETURN_IF_ERROR(from_frontend(g.check_support(handle), "check_support", c));
  if (tuning) return xla::ffi::Error::Success();
  int64_t workspace = 0;
  if (c.plan_index >= 0) {
    FFI_CHECK(c.plan_index < g.get_execution_plan_count())
        << "plan_index " << c.plan_index << " is out of range: cuDNN offers " << g.get_execution_plan_count()
        << " plans for this graph (a stale autotuning cache?) [" << c.describe() << "]";
    FFI_RETURN_IF_ERROR(from_frontend(g.build_plan_at_index(c.plan_index), "build_plan_at_index", c));
    FFI_RETURN_IF_ERROR(
        from_frontend(g.get_workspace_size_plan_at_index(c.plan_index, workspace), "get_workspace_size", c));
    if (g.get_plan_name_at_index(c.plan_index, out->plan_name).is_bad()) out->plan_name = "?";
  } else {
    FFI_RETURN_IF_ERROR(from_frontend(g.build_plans(handle), "build_plans", c));
    FFI_RETURN_IF_ERROR(from_frontend(g.get_workspace_size(workspace), "get_workspace_size", c));
    if (g.get_plan_name(out->plan_name).is_bad()) out->plan_name = "?";
  }
  out->workspace_bytes = workspace;
  out->plan_index = c.plan_index;
  return xla::ffi::Error::Success();
}

xla::ffi::Error build_forward(cudnnHandle_t handle, const AttentionConfig& c, bool tuning, CachedGraph* out) {
  auto g = std::make_shared<InspectableGraph>();
  g->set_io_data_type(io_data_type(c))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const GraphInputs in = declare_inputs(*g, c);

  fe::graph::SDPA_attributes attributes;
  attributes.set_name("ragged_sdpa_forward").set_generate_stats(true).set_attn_scale(c.scale);
  apply_masking(attributes, c, in);
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
  g->set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  const GraphInputs in = declare_inputs(*g, c);
  auto o = ragged_tensor(*g, TensorUid::kO, "o", o_layout(c), in.offset_o, io);
  auto d_o = ragged_tensor(*g, TensorUid::kDO, "d_o", o_layout(c), in.offset_o, io);
  auto stats = ragged_tensor(*g, TensorUid::kStats, "stats", stats_layout(c), in.offset_stats, fe::DataType_t::FLOAT);

  fe::graph::SDPA_backward_attributes attributes;
  attributes.set_name("ragged_sdpa_backward").set_attn_scale(c.scale).set_deterministic_algorithm(c.deterministic != 0);
  apply_masking(attributes, c, in);
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
  return c.use_max_total_seq_len && cudnn_version() >= 90600 && c.head_dim_qk % 16 == 0 &&
         c.head_dim_v % 16 == 0 && !ampere_style;
}

// Test-only switch (JAX_RAGGED_ATTN_DISABLE_FULL_EXTENT_FALLBACK=1, or the module function): lets the sweep
// show that a short region is caught by the tests when nothing rebuilds the graph.
std::atomic<bool> full_extent_fallback_enabled{std::getenv("JAX_RAGGED_ATTN_DISABLE_FULL_EXTENT_FALLBACK") == nullptr};

xla::ffi::Error build_backward_checked(int device, cudnnHandle_t handle, const AttentionConfig& c, bool tuning,
                                       CachedGraph* out) {
  int sm_version = 0;
  FFI_RETURN_IF_ERROR(compute_capability(device, &sm_version));
  const bool max_total = frontend_applies_max_total(c, sm_version);
  FFI_RETURN_IF_ERROR(build_backward(handle, c, max_total, tuning, out));
  if (!max_total) return xla::ffi::Error::Success();

  // The full-extent check: with max_total_seq_len set, the frontend sizes the ragged intermediates itself.
  // Frontends before 1.28 sized head-major stats h times too small and every gradient came back zero. If the
  // region it reserved is smaller than the full extent of what it lays out there, use the dense layout.
  out->frontend_region_bytes = out->graph->frontend_region_bytes();
  out->expected_intermediate_bytes = full_extent_backward_intermediates(c).total();
  if (out->frontend_region_bytes >= out->expected_intermediate_bytes || !full_extent_fallback_enabled.load()) {
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

// One cuDNN handle per device, created on first use and kept for the life of the process: destroying it
// at exit can run after the CUDA runtime has shut down. The mutex serialises set_stream + execute.
struct DeviceState {
  cudnnHandle_t handle = nullptr;
  std::mutex execute_mutex;
};

using GraphKey = std::tuple<int, Direction, AttentionConfig>;

// A bounded least-recently-used cache: a training job that varies max_seqlen per step would otherwise keep
// every graph (and its cuDNN plans) alive forever. Handlers hold a shared_ptr, so evicting a graph that
// is executing is safe.
class GraphCache {
 public:
  std::shared_ptr<const CachedGraph> find(const GraphKey& key) {
    auto it = entries_.find(key);
    if (it == entries_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second.second);  // most recently used first
    return it->second.first;
  }

  void insert(const GraphKey& key, std::shared_ptr<const CachedGraph> graph, GraphCacheStats& stats) {
    order_.push_front(key);
    entries_[key] = {std::move(graph), order_.begin()};
    evict(stats);
  }

  void set_capacity(int64_t capacity, GraphCacheStats& stats) {
    capacity_ = std::max<int64_t>(capacity, 1);
    evict(stats);
  }

  int64_t capacity() const { return capacity_; }
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }

 private:
  void evict(GraphCacheStats& stats) {
    while (static_cast<int64_t>(entries_.size()) > capacity_) {
      entries_.erase(order_.back());
      order_.pop_back();
      ++stats.evictions;
    }
  }

  // A malformed value falls back to the default rather than to a capacity of 1, under which the forward
  // and backward graphs would evict each other every step. Python validates the variable first.
  static int64_t initial_capacity() {
    const char* env = std::getenv("JAX_RAGGED_ATTN_GRAPH_CACHE_SIZE");
    char* end = nullptr;
    const long long value = env ? std::strtoll(env, &end, 10) : 0;
    return (env && *env && end && *end == '\0' && value >= 1) ? value : 256;
  }

  int64_t capacity_ = initial_capacity();
  std::list<GraphKey> order_;
  std::map<GraphKey, std::pair<std::shared_ptr<const CachedGraph>, std::list<GraphKey>::iterator>> entries_;
};

std::mutex cache_mutex;
std::map<int, std::unique_ptr<DeviceState>> devices;
GraphCache graphs;
GraphCacheStats cache_stats;

xla::ffi::Error device_state(int device, DeviceState** out) {
  auto it = devices.find(device);
  if (it == devices.end()) {
    auto state = std::make_unique<DeviceState>();
    try {
      const cudnnStatus_t status = fe::detail::create_handle(&state->handle);
      FFI_CHECK(status == CUDNN_STATUS_SUCCESS)
          << "cudnnCreate on device " << device << ": " << fe::detail::get_error_string(status);
    } catch (const std::exception& e) {
      return ErrorStream(xla::ffi::ErrorCode::kInternal) << "cudnnCreate on device " << device << ": " << e.what();
    }
    it = devices.emplace(device, std::move(state)).first;
  }
  *out = it->second.get();
  return xla::ffi::Error::Success();
}

// Switches the calling thread to relaxed stream-capture mode for its lifetime. A graph missing when a handler
// runs is built right there, and XLA may be capturing that handler's stream into a CUDA graph (command
// buffers, on by default): in the default global mode the allocations and module loads of a cuDNN build are
// forbidden calls that invalidate the capture; relaxed mode allows them (they are not captured, and the build
// enqueues no work on the stream).
class RelaxedStreamCapture {
 public:
  RelaxedStreamCapture() {
    try {
      exchange_ = reinterpret_cast<Exchange>(
          fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDART, "cudaThreadExchangeStreamCaptureMode"));
      if (exchange_(&mode_) != cudaSuccess) exchange_ = nullptr;
    } catch (const std::exception&) {
      exchange_ = nullptr;
    }
  }
  ~RelaxedStreamCapture() {
    if (exchange_) exchange_(&mode_);
  }

 private:
  using Exchange = cudaError_t (*)(cudaStreamCaptureMode*);
  Exchange exchange_ = nullptr;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

xla::ffi::Error cached_graph(int device, Direction direction, const AttentionConfig& c,
                             std::shared_ptr<const CachedGraph>* out, bool in_handler) {
  if (const char* violation = packing_violation(c)) {
    return ErrorStream(xla::ffi::ErrorCode::kInvalidArgument) << violation << " [" << c.describe() << "]";
  }
  FFI_CHECK(cudnn_loaded()) << "cuDNN is not loaded; import jax_ragged_attn on a CUDA backend first";
  std::lock_guard<std::mutex> lock(cache_mutex);
  const auto key = std::make_tuple(device, direction, c);
  if (auto hit = graphs.find(key)) {
    ++cache_stats.hits;
    *out = std::move(hit);
    return xla::ffi::Error::Success();
  }
  ++cache_stats.misses;
  if (in_handler) ++cache_stats.handler_builds;
  RelaxedStreamCapture relaxed;
  DeviceState* state = nullptr;
  FFI_RETURN_IF_ERROR(device_state(device, &state));
  auto built = std::make_shared<CachedGraph>();
  // The handle is shared with execute_graph (which holds only this mutex): cuDNN handles are not
  // thread-safe, so a build must not overlap a launch on the same device. Lock order: cache, then execute.
  std::lock_guard<std::mutex> handle_lock(state->execute_mutex);
  try {
    if (direction == Direction::kForward) {
      FFI_RETURN_IF_ERROR(build_forward(state->handle, c, /*tuning=*/false, built.get()));
    } else {
      FFI_RETURN_IF_ERROR(build_backward_checked(device, state->handle, c, /*tuning=*/false, built.get()));
    }
  } catch (const std::exception& e) {
    return ErrorStream(xla::ffi::ErrorCode::kInternal) << "building the cuDNN graph threw: " << e.what() << " ["
                                                       << c.describe() << "]";
  }
  graphs.insert(key, built, cache_stats);
  *out = std::move(built);
  return xla::ffi::Error::Success();
}

}  // namespace

xla::ffi::Error forward_graph(int device, const AttentionConfig& config, std::shared_ptr<const CachedGraph>* out,
                              bool in_handler) {
  return cached_graph(device, Direction::kForward, config, out, in_handler);
}

xla::ffi::Error backward_graph(int device, const AttentionConfig& config, std::shared_ptr<const CachedGraph>* out,
                               bool in_handler) {
  return cached_graph(device, Direction::kBackward, config, out, in_handler);
}

xla::ffi::Error execute_graph(int device, const CachedGraph& graph, cudaStream_t stream,
                              std::unordered_map<int64_t, void*>& variant_pack, void* workspace) {
  DeviceState* state = nullptr;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    FFI_RETURN_IF_ERROR(device_state(device, &state));
  }
  std::lock_guard<std::mutex> lock(state->execute_mutex);
  try {
    const cudnnStatus_t status = fe::detail::set_stream(state->handle, stream);
    FFI_CHECK(status == CUDNN_STATUS_SUCCESS) << "cudnnSetStream: " << fe::detail::get_error_string(status);
    fe::error_t result = graph.plan_index >= 0
                             ? graph.graph->execute_plan_at_index(state->handle, variant_pack, workspace, graph.plan_index)
                             : graph.graph->execute(state->handle, variant_pack, workspace);
    if (result.is_bad()) {
      return ErrorStream(xla::ffi::ErrorCode::kInternal) << "cuDNN execute failed: " << result.get_message();
    }
  } catch (const std::exception& e) {
    return ErrorStream(xla::ffi::ErrorCode::kInternal) << "cuDNN execute threw: " << e.what();
  }
  return xla::ffi::Error::Success();
}

xla::ffi::Error tune_plans(int device, bool forward, const AttentionConfig& config, std::vector<PlanTiming>* out) {
  if (const char* violation = packing_violation(config)) {
    return ErrorStream(xla::ffi::ErrorCode::kInvalidArgument) << violation << " [" << config.describe() << "]";
  }
  FFI_CHECK(cudnn_loaded()) << "cuDNN is not loaded; import jax_ragged_attn on a CUDA backend first";
  DeviceState* state = nullptr;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    FFI_RETURN_IF_ERROR(device_state(device, &state));
  }
  // A graph of its own, never cached: every candidate is built and run on scratch buffers, so the handle
  // is held for the whole measurement.
  std::lock_guard<std::mutex> lock(state->execute_mutex);
  CachedGraph graph;
  try {
    if (forward) {
      FFI_RETURN_IF_ERROR(build_forward(state->handle, config, /*tuning=*/true, &graph));
    } else {
      FFI_RETURN_IF_ERROR(build_backward_checked(device, state->handle, config, /*tuning=*/true, &graph));
    }
    return time_candidate_plans(state->handle, *graph.graph, config, forward, out);
  } catch (const std::exception& e) {
    return ErrorStream(xla::ffi::ErrorCode::kInternal) << "autotuning threw: " << e.what() << " ["
                                                       << config.describe() << "]";
  }
}

GraphCacheStats graph_cache_stats() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  GraphCacheStats stats = cache_stats;
  stats.size = graphs.size();
  stats.capacity = graphs.capacity();
  return stats;
}

void set_graph_cache_capacity(int64_t capacity) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  graphs.set_capacity(capacity, cache_stats);
}

void set_full_extent_fallback_enabled(bool enabled) { full_extent_fallback_enabled.store(enabled); }

}  // namespace jax_ragged_attn
