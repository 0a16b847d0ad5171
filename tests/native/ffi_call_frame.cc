// Calls an XLA FFI handler with a hand-built call frame and a stand-in API (no XLA, no GPU), for
// tests/test_handler_contract.py: the handler decodes its arguments, results and attributes and runs its
// checks; with cuDNN not loaded, a call that passes every check stops at "cuDNN is not loaded". Buffer data
// pointers are distinct fake addresses: nothing before the launch dereferences them.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace {
std::string last_message;
int last_code = 0;
struct StandInError {};
StandInError stand_in_error;

XLA_FFI_Error* error_create(XLA_FFI_Error_Create_Args* args) {
  last_message = args->message ? args->message : "";
  last_code = args->errc;
  return reinterpret_cast<XLA_FFI_Error*>(&stand_in_error);
}
XLA_FFI_Error* stream_get(XLA_FFI_Stream_Get_Args* args) {
  args->stream = nullptr;
  return nullptr;
}
XLA_FFI_Error* device_ordinal_get(XLA_FFI_DeviceOrdinal_Get_Args* args) {
  args->device_ordinal = 0;
  return nullptr;
}
// No FFI state: the attention handlers then look their graph up without pinning it (ffi/pinned_graphs.h).
XLA_FFI_Error* state_get(XLA_FFI_State_Get_Args* args) {
  args->state = nullptr;
  return nullptr;
}
}  // namespace

extern "C" {

// Buffers: dtype, rank, dims (flattened). Attributes: sorted names, dtype (S64 or F32), value as double.
// Returns 0 when the handler succeeded, else the error code; the message is in harness_message().
int harness_call(void* handler, int nargs, const int* arg_dtypes, const int* arg_ranks, const int64_t* arg_dims,
                 int nrets, const int* ret_dtypes, const int* ret_ranks, const int64_t* ret_dims, int nattrs,
                 const char** attr_names, const int* attr_dtypes, const double* attr_values) {
  static XLA_FFI_Api api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.XLA_FFI_Error_Create = error_create;
  api.XLA_FFI_Stream_Get = stream_get;
  api.XLA_FFI_DeviceOrdinal_Get = device_ordinal_get;
  api.XLA_FFI_State_Get = state_get;

  auto buffers = [](int n, const int* dtypes, const int* ranks, const int64_t* dims, std::vector<XLA_FFI_Buffer>& out,
                    std::vector<void*>& ptrs) {
    out.resize(n);
    ptrs.resize(n);
    const int64_t* d = dims;
    for (int i = 0; i < n; ++i) {
      out[i] = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE,
                              nullptr,
                              static_cast<XLA_FFI_DataType>(dtypes[i]),
                              reinterpret_cast<void*>(0x10000 * (i + 1)),
                              ranks[i],
                              const_cast<int64_t*>(d)};
      d += ranks[i];
      ptrs[i] = &out[i];
    }
  };
  std::vector<XLA_FFI_Buffer> args, rets;
  std::vector<void*> arg_ptrs, ret_ptrs;
  buffers(nargs, arg_dtypes, arg_ranks, arg_dims, args, arg_ptrs);
  buffers(nrets, ret_dtypes, ret_ranks, ret_dims, rets, ret_ptrs);
  std::vector<XLA_FFI_ArgType> arg_types(nargs, XLA_FFI_ArgType_BUFFER);
  std::vector<XLA_FFI_RetType> ret_types(nrets, XLA_FFI_RetType_BUFFER);

  std::vector<XLA_FFI_ByteSpan> names(nattrs);
  std::vector<XLA_FFI_ByteSpan*> name_ptrs(nattrs);
  std::vector<XLA_FFI_Scalar> scalars(nattrs);
  std::vector<void*> attr_ptrs(nattrs);
  std::vector<int64_t> ints(nattrs);
  std::vector<float> floats(nattrs);
  std::vector<XLA_FFI_AttrType> attr_types(nattrs, XLA_FFI_AttrType_SCALAR);
  for (int i = 0; i < nattrs; ++i) {
    names[i] = XLA_FFI_ByteSpan{attr_names[i], std::strlen(attr_names[i])};
    name_ptrs[i] = &names[i];
    ints[i] = static_cast<int64_t>(attr_values[i]);
    floats[i] = static_cast<float>(attr_values[i]);
    const bool is_float = attr_dtypes[i] == XLA_FFI_DataType_F32;
    scalars[i] = XLA_FFI_Scalar{static_cast<XLA_FFI_DataType>(attr_dtypes[i]),
                                is_float ? static_cast<void*>(&floats[i]) : static_cast<void*>(&ints[i])};
    attr_ptrs[i] = &scalars[i];
  }

  XLA_FFI_CallFrame frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.api = &api;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args = XLA_FFI_Args{XLA_FFI_Args_STRUCT_SIZE, nullptr, nargs, arg_types.data(), arg_ptrs.data()};
  frame.rets = XLA_FFI_Rets{XLA_FFI_Rets_STRUCT_SIZE, nullptr, nrets, ret_types.data(), ret_ptrs.data()};
  frame.attrs =
      XLA_FFI_Attrs{XLA_FFI_Attrs_STRUCT_SIZE, nullptr, nattrs, attr_types.data(), name_ptrs.data(), attr_ptrs.data()};
  last_message.clear();
  last_code = 0;
  auto fn = reinterpret_cast<XLA_FFI_Error* (*)(XLA_FFI_CallFrame*)>(handler);
  XLA_FFI_Error* error = fn(&frame);
  return error ? (last_code ? last_code : -1) : 0;
}

const char* harness_message() { return last_message.c_str(); }

// The handler's traits bit mask (XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE = 1), via the metadata
// extension; -1 on error.
long harness_traits(void* handler) {
  static XLA_FFI_Api api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.XLA_FFI_Error_Create = error_create;
  XLA_FFI_Metadata metadata;
  std::memset(&metadata, 0, sizeof(metadata));
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension;
  std::memset(&extension, 0, sizeof(extension));
  extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  extension.extension_base.type = XLA_FFI_Extension_Metadata;
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  frame.api = &api;
  auto fn = reinterpret_cast<XLA_FFI_Error* (*)(XLA_FFI_CallFrame*)>(handler);
  if (fn(&frame)) return -1;
  return static_cast<long>(metadata.traits);
}
}
