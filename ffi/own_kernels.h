// The project's own CUDA kernels (ffi/own_kernels.cu, one PTX module loaded and JIT-compiled at run time):
// zero_unowned_rows zeroes only the rows of an output that the cuDNN graph will not write (see own_kernels.cu
// for why and for the ownership rule); clamp_cache_index makes a KV cache's lengths and page table safe for a
// kernel that reads them without bounds.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_ragged_attn {

// Where an output's rows lie: row r, slice s starts at base + s * slice_stride + r * row_stride, and
// `bytes_per_row` bytes from there (a multiple of 4) are the output's in that slice.
struct RowRegion {
  void* base;
  int64_t rows;
  int64_t row_stride;
  int64_t bytes_per_row;
  int64_t slices = 1;
  int64_t slice_stride = 0;
};

// Which rows sequences own, from the graph's own index arrays on the device: sequence i owns rows
// [starts[i] / scale, starts[i] / scale + lengths[i]), and only where gate[i] > 0 if gate is given.
struct RowOwnership {
  const void* starts;   // int32 [num_seqs + 1], non-decreasing
  int64_t scale;        // elements per row in `starts`
  const void* lengths;  // int32 [num_seqs]
  const void* gate;     // int32 [num_seqs] or nullptr
  int64_t num_seqs;
};

// Loads the kernels once per process and readies them on `device` (trace time; also called by handlers, in
// relaxed stream-capture mode). Returns "" when they can run there, else why not (a CUDA runtime older than
// 12.0, a driver that cannot JIT the PTX): the handlers then zero whole outputs instead.
std::string prepare_own_kernels(int device);

// Enqueues the zeroing of every row of `region` that `owner` does not own on `stream`. Requires
// prepare_own_kernels() == "" for the stream's device.
xla::ffi::Error zero_unowned_rows(const RowRegion& region, const RowOwnership& owner, cudaStream_t stream);

// The same for `count` regions that share `owner`: one launch for each JAX_RAGGED_ATTN_MAX_ZERO_REGIONS of
// them (row_zeroing_params.h), each row's sequence searched once for all.
xla::ffi::Error zero_unowned_rows(const RowRegion* regions, size_t count, const RowOwnership& owner,
                                  cudaStream_t stream);

// Enqueues, in one launch, lengths_out = lengths clamped into [0, capacity] and table_out = table with every
// entry outside [0, num_pages) replaced by 0 (own_kernels.cu). Requires prepare_own_kernels() == "".
xla::ffi::Error clamp_cache_index(const int32_t* lengths, int32_t* lengths_out, int64_t num_lengths, int64_t capacity,
                                  const int32_t* table, int32_t* table_out, int64_t num_entries, int64_t num_pages,
                                  cudaStream_t stream);

}  // namespace jax_ragged_attn
