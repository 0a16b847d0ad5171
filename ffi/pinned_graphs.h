// The cuDNN graphs one compiled custom call uses, held for as long as XLA keeps the executable that contains it.
//
// XLA records custom calls into CUDA graphs (command buffers) by running their handlers inside a stream
// capture. Building a cuDNN graph there is not possible: the build synchronises and loads modules, which
// invalidates the capture and fails the step. The graph caches are bounded LRUs, so a graph a live executable
// needs can be evicted by other shapes and would then be rebuilt in the next handler call, possibly inside a
// capture. To make that impossible, every attention handler is a bundle of FFI stages:
//   instantiate  (once per executable, no device): creates an empty PinnedGraphs as the call's FFI state;
//   initialize   (before each execution, on the device's stream, outside any capture): looks the graph up in
//                the cache, building it on a miss, and pins it in the state for that device;
//   execute      (possibly inside a capture): uses the pinned graph; it looks the cache up only where no
//                initialize stage ran for this device.
// The LRU still bounds how many graphs are found by lookup; a graph evicted from it lives on while an executable
// pins it, and is freed with the last executable that does.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "graph_build.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ragged_attn {

struct PinnedGraphs {
  static xla::ffi::TypeId id;  // assigned when Python registers the type (state_type_registrations)

  std::mutex mutex;
  std::map<int, std::shared_ptr<const CachedGraph>> by_device;
};

// The type's deleter, for XLA to free an executable's state.
extern const XLA_FFI_TypeInfo kPinnedGraphsTypeInfo;

using GraphLookup = std::function<xla::ffi::Error(std::shared_ptr<const CachedGraph>*)>;

// The graph pinned for `device`; on the first call for that device, `lookup` fetches it (building on a cache
// miss) and it is pinned. `pins` may be null (a caller without FFI state): then `lookup` alone answers.
xla::ffi::Error pinned_graph(PinnedGraphs* pins, int device, const GraphLookup& lookup,
                             std::shared_ptr<const CachedGraph>* out);

// The instantiate stage every attention handler shares: an empty PinnedGraphs.
xla::ffi::ErrorOr<std::unique_ptr<PinnedGraphs>> instantiate_pinned_graphs();

}  // namespace jax_ragged_attn

// The instantiate-stage handler of every attention target (its bundle's "instantiate").
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnInstantiate);
