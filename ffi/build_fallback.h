// One graph built the first way that works: graph_build.h's build_forward_auto_then_composite (the frontend's
// AUTO implementation, then its COMPOSITE node) is this template over the frontend's enum. A header of its
// own, free of cudnn-frontend, so that tests/native/build_fallback_test.cc exercises it on a CPU.
#pragma once

#include <exception>

#include "check.h"

namespace jax_ragged_attn {

// build(first), and where that fails or throws, build(second); an exception becomes a kInternal error. Where
// both fail: the second's error code (kUnimplemented there means "not supported": the backend declines) and
// both messages, the first's named by `first_name`.
template <typename Implementation, typename Build>
xla::ffi::Error build_first_that_works(const Build& build, Implementation first, Implementation second,
                                       const char* first_name) {
  const auto attempt = [&build](Implementation implementation) -> xla::ffi::Error {
    try {
      return build(implementation);
    } catch (const std::exception& e) {
      return ErrorStream(xla::ffi::ErrorCode::kInternal) << "cudnn-frontend threw: " << e.what();
    }
  };
  xla::ffi::Error first_error = attempt(first);
  if (!first_error.failure()) return first_error;
  xla::ffi::Error second_error = attempt(second);
  if (!second_error.failure()) return second_error;
  return ErrorStream(second_error.errc().value_or(xla::ffi::ErrorCode::kInternal))
         << second_error.message() << " (with " << first_name << ": " << first_error.message() << ")";
}

}  // namespace jax_ragged_attn
