// Builds cuDNN ragged SDPA forward and backward graphs and caches them per (device, configuration).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include <unordered_map>

#include "attention_config.h"
#include "cudnn_frontend.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ragged_attn {

// Tensor UIDs of the variant pack; the same values in the forward and the backward graph.
enum class TensorUid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSeqLenQ,
  kSeqLenKV,
  kOffsetQ,   // ragged offsets of Q, dQ: cu_q * Hq * Dqk
  kOffsetK,   // K, dK: cu_kv * Hkv * Dqk
  kOffsetV,   // V, dV: cu_kv * Hkv * Dv
  kOffsetO,   // O, dO: cu_q * Hq * Dv
  kOffsetStats,  // cu_q (head-major) or cu_q * Hq (token-major)
};

// Exposes the size of the workspace region the frontend itself carves out for the backward's ragged
// intermediates (it sits before the engine's own workspace).
class InspectableGraph : public cudnn_frontend::graph::Graph {
 public:
  int64_t frontend_region_bytes() const { return get_fe_workspace_size_subtree(); }
};

struct CachedGraph {
  std::shared_ptr<InspectableGraph> graph;
  int64_t workspace_bytes = 0;
  // Backward only: the full-extent check of the ragged intermediates.
  bool max_total_seq_len_applied = false;
  int64_t frontend_region_bytes = 0;
  int64_t expected_intermediate_bytes = 0;
  bool fell_back = false;  // the region was short, so the graph was rebuilt without max_total_seq_len
  int64_t plan_index = -1;  // the candidate that runs; -1: the heuristic's first choice (graph.execute)
  std::string plan_name;    // cuDNN's engine tag of that plan
};

// One candidate plan of a graph, as tune_plans measured it.
struct PlanTiming {
  int64_t index = 0;
  std::string name;
  bool ok = false;  // built and ran; otherwise `message` says why not
  std::string message;
  int64_t workspace_bytes = 0;
  double median_ms = 0.0;
};

// Both return the cached graph, building it first on a miss. Not-supported configurations come back as
// ErrorCode::kUnimplemented. `in_handler`: the caller is a handler running on the device's stream (counted,
// and built with the thread in relaxed stream-capture mode; see cached_graph).
xla::ffi::Error forward_graph(int device, const AttentionConfig& config, std::shared_ptr<const CachedGraph>* out,
                              bool in_handler = true);
xla::ffi::Error backward_graph(int device, const AttentionConfig& config, std::shared_ptr<const CachedGraph>* out,
                               bool in_handler = true);

// Runs `graph` on `stream`; the variant pack maps TensorUid values to device pointers.
xla::ffi::Error execute_graph(int device, const CachedGraph& graph, cudaStream_t stream,
                              std::unordered_map<int64_t, void*>& variant_pack, void* workspace);

// Builds a fresh graph for `config` (never cached), then builds and times every candidate plan cuDNN
// offers on scratch buffers it allocates and frees itself. Trace time only: it synchronises the device.
xla::ffi::Error tune_plans(int device, bool forward, const AttentionConfig& config, std::vector<PlanTiming>* out);

struct GraphCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t handler_builds = 0;  // misses inside a handler: the graph was evicted, or never traced on that device
  int64_t evictions = 0;
  int64_t size = 0;
  int64_t capacity = 0;
};
GraphCacheStats graph_cache_stats();

// Bounds the number of cached graphs (least recently used go first); JAX_RAGGED_ATTN_GRAPH_CACHE_SIZE sets
// the initial bound, 256 by default.
void set_graph_cache_capacity(int64_t capacity);

// Test-only (documented in the README): skip the full-extent fallback so a short region is used as built.
void set_full_extent_fallback_enabled(bool enabled);

}  // namespace jax_ragged_attn
