#include "cudnn_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "check.h"
#include "cudnn_frontend.h"

// cudnn-frontend's dynamic loader resolves every cuDNN symbol through this handle.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace jax_ragged_attn {
namespace {

constexpr const char* kCudnnSoname = "libcudnn.so.9";
std::mutex load_mutex;

// cudnn-frontend's loader opens libcudart.so.12 before libcudart.so.13 and keeps the first it finds; a
// runtime of the other major than our headers fills structs of another layout. Point it at the runtime
// jaxlib already loaded, unless the user chose one.
void pin_loaded_cudart() {
  if (std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME") != nullptr) return;
  for (const char* name : {"libcudart.so.13", "libcudart.so.12"}) {
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) {
      dlclose(handle);
      setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", name, /*overwrite=*/0);
      return;
    }
  }
}

}  // namespace

xla::ffi::Error load_cudnn(const std::string& fallback_path) {
  std::lock_guard<std::mutex> lock(load_mutex);
  if (cudnn_frontend::cudnn_dlhandle != nullptr) return xla::ffi::Error::Success();
  // Prefer the copy jaxlib already loaded: two cuDNNs in one process would each keep their own state.
  void* handle = dlopen(kCudnnSoname, RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr && !fallback_path.empty()) handle = dlopen(fallback_path.c_str(), RTLD_NOW);
  if (handle == nullptr) handle = dlopen(kCudnnSoname, RTLD_NOW);
  if (handle == nullptr) {
    const char* reason = dlerror();
    return ErrorStream(xla::ffi::ErrorCode::kUnavailable)
           << "cannot load cuDNN (" << kCudnnSoname << (fallback_path.empty() ? "" : " or " + fallback_path)
           << "): " << (reason ? reason : "unknown dlopen error")
           << "; install jax[cuda12] or jax[cuda13], which bring nvidia-cudnn";
  }
  cudnn_frontend::cudnn_dlhandle = handle;
  pin_loaded_cudart();
  return xla::ffi::Error::Success();
}

bool cudnn_loaded() { return cudnn_frontend::cudnn_dlhandle != nullptr; }

int64_t cudnn_version() {
  if (!cudnn_loaded()) return 0;
  try {
    return static_cast<int64_t>(cudnn_frontend::detail::get_backend_version());
  } catch (const std::exception&) {
    return 0;
  }
}

xla::ffi::Error set_current_device(int device) {
  using SetDevice = cudaError_t (*)(int);
  try {
    auto fn = reinterpret_cast<SetDevice>(
        cudnn_frontend::detail::get_cuda_symbol(cudnn_frontend::detail::CudaLibrary::CUDART, "cudaSetDevice"));
    const cudaError_t status = fn(device);
    FFI_CHECK(status == cudaSuccess) << "cudaSetDevice(" << device << ") returned " << static_cast<int>(status);
  } catch (const std::exception& e) {
    return ErrorStream(xla::ffi::ErrorCode::kUnavailable) << "cannot reach the CUDA runtime: " << e.what();
  }
  return xla::ffi::Error::Success();
}

xla::ffi::Error compute_capability(int device, int* sm_version) {
  // Through the same dlopen'ed runtime as cudaSetDevice: the frontend's own wrapper for this call only
  // exists from 1.28, and the old-frontend test build must compile too.
  using GetAttribute = cudaError_t (*)(int*, cudaDeviceAttr, int);
  int major = 0, minor = 0;
  try {
    auto fn = reinterpret_cast<GetAttribute>(cudnn_frontend::detail::get_cuda_symbol(
        cudnn_frontend::detail::CudaLibrary::CUDART, "cudaDeviceGetAttribute"));
    const cudaError_t a = fn(&major, cudaDevAttrComputeCapabilityMajor, device);
    const cudaError_t b = fn(&minor, cudaDevAttrComputeCapabilityMinor, device);
    FFI_CHECK(a == cudaSuccess && b == cudaSuccess) << "cudaDeviceGetAttribute failed for device " << device;
  } catch (const std::exception& e) {
    return ErrorStream(xla::ffi::ErrorCode::kUnavailable) << "cannot reach the CUDA runtime: " << e.what();
  }
  *sm_version = major * 10 + minor;
  return xla::ffi::Error::Success();
}

xla::ffi::Error fill_async(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  using MemsetAsync = cudaError_t (*)(void*, int, size_t, cudaStream_t);
  if (bytes == 0) return xla::ffi::Error::Success();
  try {
    static const auto fn = reinterpret_cast<MemsetAsync>(
        cudnn_frontend::detail::get_cuda_symbol(cudnn_frontend::detail::CudaLibrary::CUDART, "cudaMemsetAsync"));
    const cudaError_t status = fn(ptr, value, bytes, stream);
    FFI_CHECK(status == cudaSuccess) << "cudaMemsetAsync of " << bytes << " bytes returned " << static_cast<int>(status);
  } catch (const std::exception& e) {
    return ErrorStream(xla::ffi::ErrorCode::kUnavailable) << "cannot reach the CUDA runtime: " << e.what();
  }
  return xla::ffi::Error::Success();
}

xla::ffi::Error copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  using MemcpyAsync = cudaError_t (*)(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t);
  if (bytes == 0) return xla::ffi::Error::Success();
  const auto fn = reinterpret_cast<MemcpyAsync>(cuda_runtime_symbol("cudaMemcpyAsync"));
  if (fn == nullptr) return ErrorStream(xla::ffi::ErrorCode::kUnavailable) << "cannot reach cudaMemcpyAsync";
  const cudaError_t status = fn(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
  FFI_CHECK(status == cudaSuccess) << "cudaMemcpyAsync of " << bytes << " bytes returned " << static_cast<int>(status);
  return xla::ffi::Error::Success();
}

void* cuda_runtime_symbol(const char* name) {
  try {
    return cudnn_frontend::detail::get_cuda_symbol(cudnn_frontend::detail::CudaLibrary::CUDART, name);
  } catch (const std::exception&) {
    return nullptr;
  }
}

RelaxedStreamCapture::RelaxedStreamCapture() {
  exchange_ = reinterpret_cast<Exchange>(cuda_runtime_symbol("cudaThreadExchangeStreamCaptureMode"));
  if (exchange_ && exchange_(&mode_) != cudaSuccess) exchange_ = nullptr;
}

RelaxedStreamCapture::~RelaxedStreamCapture() {
  if (exchange_) exchange_(&mode_);
}

}  // namespace jax_ragged_attn
