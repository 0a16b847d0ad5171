// Builds one cuDNN ragged SDPA graph, forward or backward, for a configuration: declares its tensors,
// validates it and builds its plan, and for the backward checks the frontend's ragged intermediates
// against their full extent (falling back to the dense layout when the region is short). No caching and
// no locking here: graph_cache.h owns the handles and the built graphs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>

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
  kOffsetQ,      // ragged offsets of Q, dQ: cu_q * Hq * Dqk
  kOffsetK,      // K, dK: cu_kv * Hkv * Dqk
  kOffsetV,      // V, dV: cu_kv * Hkv * Dv
  kOffsetO,      // O, dO: cu_q * Hq * Dv
  kOffsetStats,  // cu_q (head-major) or cu_q * Hq (token-major)
};

enum class Direction { kForward, kBackward };

// Exposes the size of the workspace region the frontend itself carves out for the backward's ragged
// intermediates (it sits before the engine's own workspace).
class InspectableGraph : public cudnn_frontend::graph::Graph {
 public:
  int64_t frontend_region_bytes() const { return get_fe_workspace_size_subtree(); }
};

// A built graph and what was learnt building it.
struct CachedGraph {
  std::shared_ptr<InspectableGraph> graph;
  int64_t workspace_bytes = 0;
  // Backward only: the full-extent check of the ragged intermediates.
  bool max_total_seq_len_applied = false;
  int64_t frontend_region_bytes = 0;
  int64_t expected_intermediate_bytes = 0;
  bool fell_back = false;   // the region was short, so the graph was rebuilt without max_total_seq_len
  int64_t plan_index = -1;  // the candidate that runs; -1: the heuristic's first choice (graph.execute)
  std::string plan_name;    // cuDNN's engine tag of that plan
};

// The process-wide settings a built graph depends on besides its configuration: read when a graph is looked up
// and part of its cache key, so changing one builds the graphs anew instead of running ones built without it.
// Both concern the backward only; a forward graph's settings are always the defaults.
struct BuildSettings {
  // The full-extent fallback (build_graph's backward): on unless JAX_RAGGED_ATTN_DISABLE_FULL_EXTENT_FALLBACK
  // was set when the extension loaded, or set_full_extent_fallback_enabled(false) was called since.
  bool full_extent_fallback = true;
  // CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT as cudnn-frontend reads it while building a backward graph: on
  // Hopper with cuDNN >= 9.25 a value below the dP workspace a deterministic backward needs makes the frontend
  // build the ordered dQ accumulation instead (and full_extent_backward_intermediates counts dQ_accum then).
  bool dp_workspace_limit_set = false;
  std::string dp_workspace_limit;

  auto key() const { return std::tie(full_extent_fallback, dp_workspace_limit_set, dp_workspace_limit); }
  bool operator<(const BuildSettings& other) const { return key() < other.key(); }
  bool operator==(const BuildSettings& other) const { return key() == other.key(); }
};

// The settings now in force for a graph of `direction`.
BuildSettings current_build_settings(Direction direction);

// kInvalidArgument when the packed layout's parts do not fit one row (layouts.h's packing_violation): no
// graph is built and no handler runs with such a configuration.
xla::ffi::Error check_packing(const AttentionConfig& config);

// Builds the graph of `direction` for `config` and `settings` (current_build_settings at lookup) with
// `handle` (the caller holds the handle's lock) on `device`. Not-supported configurations come back as
// ErrorCode::kUnimplemented. `tuning`: stop after the candidate plans are known, building none (tune_plans
// builds and times each); otherwise build the plan config.plan_index names, or the heuristic's first choice.
// May throw (cudnn-frontend does): callers catch.
xla::ffi::Error build_graph(int device, cudnnHandle_t handle, Direction direction, const AttentionConfig& config,
                            const BuildSettings& settings, bool tuning, CachedGraph* out);

// What other graphs share with these (paged_graph.cc builds one):
// A frontend status as an FFI error: kUnimplemented where cuDNN does not support the graph, kInternal for
// other failures, the message ending in `description` (the configuration).
xla::ffi::Error frontend_status(cudnn_frontend::error_t status, const char* stage, const std::string& description);

// Builds a forward SDPA graph with the frontend's AUTO implementation, and where that fails, with its COMPOSITE
// node. With cuDNN 9.21 or newer as both headers and library (a pip build of this package and pip's cuDNN),
// AUTO picks the unified SDPA node for every graph it accepts, softcap's score modifier included, and cuDNN
// 9.28.1 has no Hopper engine for that one ("No valid engine configs" on an H200); the composite node,
// which older headers always built, serves it. `build(implementation)` may throw: each attempt's exception
// becomes its error. Where both fail: the composite's error code (kUnimplemented: not supported), both messages.
xla::ffi::Error build_forward_auto_then_composite(
    const std::function<xla::ffi::Error(cudnn_frontend::AttentionImplementation_t)>& build);

// Validates `graph`, creates its candidate plans and builds one: the heuristic's first (plan_index -1) or
// the candidate plan_index names; with `tuning`, none. Fills out's workspace size, plan index and name.
xla::ffi::Error finalize_graph(InspectableGraph& graph, cudnnHandle_t handle, int64_t plan_index,
                               const std::string& description, bool tuning, CachedGraph* out);

// The masks of the forward graph: the padding mask from the per-sequence lengths, the diagonal band of
// config.bottom_right, left_bound and right_bound, and with config.softcap > 0 the capping score modifier,
// which then applies those masks itself (max_seqlen_q and max_seqlen_kv bound its band).
void apply_forward_masks(cudnn_frontend::graph::SDPA_attributes& attributes, const AttentionConfig& config,
                         std::shared_ptr<cudnn_frontend::graph::Tensor_attributes> seq_len_q,
                         std::shared_ptr<cudnn_frontend::graph::Tensor_attributes> seq_len_kv);

// Test-only (documented in the README): skip the full-extent fallback so a short region is used as built.
// Backward graphs looked up afterwards are built anew under the new setting (it is part of their key).
void set_full_extent_fallback_enabled(bool enabled);

}  // namespace jax_ragged_attn
