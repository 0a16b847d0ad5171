// Finds the libcudnn that jaxlib's CUDA plugin already loaded and hands it to cudnn-frontend's dynamic
// loader, so one build of this extension serves the CUDA 12 and CUDA 13 plugins alike.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_ragged_attn {

// Idempotent and thread-safe. `fallback_path` is tried when no libcudnn.so.9 is loaded in the process yet
// (Python passes the one inside the nvidia-cudnn wheel); empty means: search the library path.
xla::ffi::Error load_cudnn(const std::string& fallback_path = "");

bool cudnn_loaded();

// cudnnGetVersion() of the loaded library, e.g. 91900; 0 if none is loaded.
int64_t cudnn_version();

// Makes `device` current on the calling thread (trace-time graph builds run on Python's thread).
xla::ffi::Error set_current_device(int device);

// Compute capability major*10+minor of `device`.
xla::ffi::Error compute_capability(int device, int* sm_version);

// cudaMemsetAsync(ptr, 0, bytes, stream) through the dlopen'ed CUDA runtime: a write-only pass at the
// copy engines' rate, captured into a CUDA graph like any stream operation.
xla::ffi::Error zero_async(void* ptr, size_t bytes, cudaStream_t stream);

}  // namespace jax_ragged_attn
