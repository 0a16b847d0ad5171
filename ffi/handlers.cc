// The XLA FFI handlers. They check every buffer against the configuration, fetch the cached graph and
// launch it. They allocate nothing and synchronise nothing: the workspace is an ordinary XLA output whose
// size Python asked for at trace time, so the handlers are safe inside XLA's command buffers (CUDA graphs).
#include "handlers.h"

#include <algorithm>
#include <unordered_map>
#include <vector>

#include "check.h"
#include "graphs.h"
#include "layouts.h"

namespace ffi = xla::ffi;

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_ragged_attn::AttentionConfig, ::xla::ffi::StructMember<int64_t>("num_seqs"),
    ::xla::ffi::StructMember<int64_t>("capacity_q"), ::xla::ffi::StructMember<int64_t>("capacity_kv"),
    ::xla::ffi::StructMember<int64_t>("num_heads_q"), ::xla::ffi::StructMember<int64_t>("num_heads_kv"),
    ::xla::ffi::StructMember<int64_t>("head_dim_qk"), ::xla::ffi::StructMember<int64_t>("head_dim_v"),
    ::xla::ffi::StructMember<int64_t>("max_seqlen_q"), ::xla::ffi::StructMember<int64_t>("max_seqlen_kv"),
    ::xla::ffi::StructMember<int64_t>("dtype"), ::xla::ffi::StructMember<float>("scale"),
    ::xla::ffi::StructMember<int64_t>("bottom_right"), ::xla::ffi::StructMember<int64_t>("left_bound"),
    ::xla::ffi::StructMember<int64_t>("right_bound"), ::xla::ffi::StructMember<int64_t>("stats_token_major"),
    ::xla::ffi::StructMember<int64_t>("use_max_total_seq_len"), ::xla::ffi::StructMember<int64_t>("deterministic"),
    ::xla::ffi::StructMember<int64_t>("plan_index"), ::xla::ffi::StructMember<int64_t>("packing"));

