// A handler for the KV-cache index clamp (own_kernels.cu): what a kernel that reads a cache's lengths and page
// table without bounds (FlashAttention-3's kvcache kernel, backends/fa3/kvcache.py) is given, made safe in one
// launch instead of two XLA fusions.
//
// args:    lengths int32 (cache_seqlens, any shape), table int32 (the page table, any shape)
// attrs:   capacity (rows a sequence's pages hold), num_pages (pages in the cache)
// results: lengths clamped into [0, capacity]; table with every entry outside [0, num_pages) replaced by 0
#include "cache_index.h"

#include <cuda_runtime_api.h>

#include "check.h"
#include "own_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_ragged_attn {
namespace {

ffi::Error clamp_cache_index_impl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> lengths,
                                  ffi::Buffer<ffi::S32> table, ffi::ResultBuffer<ffi::S32> lengths_out,
                                  ffi::ResultBuffer<ffi::S32> table_out, int64_t capacity, int64_t num_pages) {
  FFI_CHECK(lengths_out->element_count() == lengths.element_count() &&
            table_out->element_count() == table.element_count())
      << "the results must match the arguments' sizes, got " << lengths_out->element_count() << " and "
      << table_out->element_count() << " for " << lengths.element_count() << " and " << table.element_count();
  FFI_CHECK(capacity >= 0 && num_pages >= 0)
      << "capacity and num_pages must not be negative, got " << capacity << " and " << num_pages;
  const std::string unavailable = prepare_own_kernels(device);
  FFI_CHECK(unavailable.empty()) << "the KV-cache index kernel cannot run here: " << unavailable;
  return clamp_cache_index(lengths.typed_data(), lengths_out->typed_data(),
                           static_cast<int64_t>(lengths.element_count()), capacity, table.typed_data(),
                           table_out->typed_data(), static_cast<int64_t>(table.element_count()), num_pages, stream);
}

}  // namespace
}  // namespace jax_ragged_attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnClampCacheIndex, jax_ragged_attn::clamp_cache_index_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Ret<ffi::Buffer<ffi::S32>>()  // lengths, clamped
                                  .Ret<ffi::Buffer<ffi::S32>>()  // table, clamped
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("num_pages"),
                              {ffi::Traits::kCmdBufferCompatible});
