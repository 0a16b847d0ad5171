// The KV-cache index handler (cache_index.cc): cache_seqlens and the page table clamped into the cache in one
// launch, registered from Python for platform "CUDA" under the name module.cc exports.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnClampCacheIndex);