namespace jax_ragged_attn {
namespace {

using Int32Buffer = ffi::Buffer<ffi::S32>;

ffi::DataType element_type(const AttentionConfig& c) {
  return c.dtype == static_cast<int64_t>(DType::kFloat16) ? ffi::DataType::F16 : ffi::DataType::BF16;
}

std::string shape_string(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// A buffer of the configured dtype and exactly the expected shape; anything else could let cuDNN address
// memory outside it.
ffi::Error check_buffer(const char* name, ffi::DataType type, ffi::Span<const int64_t> dims, ffi::DataType expected_type,
                        std::vector<int64_t> expected_dims, const AttentionConfig& c) {
  const bool same_shape = dims.size() == expected_dims.size() &&
                          std::equal(dims.begin(), dims.end(), expected_dims.begin());
  FFI_CHECK(type == expected_type && same_shape)
      << name << " is " << shape_string(dims) << " of type " << static_cast<int>(type) << ", expected "
      << shape_string(ffi::Span<const int64_t>(expected_dims.data(), expected_dims.size())) << " of type "
      << static_cast<int>(expected_type) << " [" << c.describe() << "]";
  return ffi::Error::Success();
}

ffi::Error check_index(const char* name, const Int32Buffer& buffer, int64_t expected, const AttentionConfig& c) {
  return check_buffer(name, ffi::DataType::S32, buffer.dimensions(), ffi::DataType::S32, {expected}, c);
}

ffi::Error check_workspace(int64_t have, const CachedGraph& graph, const AttentionConfig& c) {
  FFI_CHECK(have >= graph.workspace_bytes)
      << "the workspace XLA allocated (" << have << " bytes) is smaller than the graph needs (" << graph.workspace_bytes
      << " bytes): the configuration at trace time and at run time differ [" << c.describe() << "]";
  return ffi::Error::Success();
}

struct IndexArgs {
  Int32Buffer seq_len_q, seq_len_kv, offset_q, offset_k, offset_v, offset_o, offset_stats;
};

ffi::Error check_indices(const IndexArgs& idx, const AttentionConfig& c) {
  FFI_RETURN_IF_ERROR(check_index("seq_len_q", idx.seq_len_q, c.num_seqs, c));
  FFI_RETURN_IF_ERROR(check_index("seq_len_kv", idx.seq_len_kv, c.num_seqs, c));
  for (auto [name, buffer] : {std::pair{"offset_q", &idx.offset_q}, std::pair{"offset_k", &idx.offset_k},
                              std::pair{"offset_v", &idx.offset_v}, std::pair{"offset_o", &idx.offset_o},
                              std::pair{"offset_stats", &idx.offset_stats}}) {
    FFI_RETURN_IF_ERROR(check_index(name, *buffer, c.num_seqs + 1, c));
  }
  return ffi::Error::Success();
}

void add_indices(std::unordered_map<int64_t, void*>& pack, const IndexArgs& idx) {
  pack[static_cast<int64_t>(TensorUid::kSeqLenQ)] = idx.seq_len_q.untyped_data();
  pack[static_cast<int64_t>(TensorUid::kSeqLenKV)] = idx.seq_len_kv.untyped_data();
  pack[static_cast<int64_t>(TensorUid::kOffsetQ)] = idx.offset_q.untyped_data();
  pack[static_cast<int64_t>(TensorUid::kOffsetK)] = idx.offset_k.untyped_data();
  pack[static_cast<int64_t>(TensorUid::kOffsetV)] = idx.offset_v.untyped_data();
  pack[static_cast<int64_t>(TensorUid::kOffsetO)] = idx.offset_o.untyped_data();
  pack[static_cast<int64_t>(TensorUid::kOffsetStats)] = idx.offset_stats.untyped_data();
}

// The buffers the handler receives. Separate: q, k, v of their own. Packed: the same packed buffer arrives
// as each of its parts (XLA passes one array used three times as one buffer), and each part starts at
// its offset within a token's row.
bool packed_qkv(const AttentionConfig& c) { return c.packing == static_cast<int64_t>(Packing::kQKV); }
bool packed_kv(const AttentionConfig& c) { return c.packing == static_cast<int64_t>(Packing::kKV); }

std::vector<int64_t> qkv_shape(const AttentionConfig& c) { return {c.capacity_q, 3, c.num_heads_q, c.head_dim_qk}; }
std::vector<int64_t> kv_shape(const AttentionConfig& c) { return {c.capacity_kv, 2, c.num_heads_kv, c.head_dim_qk}; }
std::vector<int64_t> q_shape(const AttentionConfig& c) {
  if (packed_qkv(c)) return qkv_shape(c);
  return {c.capacity_q, c.num_heads_q, c.head_dim_qk};
}
std::vector<int64_t> k_shape(const AttentionConfig& c) {
  if (packed_qkv(c)) return qkv_shape(c);
  if (packed_kv(c)) return kv_shape(c);
  return {c.capacity_kv, c.num_heads_kv, c.head_dim_qk};
}
std::vector<int64_t> v_shape(const AttentionConfig& c) {
  if (packed_qkv(c)) return qkv_shape(c);
  if (packed_kv(c)) return kv_shape(c);
  return {c.capacity_kv, c.num_heads_kv, c.head_dim_v};
}
std::vector<int64_t> o_shape(const AttentionConfig& c) { return {c.capacity_q, c.num_heads_q, c.head_dim_v}; }
std::vector<int64_t> stats_shape(const AttentionConfig& c) {
  if (c.stats_token_major) return {c.capacity_q, c.num_heads_q};
  return {c.num_heads_q, c.capacity_q};
}

// `elements` into a bf16/fp16 buffer.
void* at(void* base, int64_t elements) { return static_cast<char*>(base) + elements * 2; }

// Device pointers of the three parts, checked against their shapes first.
struct Parts {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
};

ffi::Error check_packing_invariants(const AttentionConfig& c) {
  const char* violation = packing_violation(c);
  FFI_CHECK(violation == nullptr) << violation << " [" << c.describe() << "]";
  return ffi::Error::Success();
}

ffi::Error qkv_parts(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                     const AttentionConfig& c, Parts* parts) {
  FFI_RETURN_IF_ERROR(check_packing_invariants(c));
  const ffi::DataType t = element_type(c);
  FFI_RETURN_IF_ERROR(check_buffer("q", q.element_type(), q.dimensions(), t, q_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("k", k.element_type(), k.dimensions(), t, k_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("v", v.element_type(), v.dimensions(), t, v_shape(c), c));
  *parts = {q.untyped_data(), at(k.untyped_data(), k_part_offset(c)), at(v.untyped_data(), v_part_offset(c))};
  return ffi::Error::Success();
}

ffi::Error check_packing(const AttentionConfig& c, Packing expected, const char* target) {
  FFI_CHECK(c.packing == static_cast<int64_t>(expected))
      << target << " was called with packing " << c.packing << " [" << c.describe() << "]";
  return ffi::Error::Success();
}

ffi::Error forward_impl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        Int32Buffer seq_len_q, Int32Buffer seq_len_kv, Int32Buffer offset_q, Int32Buffer offset_k,
                        Int32Buffer offset_v, Int32Buffer offset_o, Int32Buffer offset_stats,
                        ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> stats,
                        ffi::Result<ffi::Buffer<ffi::U8>> workspace, AttentionConfig c) {
  const IndexArgs idx{seq_len_q, seq_len_kv, offset_q, offset_k, offset_v, offset_o, offset_stats};
  Parts in;
  FFI_RETURN_IF_ERROR(qkv_parts(q, k, v, c, &in));
  FFI_RETURN_IF_ERROR(check_indices(idx, c));
  FFI_RETURN_IF_ERROR(check_buffer("o", o->element_type(), o->dimensions(), element_type(c), o_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("stats", ffi::DataType::F32, stats->dimensions(), ffi::DataType::F32,
                                   stats_shape(c), c));

  std::shared_ptr<const CachedGraph> graph;
  FFI_RETURN_IF_ERROR(forward_graph(device, c, &graph));
  FFI_RETURN_IF_ERROR(check_workspace(static_cast<int64_t>(workspace->element_count()), *graph, c));

  std::unordered_map<int64_t, void*> pack = {
      {static_cast<int64_t>(TensorUid::kQ), in.q},
      {static_cast<int64_t>(TensorUid::kK), in.k},
      {static_cast<int64_t>(TensorUid::kV), in.v},
      {static_cast<int64_t>(TensorUid::kO), o->untyped_data()},
      {static_cast<int64_t>(TensorUid::kStats), stats->untyped_data()},
  };
  add_indices(pack, idx);
  return execute_graph(device, *graph, stream, pack, workspace->untyped_data());
}

// What every backward needs but its gradient results, which differ per packing.
struct BackwardArgs {
  cudaStream_t stream;
  int32_t device;
  ffi::AnyBuffer q, k, v, o, d_o;
  ffi::Buffer<ffi::F32> stats;
  IndexArgs idx;
};

ffi::Error backward_common(const BackwardArgs& a, const Parts& grads, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                           const AttentionConfig& c) {
  const ffi::DataType t = element_type(c);
  Parts in;
  FFI_RETURN_IF_ERROR(qkv_parts(a.q, a.k, a.v, c, &in));
  FFI_RETURN_IF_ERROR(check_indices(a.idx, c));
  FFI_RETURN_IF_ERROR(check_buffer("o", a.o.element_type(), a.o.dimensions(), t, o_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("d_o", a.d_o.element_type(), a.d_o.dimensions(), t, o_shape(c), c));
  FFI_RETURN_IF_ERROR(
      check_buffer("stats", ffi::DataType::F32, a.stats.dimensions(), ffi::DataType::F32, stats_shape(c), c));

  std::shared_ptr<const CachedGraph> graph;
  FFI_RETURN_IF_ERROR(backward_graph(a.device, c, &graph));
  FFI_RETURN_IF_ERROR(check_workspace(static_cast<int64_t>(workspace->element_count()), *graph, c));

  std::unordered_map<int64_t, void*> pack = {
      {static_cast<int64_t>(TensorUid::kQ), in.q},
      {static_cast<int64_t>(TensorUid::kK), in.k},
      {static_cast<int64_t>(TensorUid::kV), in.v},
      {static_cast<int64_t>(TensorUid::kO), a.o.untyped_data()},
      {static_cast<int64_t>(TensorUid::kDO), a.d_o.untyped_data()},
      {static_cast<int64_t>(TensorUid::kStats), a.stats.untyped_data()},
      {static_cast<int64_t>(TensorUid::kDQ), grads.q},
      {static_cast<int64_t>(TensorUid::kDK), grads.k},
      {static_cast<int64_t>(TensorUid::kDV), grads.v},
  };
  add_indices(pack, a.idx);
  return execute_graph(a.device, *graph, a.stream, pack, workspace->untyped_data());
}

#define JAX_RAGGED_ATTN_BACKWARD_PARAMS                                                                          \
  cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o, \
      ffi::AnyBuffer d_o, ffi::Buffer<ffi::F32> stats, Int32Buffer seq_len_q, Int32Buffer seq_len_kv,          \
      Int32Buffer offset_q, Int32Buffer offset_k, Int32Buffer offset_v, Int32Buffer offset_o,                  \
      Int32Buffer offset_stats
#define JAX_RAGGED_ATTN_BACKWARD_ARGS_STRUCT \
  BackwardArgs{stream, device, q, k, v, o, d_o, stats,                                                  \
               IndexArgs{seq_len_q, seq_len_kv, offset_q, offset_k, offset_v, offset_o, offset_stats}}

// Separate q, k, v: dQ, dK, dV are three results.
ffi::Error backward_impl(JAX_RAGGED_ATTN_BACKWARD_PARAMS, ffi::Result<ffi::AnyBuffer> d_q,
                         ffi::Result<ffi::AnyBuffer> d_k, ffi::Result<ffi::AnyBuffer> d_v,
                         ffi::Result<ffi::Buffer<ffi::U8>> workspace, AttentionConfig c) {
  const ffi::DataType t = element_type(c);
  FFI_RETURN_IF_ERROR(check_packing(c, Packing::kSeparate, "the backward handler"));
  FFI_RETURN_IF_ERROR(check_buffer("d_q", d_q->element_type(), d_q->dimensions(), t, q_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("d_k", d_k->element_type(), d_k->dimensions(), t, k_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("d_v", d_v->element_type(), d_v->dimensions(), t, v_shape(c), c));
  const Parts grads{d_q->untyped_data(), d_k->untyped_data(), d_v->untyped_data()};
  return backward_common(JAX_RAGGED_ATTN_BACKWARD_ARGS_STRUCT, grads, workspace, c);
}

// Packed kv: dQ and one dKV [Tkv, 2, Hkv, D] that cuDNN writes dK and dV into, in place.
ffi::Error backward_kvpacked_impl(JAX_RAGGED_ATTN_BACKWARD_PARAMS, ffi::Result<ffi::AnyBuffer> d_q,
                                  ffi::Result<ffi::AnyBuffer> d_kv, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                                  AttentionConfig c) {
  const ffi::DataType t = element_type(c);
  FFI_RETURN_IF_ERROR(check_packing(c, Packing::kKV, "the kv-packed backward handler"));
  FFI_RETURN_IF_ERROR(check_buffer("d_q", d_q->element_type(), d_q->dimensions(), t, q_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("d_kv", d_kv->element_type(), d_kv->dimensions(), t, kv_shape(c), c));
  void* base = d_kv->untyped_data();
  const Parts grads{d_q->untyped_data(), at(base, k_part_offset(c)), at(base, v_part_offset(c))};
  return backward_common(JAX_RAGGED_ATTN_BACKWARD_ARGS_STRUCT, grads, workspace, c);
}

// Packed qkv: one dQKV [T, 3, H, D] that cuDNN writes dQ, dK and dV into, in place.
ffi::Error backward_qkvpacked_impl(JAX_RAGGED_ATTN_BACKWARD_PARAMS, ffi::Result<ffi::AnyBuffer> d_qkv,
                                   ffi::Result<ffi::Buffer<ffi::U8>> workspace, AttentionConfig c) {
  const ffi::DataType t = element_type(c);
  FFI_RETURN_IF_ERROR(check_packing(c, Packing::kQKV, "the qkv-packed backward handler"));
  FFI_RETURN_IF_ERROR(check_buffer("d_qkv", d_qkv->element_type(), d_qkv->dimensions(), t, qkv_shape(c), c));
  void* base = d_qkv->untyped_data();
  const Parts grads{base, at(base, k_part_offset(c)), at(base, v_part_offset(c))};
  return backward_common(JAX_RAGGED_ATTN_BACKWARD_ARGS_STRUCT, grads, workspace, c);
}

// Guard mode: the workspace and every output arrive as extra inputs aliased to the results. Python made
// the workspace longer than the graph asked for and the outputs longer by guard rows on both sides (the
// ragged offsets skip the leading ones), filled the slack with a canary and verifies it after the call.
// Each argument is the same memory as its result, so the arguments themselves are not read here.
ffi::Error forward_guarded_impl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, Int32Buffer seq_len_q, Int32Buffer seq_len_kv, Int32Buffer offset_q,
                                Int32Buffer offset_k, Int32Buffer offset_v, Int32Buffer offset_o,
                                Int32Buffer offset_stats, ffi::Buffer<ffi::U8> /*guarded_workspace*/,
                                ffi::AnyBuffer /*guarded_o*/, ffi::Buffer<ffi::F32> /*guarded_stats*/,
                                ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> stats,
                                ffi::Result<ffi::Buffer<ffi::U8>> workspace, AttentionConfig c) {
  return forward_impl(stream, device, q, k, v, seq_len_q, seq_len_kv, offset_q, offset_k, offset_v, offset_o,
                      offset_stats, o, stats, workspace, c);
}

ffi::Error backward_guarded_impl(JAX_RAGGED_ATTN_BACKWARD_PARAMS, ffi::Buffer<ffi::U8> /*guarded_workspace*/,
                                 ffi::AnyBuffer /*guarded_d_q*/, ffi::AnyBuffer /*guarded_d_k*/,
                                 ffi::AnyBuffer /*guarded_d_v*/, ffi::Result<ffi::AnyBuffer> d_q,
                                 ffi::Result<ffi::AnyBuffer> d_k, ffi::Result<ffi::AnyBuffer> d_v,
                                 ffi::Result<ffi::Buffer<ffi::U8>> workspace, AttentionConfig c) {
  return backward_impl(stream, device, q, k, v, o, d_o, stats, seq_len_q, seq_len_kv, offset_q, offset_k, offset_v,
                       offset_o, offset_stats, d_q, d_k, d_v, workspace, c);
}

ffi::Error backward_kvpacked_guarded_impl(JAX_RAGGED_ATTN_BACKWARD_PARAMS, ffi::Buffer<ffi::U8> /*guarded_workspace*/,
                                          ffi::AnyBuffer /*guarded_d_q*/, ffi::AnyBuffer /*guarded_d_kv*/,
                                          ffi::Result<ffi::AnyBuffer> d_q, ffi::Result<ffi::AnyBuffer> d_kv,
                                          ffi::Result<ffi::Buffer<ffi::U8>> workspace, AttentionConfig c) {
  return backward_kvpacked_impl(stream, device, q, k, v, o, d_o, stats, seq_len_q, seq_len_kv, offset_q, offset_k,
                                offset_v, offset_o, offset_stats, d_q, d_kv, workspace, c);
}

ffi::Error backward_qkvpacked_guarded_impl(JAX_RAGGED_ATTN_BACKWARD_PARAMS,
                                           ffi::Buffer<ffi::U8> /*guarded_workspace*/,
                                           ffi::AnyBuffer /*guarded_d_qkv*/, ffi::Result<ffi::AnyBuffer> d_qkv,
                                           ffi::Result<ffi::Buffer<ffi::U8>> workspace, AttentionConfig c) {
  return backward_qkvpacked_impl(stream, device, q, k, v, o, d_o, stats, seq_len_q, seq_len_kv, offset_q, offset_k,
                                 offset_v, offset_o, offset_stats, d_qkv, workspace, c);
}

}  // namespace
}  // namespace jax_ragged_attn

// The argument lists, once: the guarded variants append the aliased workspace and output arguments.
#define JAX_RAGGED_ATTN_QKV_ARGS                       \
  ffi::Ffi::Bind()                                     \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()        \
      .Ctx<ffi::DeviceOrdinal>()                       \
      .Arg<ffi::AnyBuffer>() /* q */                   \
      .Arg<ffi::AnyBuffer>() /* k */                   \
      .Arg<ffi::AnyBuffer>() /* v */

#define JAX_RAGGED_ATTN_INDEX_ARGS                     \
  .Arg<ffi::Buffer<ffi::S32>>()     /* seq_len_q */    \
      .Arg<ffi::Buffer<ffi::S32>>() /* seq_len_kv */   \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_q */     \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_k */     \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_v */     \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_o */     \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_stats */

#define JAX_RAGGED_ATTN_FORWARD_ARGS JAX_RAGGED_ATTN_QKV_ARGS JAX_RAGGED_ATTN_INDEX_ARGS

#define JAX_RAGGED_ATTN_FORWARD_RETS                   \
  .Ret<ffi::AnyBuffer>()            /* o */            \
      .Ret<ffi::Buffer<ffi::F32>>() /* stats */        \
      .Ret<ffi::Buffer<ffi::U8>>()  /* workspace */    \
      .Attrs<jax_ragged_attn::AttentionConfig>()

#define JAX_RAGGED_ATTN_BACKWARD_ARGS                  \
  JAX_RAGGED_ATTN_QKV_ARGS                             \
      .Arg<ffi::AnyBuffer>()        /* o */            \
      .Arg<ffi::AnyBuffer>()        /* d_o */          \
      .Arg<ffi::Buffer<ffi::F32>>() /* stats */        \
      JAX_RAGGED_ATTN_INDEX_ARGS

// The gradient results, then the workspace: d_q, d_k, d_v (separate); d_q, d_kv (kv packed); d_qkv.
#define JAX_RAGGED_ATTN_BACKWARD_RETS(grads)           \
  grads.Ret<ffi::Buffer<ffi::U8>>() /* workspace */    \
      .Attrs<jax_ragged_attn::AttentionConfig>()
#define JAX_RAGGED_ATTN_THREE .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
#define JAX_RAGGED_ATTN_TWO .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
#define JAX_RAGGED_ATTN_ONE .Ret<ffi::AnyBuffer>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnForward, jax_ragged_attn::forward_impl,
                              JAX_RAGGED_ATTN_FORWARD_ARGS JAX_RAGGED_ATTN_FORWARD_RETS,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnForwardGuarded, jax_ragged_attn::forward_guarded_impl,
                              JAX_RAGGED_ATTN_FORWARD_ARGS.Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>() JAX_RAGGED_ATTN_FORWARD_RETS,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnBackward, jax_ragged_attn::backward_impl,
                              JAX_RAGGED_ATTN_BACKWARD_ARGS JAX_RAGGED_ATTN_BACKWARD_RETS(JAX_RAGGED_ATTN_THREE),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnBackwardGuarded, jax_ragged_attn::backward_guarded_impl,
                              JAX_RAGGED_ATTN_BACKWARD_ARGS.Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>() JAX_RAGGED_ATTN_BACKWARD_RETS(JAX_RAGGED_ATTN_THREE),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnBackwardKVPacked, jax_ragged_attn::backward_kvpacked_impl,
                              JAX_RAGGED_ATTN_BACKWARD_ARGS JAX_RAGGED_ATTN_BACKWARD_RETS(JAX_RAGGED_ATTN_TWO),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnBackwardKVPackedGuarded, jax_ragged_attn::backward_kvpacked_guarded_impl,
                              JAX_RAGGED_ATTN_BACKWARD_ARGS.Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>() JAX_RAGGED_ATTN_BACKWARD_RETS(JAX_RAGGED_ATTN_TWO),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnBackwardQKVPacked, jax_ragged_attn::backward_qkvpacked_impl,
                              JAX_RAGGED_ATTN_BACKWARD_ARGS JAX_RAGGED_ATTN_BACKWARD_RETS(JAX_RAGGED_ATTN_ONE),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnBackwardQKVPackedGuarded,
                              jax_ragged_attn::backward_qkvpacked_guarded_impl,
                              JAX_RAGGED_ATTN_BACKWARD_ARGS.Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>() JAX_RAGGED_ATTN_BACKWARD_RETS(JAX_RAGGED_ATTN_ONE),
                              {ffi::Traits::kCmdBufferCompatible});
