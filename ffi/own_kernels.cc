// Loads the PTX of own_kernels.cu through the CUDA runtime found at run time (cudnn_library.h) and launches its
// kernels with argument arrays laid out as their parameters (tests/test_row_zeroing.py checks the two agree).
#include "own_kernels.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "check.h"
#include "cudnn_library.h"
#include "row_zeroing_params.h"

namespace jax_ragged_attn {
namespace {

constexpr const char kPtx[] =
#include "own_kernels_ptx.inc"
    ;
constexpr const char kZeroRowsKernelName[] = "jax_ragged_attn_zero_unowned_rows";
constexpr const char kClampKernelName[] = "jax_ragged_attn_clamp_cache_index";
constexpr int kThreadsPerBlock = 256;
// Enough blocks for a million rows in one pass; the kernel strides over the rows beyond them.
constexpr int64_t kMaxBlocks = 4096;

using LibraryLoadData = cudaError_t (*)(cudaLibrary_t*, const void*, cudaJitOption*, void**, unsigned int,
                                        cudaLibraryOption*, void**, unsigned int);
using LibraryGetKernel = cudaError_t (*)(cudaKernel_t*, cudaLibrary_t, const char*);
using FuncGetAttributes = cudaError_t (*)(cudaFuncAttributes*, const void*);
using LaunchKernel = cudaError_t (*)(const void*, dim3, dim3, void**, size_t, cudaStream_t);

struct Kernels {
  std::string error;  // why they cannot run, or empty
  cudaKernel_t zero_rows = nullptr;
  cudaKernel_t clamp = nullptr;
  LaunchKernel launch = nullptr;
};

// The library, loaded on first use: the PTX is JIT-compiled for each device the first time it is readied there.
const Kernels& kernels() {
  static const Kernels loaded = [] {
    Kernels k;
    const auto load = reinterpret_cast<LibraryLoadData>(cuda_runtime_symbol("cudaLibraryLoadData"));
    const auto get = reinterpret_cast<LibraryGetKernel>(cuda_runtime_symbol("cudaLibraryGetKernel"));
    k.launch = reinterpret_cast<LaunchKernel>(cuda_runtime_symbol("cudaLaunchKernel"));
    if (load == nullptr || get == nullptr || k.launch == nullptr) {
      k.error = "the CUDA runtime has no cudaLibraryLoadData (it needs CUDA 12.0 or newer)";
      return k;
    }
    cudaLibrary_t library = nullptr;
    cudaError_t status = load(&library, kPtx, nullptr, nullptr, 0, nullptr, nullptr, 0);
    if (status == cudaSuccess) status = get(&k.zero_rows, library, kZeroRowsKernelName);
    if (status == cudaSuccess) status = get(&k.clamp, library, kClampKernelName);
    if (status != cudaSuccess) {
      k.error = "loading the PTX of our own kernels failed: " + cuda_error_string(status);
      k.zero_rows = nullptr;
      k.clamp = nullptr;
    }
    return k;  // the library stays loaded for the life of the process
  }();
  return loaded;
}

// Per device: "" or why the kernels cannot run there, decided once. The map's mutex is held only to find the
// device's entry: readying one device (a JIT compile) never stalls a handler on another.
struct Readiness {
  std::once_flag once;
  std::string reason;
};
std::mutex ready_mutex;
std::map<int, std::unique_ptr<Readiness>> readied;

// Loads the kernels into the device's context (the driver JIT-compiles the PTX here) before any stream may be
// captured; cudaFuncGetAttributes does that for the current device.
std::string ready_on(int device) {
  RelaxedStreamCapture relaxed;  // loading a module is not stream work; see cudnn_library.h
  const Kernels& k = kernels();
  if (!k.error.empty()) return k.error;
  const auto attributes = reinterpret_cast<FuncGetAttributes>(cuda_runtime_symbol("cudaFuncGetAttributes"));
  if (attributes == nullptr) return "the CUDA runtime lacks cudaFuncGetAttributes";
  ScopedCurrentDevice current;  // back to the caller's device on the way out
  const xla::ffi::Error set = current.set(device);
  if (set.failure()) return "readying our own kernels on device " + std::to_string(device) + ": " + set.message();
  // Both kernels: with lazy module loading a kernel is loaded on its first use, which must not be a captured launch.
  cudaFuncAttributes attrs{};
  cudaError_t status = attributes(&attrs, reinterpret_cast<const void*>(k.zero_rows));
  if (status == cudaSuccess) status = attributes(&attrs, reinterpret_cast<const void*>(k.clamp));
  if (status != cudaSuccess) {
    return "readying our own kernels on device " + std::to_string(device) + " failed: " + cuda_error_string(status);
  }
  return "";
}

}  // namespace

std::string prepare_own_kernels(int device) {
  Readiness* entry = nullptr;
  {
    std::lock_guard<std::mutex> lock(ready_mutex);
    std::unique_ptr<Readiness>& slot = readied[device];
    if (!slot) slot = std::make_unique<Readiness>();
    entry = slot.get();  // never erased
  }
  std::call_once(entry->once, [&] { entry->reason = ready_on(device); });  // every later call: a flag test
  return entry->reason;
}

xla::ffi::Error zero_unowned_rows(const RowRegion* regions, size_t count, const RowOwnership& owner,
                                  cudaStream_t stream) {
  const Kernels& k = kernels();
  FFI_CHECK(k.error.empty()) << k.error;
  // One launch per JAX_RAGGED_ATTN_MAX_ZERO_REGIONS outputs that have rows to zero.
  for (size_t first = 0; first < count;) {
    ZeroRowsRegions batch{};
    for (; first < count && batch.count < JAX_RAGGED_ATTN_MAX_ZERO_REGIONS; ++first) {
      const RowRegion& region = regions[first];
      FFI_CHECK(region.bytes_per_row % 4 == 0 && region.row_stride % 4 == 0 && region.slice_stride % 4 == 0 &&
                reinterpret_cast<uintptr_t>(region.base) % 4 == 0)
          << "row zeroing needs 4-byte aligned rows (" << region.bytes_per_row << " bytes every " << region.row_stride
          << ")";
      FFI_CHECK(region.rows <= INT32_MAX && region.slices <= INT32_MAX && region.bytes_per_row / 4 <= INT32_MAX)
          << "row zeroing counts rows, slices and words in int32, got " << region.rows << " rows of " << region.slices
          << " slices of " << region.bytes_per_row << " bytes";
      if (region.rows == 0 || region.bytes_per_row == 0 || region.slices == 0) continue;
      const int i = batch.count++;
      batch.base[i] = static_cast<char*>(region.base);
      batch.slice_stride[i] = region.slice_stride;
      batch.row_stride[i] = region.row_stride;
      batch.words[i] = static_cast<int>(region.bytes_per_row / 4);
      batch.slices[i] = static_cast<int>(region.slices);
      batch.rows[i] = static_cast<int>(region.rows);
    }
    if (batch.count == 0) continue;
    int rows = 0;
    for (int i = 0; i < batch.count; ++i) rows = std::max(rows, batch.rows[i]);
    long long scale = owner.scale;
    int num_seqs = static_cast<int>(owner.num_seqs);
    const void* starts = owner.starts;
    const void* lengths = owner.lengths;
    const void* gate = owner.gate;
    void* args[] = {&batch, &starts, &scale, &lengths, &gate, &num_seqs};
    // One thread per row for the ownership test (own_kernels.cu): 32 rows to a warp.
    const int64_t blocks = std::min<int64_t>(kMaxBlocks, (rows + kThreadsPerBlock - 1) / kThreadsPerBlock);
    const cudaError_t status = k.launch(reinterpret_cast<const void*>(k.zero_rows), dim3(static_cast<unsigned>(blocks)),
                                        dim3(kThreadsPerBlock), args, 0, stream);
    FFI_CHECK(status == cudaSuccess) << "launching the row-zeroing kernel failed: " << cuda_error_string(status);
  }
  return xla::ffi::Error::Success();
}

xla::ffi::Error zero_unowned_rows(const RowRegion& region, const RowOwnership& owner, cudaStream_t stream) {
  return zero_unowned_rows(&region, 1, owner, stream);
}

xla::ffi::Error clamp_cache_index(const int32_t* lengths, int32_t* lengths_out, int64_t num_lengths, int64_t capacity,
                                  const int32_t* table, int32_t* table_out, int64_t num_entries, int64_t num_pages,
                                  cudaStream_t stream) {
  const Kernels& k = kernels();
  FFI_CHECK(k.error.empty()) << k.error;
  const int64_t total = num_lengths + num_entries;
  if (total == 0) return xla::ffi::Error::Success();
  long long lengths_count = num_lengths, entries_count = num_entries, cap = capacity, pages = num_pages;
  void* args[] = {&lengths, &lengths_out, &lengths_count, &cap, &table, &table_out, &entries_count, &pages};
  const int64_t blocks = std::min<int64_t>(kMaxBlocks, (total + kThreadsPerBlock - 1) / kThreadsPerBlock);
  const cudaError_t status = k.launch(reinterpret_cast<const void*>(k.clamp), dim3(static_cast<unsigned>(blocks)),
                                      dim3(kThreadsPerBlock), args, 0, stream);
  FFI_CHECK(status == cudaSuccess) << "launching the KV-cache index clamp failed: " << cuda_error_string(status);
  return xla::ffi::Error::Success();
}

}  // namespace jax_ragged_attn
