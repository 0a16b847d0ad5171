#include "graph_cache.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "check.h"
#include "cudnn_library.h"
#include "lru_graph_cache.h"

namespace jax_ragged_attn {
namespace {

namespace fe = cudnn_frontend;

// One cuDNN handle per device, created on first use and kept for the life of the process: destroying it
// at exit can run after the CUDA runtime has shut down. cuDNN handles are not thread-safe, so the mutex
// serialises everything done with it on that device (set_stream + execute, a build, a tuning run); nothing
// done on another device waits on it.
struct DeviceState {
  std::mutex handle_mutex;
  cudnnHandle_t handle = nullptr;  // created under handle_mutex
};

// Held only to find a device's state, never while using it.
std::mutex devices_mutex;
std::map<int, std::unique_ptr<DeviceState>> devices;

DeviceState& device_state(int device) {
  std::lock_guard<std::mutex> lock(devices_mutex);
  std::unique_ptr<DeviceState>& state = devices[device];
  if (!state) state = std::make_unique<DeviceState>();
  return *state;  // never erased, so the reference outlives the lock
}

// Runs fn(handle) holding the device's handle mutex, creating the handle first if need be.
template <typename Fn>
xla::ffi::Error with_handle(int device, Fn&& fn) {
  DeviceState& state = device_state(device);
  std::lock_guard<std::mutex> lock(state.handle_mutex);
  if (state.handle == nullptr) {
    try {
      const cudnnStatus_t status = fe::detail::create_handle(&state.handle);
      if (status != CUDNN_STATUS_SUCCESS) {
        state.handle = nullptr;
        return ErrorStream(xla::ffi::ErrorCode::kInternal)
               << "cudnnCreate on device " << device << ": " << fe::detail::get_error_string(status);
      }
    } catch (const std::exception& e) {
      state.handle = nullptr;
      return ErrorStream(xla::ffi::ErrorCode::kInternal) << "cudnnCreate on device " << device << ": " << e.what();
    }
  }
  return fn(state.handle);
}

// Everything a built graph depends on. zero_outputs is not in it: cached_graph clears it.
struct GraphKey {
  int device;
  Direction direction;
  AttentionConfig config;
  BuildSettings settings;

  auto key() const { return std::tie(device, direction, config, settings); }
  bool operator<(const GraphKey& other) const { return key() < other.key(); }
};

// A malformed value falls back to the default rather than to a capacity of 1, under which the forward
// and backward graphs would evict each other every step. Python validates the variable first.
int64_t initial_capacity() {
  const char* env = std::getenv("JAX_RAGGED_ATTN_GRAPH_CACHE_SIZE");
  char* end = nullptr;
  const long long value = env ? std::strtoll(env, &end, 10) : 0;
  return (env && *env && end && *end == '\0' && value >= 1) ? value : 256;
}

LruGraphCache<GraphKey, CachedGraph> graphs(initial_capacity());

std::atomic<int64_t> handler_builds{0};

xla::ffi::Error cached_graph(int device, Direction direction, AttentionConfig c,
                             std::shared_ptr<const CachedGraph>* out, bool in_handler) {
  // zero_outputs is what the handler does around the graph, not part of it: one graph serves both, and
  // the trace-time lookup (which never sets it) finds the graph the handler runs.
  c.zero_outputs = 0;
  FFI_RETURN_IF_ERROR(check_packing(c));
  FFI_CHECK(cudnn_loaded()) << "cuDNN is not loaded; import jax_ragged_attn on a CUDA backend first";
  const GraphKey key{device, direction, c, current_build_settings(direction)};
  bool built = false;
  xla::ffi::Error status = graphs.get(
      key,
      [&](CachedGraph* graph) -> xla::ffi::Error {
        RelaxedStreamCapture relaxed;
        return with_handle(device, [&](cudnnHandle_t handle) -> xla::ffi::Error {
          try {
            return build_graph(device, handle, direction, c, key.settings, /*tuning=*/false, graph);
          } catch (const std::exception& e) {
            return ErrorStream(xla::ffi::ErrorCode::kInternal)
                   << "building the cuDNN graph threw: " << e.what() << " [" << c.describe() << "]";
          }
        });
      },
      out, &built);
  if (built && in_handler) ++handler_builds;
  return status;
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
  return with_handle(device, fn);
}

xla::ffi::Error execute_graph(int device, const CachedGraph& graph, cudaStream_t stream,
                              std::unordered_map<int64_t, void*>& variant_pack, void* workspace) {
  return with_handle(device, [&](cudnnHandle_t handle) -> xla::ffi::Error {
    try {
      const cudnnStatus_t status = fe::detail::set_stream(handle, stream);
      FFI_CHECK(status == CUDNN_STATUS_SUCCESS) << "cudnnSetStream: " << fe::detail::get_error_string(status);
      fe::error_t result = graph.plan_index >= 0
                               ? graph.graph->execute_plan_at_index(handle, variant_pack, workspace, graph.plan_index)
                               : graph.graph->execute(handle, variant_pack, workspace);
      if (result.is_bad()) {
        return ErrorStream(xla::ffi::ErrorCode::kInternal) << "cuDNN execute failed: " << result.get_message();
      }
    } catch (const std::exception& e) {
      return ErrorStream(xla::ffi::ErrorCode::kInternal) << "cuDNN execute threw: " << e.what();
    }
    return xla::ffi::Error::Success();
  });
}

xla::ffi::Error tune_plans(int device, bool forward, const AttentionConfig& config, std::vector<PlanTiming>* out) {
  FFI_RETURN_IF_ERROR(check_packing(config));
  FFI_CHECK(cudnn_loaded()) << "cuDNN is not loaded; import jax_ragged_attn on a CUDA backend first";
  const Direction direction = forward ? Direction::kForward : Direction::kBackward;
  const BuildSettings settings = current_build_settings(direction);
  // A graph of its own, never cached: every candidate is built and run on scratch buffers, so the handle
  // is held for the whole measurement.
  return with_handle(device, [&](cudnnHandle_t handle) -> xla::ffi::Error {
    CachedGraph graph;
    try {
      FFI_RETURN_IF_ERROR(build_graph(device, handle, direction, config, settings, /*tuning=*/true, &graph));
      return time_candidate_plans(handle, *graph.graph, config, forward, out);
    } catch (const std::exception& e) {
      return ErrorStream(xla::ffi::ErrorCode::kInternal)
             << "autotuning threw: " << e.what() << " [" << config.describe() << "]";
    }
  });
}

GraphCacheStats graph_cache_stats() {
  const LruCacheStats lru = graphs.stats();
  GraphCacheStats stats;
  stats.hits = lru.hits;
  stats.misses = lru.misses;
  stats.evictions = lru.evictions;
  stats.size = lru.size;
  stats.capacity = lru.capacity;
  stats.handler_builds = handler_builds.load();
  return stats;
}

void set_graph_cache_capacity(int64_t capacity) { graphs.set_capacity(capacity); }

}  // namespace jax_ragged_attn
