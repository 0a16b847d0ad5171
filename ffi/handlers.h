// The XLA FFI handlers, registered from Python for platform "CUDA".
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnForward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackward);
// The same with the workspace passed in as well (aliased to the output), for the guard-band check mode.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnForwardGuarded);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackwardGuarded);
// The backward for packed kv ([Tkv, 2, Hkv, D]) and packed qkv ([T, 3, H, D]): one gradient buffer per
// packed input, written in place. The forward serves every packing (the packed buffer arrives as each part).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackwardKVPacked);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackwardKVPackedGuarded);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackwardQKVPacked);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxRaggedAttnBackwardQKVPackedGuarded);
