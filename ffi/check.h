// Error plumbing for the FFI handlers: nothing here throws across the FFI boundary or aborts.
//
//   FFI_CHECK(d % 8 == 0) << "head_dim must be a multiple of 8, got " << d;
//
// returns an xla::ffi::Error from the enclosing function when the condition fails; check_buffer does the same
// for a buffer's element type and shape.
#pragma once

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_ragged_attn {

// Collects a message with operator<< and converts to an xla::ffi::Error on return.
class ErrorStream {
 public:
  explicit ErrorStream(xla::ffi::ErrorCode code = xla::ffi::ErrorCode::kInvalidArgument) : code_(code) {}

  template <typename T>
  ErrorStream& operator<<(const T& value) {
    message_ << value;
    return *this;
  }

  operator xla::ffi::Error() const { return xla::ffi::Error(code_, message_.str()); }

 private:
  xla::ffi::ErrorCode code_;
  std::ostringstream message_;
};

}  // namespace jax_ragged_attn

#define FFI_CHECK(cond) \
  if (cond) {           \
  } else                \
    return ::jax_ragged_attn::ErrorStream() << "check failed: " #cond ": "

// Returns early from a function that returns xla::ffi::Error when `expr` is an error.
#define FFI_RETURN_IF_ERROR(expr)                \
  do {                                           \
    ::xla::ffi::Error _ffi_error = (expr);       \
    if (_ffi_error.failure()) return _ffi_error; \
  } while (0)

namespace jax_ragged_attn {

// An element type as errors name it: "bf16", "f16", "f32", "s32", "u8", ...; "type N" for the rest.
inline std::string dtype_name(xla::ffi::DataType type) {
  using xla::ffi::DataType;
  switch (type) {
    case DataType::PRED:
      return "pred";
    case DataType::S8:
      return "s8";
    case DataType::S16:
      return "s16";
    case DataType::S32:
      return "s32";
    case DataType::S64:
      return "s64";
    case DataType::U8:
      return "u8";
    case DataType::U16:
      return "u16";
    case DataType::U32:
      return "u32";
    case DataType::U64:
      return "u64";
    case DataType::F16:
      return "f16";
    case DataType::BF16:
      return "bf16";
    case DataType::F32:
      return "f32";
    case DataType::F64:
      return "f64";
    default:
      return "type " + std::to_string(static_cast<int>(type));
  }
}

// "[2, 64, 128]".
inline std::string shape_string(xla::ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// A buffer of exactly the expected element type and shape: anything else could let a kernel address memory
// outside it. The error names the buffer and ends with the configuration (`config.describe()`, built only on
// failure).
template <typename Config>
xla::ffi::Error check_buffer(const std::string& name, xla::ffi::DataType type, xla::ffi::Span<const int64_t> dims,
                             xla::ffi::DataType expected_type, const std::vector<int64_t>& expected_dims,
                             const Config& config) {
  const bool same_shape =
      dims.size() == expected_dims.size() && std::equal(dims.begin(), dims.end(), expected_dims.begin());
  FFI_CHECK(type == expected_type && same_shape)
      << name << " is " << shape_string(dims) << " of type " << dtype_name(type) << ", expected "
      << shape_string(expected_dims) << " of type " << dtype_name(expected_type) << " [" << config.describe() << "]";
  return xla::ffi::Error::Success();
}

// The same for an argument or result buffer (ffi::AnyBuffer, ffi::Buffer<T>).
template <typename Buffer, typename Config>
xla::ffi::Error check_buffer(const std::string& name, const Buffer& buffer, xla::ffi::DataType expected_type,
                             const std::vector<int64_t>& expected_dims, const Config& config) {
  return check_buffer(name, buffer.element_type(), buffer.dimensions(), expected_type, expected_dims, config);
}

// A workspace of at least the `needed` bytes the graph asks for. XLA allocated `have` from the size Python asked
// for at trace time, so a shortfall means the configuration at trace time and at run time differ.
template <typename Config>
xla::ffi::Error check_workspace(int64_t have, int64_t needed, const Config& config) {
  FFI_CHECK(have >= needed) << "the workspace XLA allocated (" << have << " bytes) is smaller than the graph needs ("
                            << needed << " bytes): the configuration at trace time and at run time differ ["
                            << config.describe() << "]";
  return xla::ffi::Error::Success();
}

}  // namespace jax_ragged_attn
