// The two XLA FFI handlers, registered from Python for platform "CUDA".
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnForward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackward);
// The same with the workspace passed in as well (aliased to the output), for the guard-band check mode.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnForwardGuarded);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackwardGuarded);
