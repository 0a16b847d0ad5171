// The two XLA FFI handlers, registered from Python for platform "CUDA" under the names module.cc exports.
// Check mode (guarded) and the packed layouts are the same handlers: see handlers.cc for the argument and
// result contract.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnForward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackward);
// Their initialize stages (pinned_graphs.h); the instantiate stage is JaxRaggedAttnInstantiate.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnForwardInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackwardInitialize);
