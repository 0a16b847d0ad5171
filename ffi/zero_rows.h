// The zero-rows handler (zero_rows.cc): the unused rows of packed buffers zeroed in place, registered from
// Python for platform "CUDA" under the name module.cc exports.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnZeroRows);
