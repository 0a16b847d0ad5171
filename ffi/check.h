// Error plumbing for the FFI handlers: nothing here throws across the FFI boundary or aborts.
//
//   FFI_CHECK(d % 8 == 0) << "head_dim must be a multiple of 8, got " << d;
//
// returns an xla::ffi::Error from the enclosing function when the condition fails.
#pragma once

#include <sstream>
#include <string>
#include <utility>

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
