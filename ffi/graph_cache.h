// The built graphs, cached per (device, direction, configuration, build settings) in a bounded LRU cache
// (lru_graph_cache.h), and the one cuDNN handle per device that builds and runs them. A build holds only its
// own device's handle: lookups of other graphs, and launches on other devices, never wait for it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "attention_config.h"
#include "autotune.h"
#include "graph_build.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ragged_attn {

// Both return the cached graph, building it first on a miss. Not-supported configurations come back as
// ErrorCode::kUnimplemented. `in_handler`: the caller is a handler running on the device's stream (counted,
// and built with the thread in relaxed stream-capture mode; see graph_cache.cc).
xla::ffi::Error forward_graph(int device, const AttentionConfig& config, std::shared_ptr<const CachedGraph>* out,
                              bool in_handler = true);
xla::ffi::Error backward_graph(int device, const AttentionConfig& config, std::shared_ptr<const CachedGraph>* out,
                               bool in_handler = true);

// Runs fn with the device's cuDNN handle (created on first use) while holding the lock that serialises every
// build and launch on that handle (and nothing on other devices): graphs this cache does not hold
// (paged_graph.cc) are built with it. fn must not look a graph up (a build may be waiting for this handle).
xla::ffi::Error with_cudnn_handle(int device, const std::function<xla::ffi::Error(cudnnHandle_t)>& fn);

// Runs `graph` on `stream`; the variant pack maps TensorUid values to device pointers.
xla::ffi::Error execute_graph(int device, const CachedGraph& graph, cudaStream_t stream,
                              std::unordered_map<int64_t, void*>& variant_pack, void* workspace);

// Builds a fresh graph for `config` (never cached), then builds and times every candidate plan cuDNN
// offers on scratch buffers it allocates and frees itself. Trace time only: it synchronises the device.
xla::ffi::Error tune_plans(int device, bool forward, const AttentionConfig& config, std::vector<PlanTiming>* out);

struct GraphCacheStats {
  int64_t hits = 0;  // a lookup that waited for another caller's build of the same graph counts as a hit
  int64_t misses = 0;
  int64_t handler_builds = 0;  // misses inside a handler: the graph was evicted, or never traced on that device
  int64_t evictions = 0;
  int64_t size = 0;
  int64_t capacity = 0;
};
GraphCacheStats graph_cache_stats();

// Bounds the number of cached graphs (least recently used go first); JAX_RAGGED_ATTN_GRAPH_CACHE_SIZE, read
// when the extension loads, sets the initial bound, 256 by default.
void set_graph_cache_capacity(int64_t capacity);

}  // namespace jax_ragged_attn
