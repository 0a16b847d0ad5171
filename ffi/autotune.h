// Times every candidate plan of a graph on scratch buffers (autotune=True's measurement).
#pragma once

#include <vector>

#include "attention_config.h"
#include "graphs.h"

namespace jax_ragged_attn {

// Builds each of `graph`'s candidate plans and times the ones that build, on device buffers it allocates
// for `config` (sequences of equal length filling the capacity) and frees again. The caller holds the
// handle's lock. Plans that fail to build or run are reported with ok = false, not as an error.
xla::ffi::Error time_candidate_plans(cudnnHandle_t handle, InspectableGraph& graph, const AttentionConfig& config,
                                     bool forward, std::vector<PlanTiming>* out);

}  // namespace jax_ragged_attn
