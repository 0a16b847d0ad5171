#include "pinned_graphs.h"

namespace jax_ragged_attn {

xla::ffi::TypeId PinnedGraphs::id = {};

const XLA_FFI_TypeInfo kPinnedGraphsTypeInfo = xla::ffi::MakeTypeInfo<PinnedGraphs>();

xla::ffi::Error pinned_graph(PinnedGraphs* pins, int device, const GraphLookup& lookup,
                             std::shared_ptr<const CachedGraph>* out) {
  if (pins == nullptr) return lookup(out);
  // Held across the lookup: a second caller for the same executable and device waits for the first one's graph
  // instead of fetching its own. Nothing that holds a cache or handle lock ever takes this one.
  std::lock_guard<std::mutex> lock(pins->mutex);
  std::shared_ptr<const CachedGraph>& pinned = pins->by_device[device];
  if (!pinned) {
    xla::ffi::Error status = lookup(&pinned);
    if (status.failure()) {
      pinned.reset();
      return status;
    }
  }
  *out = pinned;
  return xla::ffi::Error::Success();
}

xla::ffi::ErrorOr<std::unique_ptr<PinnedGraphs>> instantiate_pinned_graphs() {
  return std::make_unique<PinnedGraphs>();
}

}  // namespace jax_ragged_attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnInstantiate, jax_ragged_attn::instantiate_pinned_graphs,
                              xla::ffi::Ffi::BindInstantiate());
