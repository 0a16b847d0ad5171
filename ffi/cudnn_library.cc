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

std::string cuda_error_string(cudaError_t status) {
  using Describe = const char* (*)(cudaError_t);
  const auto name = reinterpret_cast<Describe>(cuda_runtime_symbol("cudaGetErrorName"));
  const auto description = reinterpret_cast<Describe>(cuda_runtime_symbol("cudaGetErrorString"));
  std::string s = name ? name(status) : "CUDA error";
  s += " (" + std::to_string(static_cast<int>(status)) + ")";
  if (description) s += std::string(": ") + description(status);
  return s;
}

ScopedCurrentDevice::~ScopedCurrentDevice() {
  if (previous_ < 0) return;
  using SetDevice = cudaError_t (*)(int);
  if (const auto set_device = reinterpret_cast<SetDevice>(cuda_runtime_symbol("cudaSetDevice"))) {
    set_device(previous_);
  }
}

xla::ffi::Error ScopedCurrentDevice::set(int device) {
  using GetDevice = cudaError_t (*)(int*);
  using SetDevice = cudaError_t (*)(int);
  GetDevice get_device = nullptr;
  SetDevice set_device = nullptr;
  try {  // the loader's exception says which runtime it could not open
    get_device = reinterpret_cast<GetDevice>(
        cudnn_frontend::detail::get_cuda_symbol(cudnn_frontend::detail::CudaLibrary::CUDART, "cudaGetDevice"));
    set_device = reinterpret_cast<SetDevice>(
        cudnn_frontend::detail::get_cuda_symbol(cudnn_frontend::detail::CudaLibrary::CUDART, "cudaSetDevice"));
  } catch (const std::exception& e) {
    return ErrorStream(xla::ffi::ErrorCode::kUnavailable) << "cannot reach the CUDA runtime: " << e.what();
  }
  FFI_CHECK(get_device != nullptr && set_device != nullptr) << "the CUDA runtime lacks cudaGetDevice or cudaSetDevice";
  int current = 0;
  cudaError_t status = get_device(&current);
  FFI_CHECK(status == cudaSuccess) << "cudaGetDevice: " << cuda_error_string(status);
  if (current == device) return xla::ffi::Error::Success();
  status = set_device(device);
  FFI_CHECK(status == cudaSuccess) << "cudaSetDevice(" << device << "): " << cuda_error_string(status);
  if (previous_ < 0) previous_ = current;  // set twice: restore the first one's
  return xla::ffi::Error::Success();
}

xla::ffi::Error compute_capability(int device, int* sm_version) {
  // Through the same dlopen'ed runtime as cudaSetDevice: the frontend's own wrapper for this call only
  // exists from 1.28, and the old-frontend test build must compile too.
  using GetAttribute = cudaError_t (*)(int*, cudaDeviceAttr, int);
  int major = 0, minor = 0;
  try {
    auto fn = reinterpret_cast<GetAttribute>(
        cudnn_frontend::detail::get_cuda_symbol(cudnn_frontend::detail::CudaLibrary::CUDART, "cudaDeviceGetAttribute"));
    const cudaError_t a = fn(&major, cudaDevAttrComputeCapabilityMajor, device);
    const cudaError_t b = fn(&minor, cudaDevAttrComputeCapabilityMinor, device);
    FFI_CHECK(a == cudaSuccess && b == cudaSuccess)
        << "cudaDeviceGetAttribute for device " << device << ": " << cuda_error_string(a == cudaSuccess ? b : a);
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
    FFI_CHECK(status == cudaSuccess) << "cudaMemsetAsync of " << bytes << " bytes: " << cuda_error_string(status);
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
  FFI_CHECK(status == cudaSuccess) << "cudaMemcpyAsync of " << bytes << " bytes: " << cuda_error_string(status);
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
