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

// "cudaErrorInvalidDevice (101): invalid device ordinal": the name and description of a CUDA runtime status
// from the dlopen'ed runtime (cudaGetErrorName, cudaGetErrorString), or just the number where it lacks them.
std::string cuda_error_string(cudaError_t status);

// Makes a device current on the calling thread for the guard's lifetime, then restores the one that was
// current before (trace-time graph builds run on Python's thread, whose device is the caller's business).
//
//   ScopedCurrentDevice current;
//   FFI_RETURN_IF_ERROR(current.set(device));
class ScopedCurrentDevice {
 public:
  ScopedCurrentDevice() = default;
  ~ScopedCurrentDevice();
  ScopedCurrentDevice(const ScopedCurrentDevice&) = delete;
  ScopedCurrentDevice& operator=(const ScopedCurrentDevice&) = delete;

  xla::ffi::Error set(int device);

 private:
  int previous_ = -1;  // the device to restore; -1: nothing to restore
};

// Compute capability major*10+minor of `device`.
xla::ffi::Error compute_capability(int device, int* sm_version);

// cudaMemsetAsync(ptr, value, bytes, stream) through the dlopen'ed CUDA runtime: a write-only pass at the
// copy engines' rate, captured into a CUDA graph like any stream operation.
xla::ffi::Error fill_async(void* ptr, int value, size_t bytes, cudaStream_t stream);
inline xla::ffi::Error zero_async(void* ptr, size_t bytes, cudaStream_t stream) {
  return fill_async(ptr, 0, bytes, stream);
}

// cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream) through the dlopen'ed CUDA runtime.
xla::ffi::Error copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream);

// A symbol of the CUDA runtime cudnn-frontend's loader opened (the one jaxlib loaded), or nullptr if that
// runtime lacks it.
void* cuda_runtime_symbol(const char* name);

// Switches the calling thread to relaxed stream-capture mode for its lifetime. Work done inside a handler
// that is not stream work (a graph missing from the cache is built right there; a kernel module is loaded)
// may run while XLA captures that handler's stream into a CUDA graph (command buffers, on by default): in the
// default global mode such allocations and module loads are forbidden calls that invalidate the capture;
// relaxed mode allows them (they are not captured, and they enqueue no work on the stream).
class RelaxedStreamCapture {
 public:
  RelaxedStreamCapture();
  ~RelaxedStreamCapture();
  RelaxedStreamCapture(const RelaxedStreamCapture&) = delete;
  RelaxedStreamCapture& operator=(const RelaxedStreamCapture&) = delete;

 private:
  using Exchange = cudaError_t (*)(cudaStreamCaptureMode*);
  Exchange exchange_ = nullptr;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace jax_ragged_attn
