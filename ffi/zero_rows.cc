// A handler of its own for the row-zeroing kernel (own_kernels.h): zero, in place, the rows of packed buffers
// that no sequence uses. Kernels that read or write whole tiles past a sequence's end (FlashAttention-3,
// backends/fa3.py) need their inputs' unused rows cleared and their outputs' unwritten rows zeroed; a
// jnp.where does that with a full pass over each tensor, this touches only the rows no sequence owns (one
// thread per row decides, and only unowned rows are written), so its cost follows the padding, not T.
//
// args:    starts int32 [B + 1] (sanitised cu_seqlens), lengths int32 [B] (rows each sequence uses), gate
//          int32 [B] (a sequence with gate 0 owns no row: a query sequence without keys), then the buffers,
//          each [T, ...] with rows along its leading axis
// results: the same buffers, aliased to the arguments (Python passes input_output_aliases; where XLA does not
//          honour that, the handler copies first), every row outside
//          [starts[b], starts[b] + lengths[b]) of the sequences with gate > 0 zeroed
#include "zero_rows.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "check.h"
#include "cudnn_library.h"
#include "own_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_ragged_attn {
namespace {

ffi::Error zero_rows_impl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> starts,
                          ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> gate, ffi::RemainingArgs buffers,
                          ffi::RemainingRets results) {
  FFI_CHECK(starts.element_count() == lengths.element_count() + 1 && gate.element_count() == lengths.element_count())
      << "starts must have one entry more than lengths and gate, got " << starts.element_count() << ", "
      << lengths.element_count() << " and " << gate.element_count();
  FFI_CHECK(buffers.size() == results.size()) << "each buffer must come back as a result (aliased), got "
                                              << buffers.size() << " buffers and " << results.size() << " results";
  const std::string unavailable = prepare_own_kernels(device);
  FFI_CHECK(unavailable.empty()) << "the row-zeroing kernel cannot run here: " << unavailable;
  const RowOwnership owner{starts.typed_data(), 1, lengths.typed_data(), gate.typed_data(),
                           static_cast<int64_t>(lengths.element_count())};
  std::vector<RowRegion> regions;
  regions.reserve(results.size());
  for (size_t i = 0; i < results.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> arg = buffers.get<ffi::AnyBuffer>(i);
    if (arg.has_error()) return arg.error();
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = results.get<ffi::AnyBuffer>(i);
    if (ret.has_error()) return ret.error();
    ffi::AnyBuffer out = **ret;
    FFI_CHECK(out.size_bytes() == arg->size_bytes())
        << "buffer " << i << " and its result differ in size: " << arg->size_bytes() << " and " << out.size_bytes();
    if (out.untyped_data() != arg->untyped_data()) {
      // XLA does not always honour the alias (under vmap's sequential loop, seen on the H200): copy, then zero.
      FFI_RETURN_IF_ERROR(copy_async(out.untyped_data(), arg->untyped_data(), out.size_bytes(), stream));
    }
    const auto dims = out.dimensions();
    FFI_CHECK(dims.size() > 0) << "buffer " << i << " must have a row axis";
    const int64_t rows = dims[0];
    if (rows == 0) continue;
    const int64_t row_bytes = static_cast<int64_t>(out.size_bytes()) / rows;
    regions.push_back(RowRegion{out.untyped_data(), rows, row_bytes, row_bytes});
  }
  // One launch for the buffers together (up to four): Q, K, V or dQ, dK, dV of one call share their owners.
  FFI_RETURN_IF_ERROR(zero_unowned_rows(regions.data(), regions.size(), owner, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ragged_attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnZeroRows, jax_ragged_attn::zero_rows_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // starts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()  // gate
                                  .RemainingArgs()               // the buffers
                                  .RemainingRets(),              // the same, aliased
                              {ffi::Traits::kCmdBufferCompatible});
