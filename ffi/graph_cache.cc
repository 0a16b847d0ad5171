#include "graph_cache.h"

#include <algorithm>
#include <cstdlib>
#include <list>
#include <map>
#include <mutex>
#include <tuple>

#include "check.h"
#include "cudnn_library.h"

namespace jax_ragged_attn {
namespace {

namespace fe = cudnn_frontend;

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

xla::ffi::Error cached_graph(int device, Direction direction, AttentionConfig c,
                             std::shared_ptr<const CachedGraph>* out, bool in_handler) {
  // zero_outputs is what the handler does around the graph, not part of it: one graph serves both, and
  // the trace-time lookup (which never sets it) finds the graph the handler runs.
  c.zero_outputs = 0;
  FFI_RETURN_IF_ERROR(check_packing(c));
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
    FFI_RETURN_IF_ERROR(build_graph(device, state->handle, direction, c, /*tuning=*/false, built.get()));
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

xla::ffi::Error with_cudnn_handle(int device, const std::function<xla::ffi::Error(cudnnHandle_t)>& fn) {
  DeviceState* state = nullptr;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    FFI_RETURN_IF_ERROR(device_state(device, &state));
  }
  std::lock_guard<std::mutex> lock(state->execute_mutex);
  return fn(state->handle);
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
    fe::error_t result =
        graph.plan_index >= 0
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
  FFI_RETURN_IF_ERROR(check_packing(config));
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
    const Direction direction = forward ? Direction::kForward : Direction::kBackward;
    FFI_RETURN_IF_ERROR(build_graph(device, state->handle, direction, config, /*tuning=*/true, &graph));
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

}  // namespace jax_ragged_attn
