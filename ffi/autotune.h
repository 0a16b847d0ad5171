// Times every candidate plan of a graph on scratch buffers (autotune=True's measurement).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention_config.h"
#include "graph_build.h"

namespace jax_ragged_attn {

// One candidate plan of a graph, as tune_plans measured it.
struct PlanTiming {
  int64_t index = 0;
  std::string name;
  bool ok = false;  // built and ran; otherwise `message` says why not
  std::string message;
  int64_t workspace_bytes = 0;
  double median_ms = 0.0;
};

// Builds each of `graph`'s candidate plans and times the ones that build, on device buffers it allocates
// for `config` (sequences of equal length filling the capacity) and frees again. The caller holds the
// handle's lock. Plans that fail to build or run are reported with ok = false, not as an error.
xla::ffi::Error time_candidate_plans(cudnnHandle_t handle, InspectableGraph& graph, const AttentionConfig& config,
                                     bool forward, std::vector<PlanTiming>* out);

}  // namespace jax_ragged_attn
