// The paged KV-cache forward handler (paged_handler.cc), registered from Python for platform "CUDA" under
// the name module.cc's table gives it.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnPagedForward);
// Its initialize stage (pinned_graphs.h); the instantiate stage is JaxRaggedAttnInstantiate.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnPagedInitialize);
