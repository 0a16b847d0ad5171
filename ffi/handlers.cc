// The XLA FFI handlers. They check every buffer against the configuration, fetch the cached graph and
// launch it. They allocate nothing and synchronise nothing: the workspace is an ordinary XLA output whose
// size Python asked for at trace time, so the handlers are safe inside XLA's command buffers (CUDA graphs).
//
// The contract (jax_ragged_attn/backends/cudnn/launch.py builds the calls):
//
//   forward:  args    q, k, v, seq_len_q, seq_len_kv, offset_q, offset_k, offset_v, offset_o, offset_stats
//             [zero-filled: o, stats | check mode: workspace, o, stats]
//             results o [Tq, Hq, Dv], stats f32 [Hq, Tq] or [Tq, Hq], workspace u8
//   backward: args    q, k, v, o, d_o, stats f32, the same seven index arrays
//             [zero-filled: each gradient result in order | check mode: workspace, then those]
//             results d_q, d_k, d_v (packing none) | d_q, d_kv (kv) | d_qkv (qkv); then workspace u8 last
//   both:     attributes: the configuration's fields (attention_config.h), decoded by name
//
// q, k and v are the three parts even when packed (XLA passes the one packed array three times). Trailing
// arguments, when present, are the results' own memory passed in aliased: in check mode (Python's
// check=True) the workspace and every output, made larger than the call needs with a canary in the slack
// that Python verifies afterwards; with row masking "zero_fill" every output but the workspace, zero-filled
// by XLA. They are checked against their results and never read. By default (row masking "unowned") there
// are none, and the zero_outputs attribute has the handler zero, on the stream before the graph runs, the
// rows the graph does not own (padding, rows past max_seqlen, sequences without keys) with the row-zeroing
// kernel (own_kernels.h), or whole outputs with cudaMemsetAsync ("memset", or where the kernel cannot load).
#include "handlers.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "check.h"
#include "cudnn_library.h"
#include "graph_cache.h"
#include "layouts.h"
#include "own_kernels.h"
#include "pinned_graphs.h"

namespace ffi = xla::ffi;

// The attribute decoding, generated from the one field list: the members in the struct's order, by name.
#define JAX_RAGGED_ATTN_STRUCT_MEMBER(type, name, default_value, label, names) , ::xla::ffi::StructMember<type>(#name)
// Expands the field list into the macro's argument list before the macro splits it at the commas.
#define JAX_RAGGED_ATTN_REGISTER_STRUCT(...) XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(__VA_ARGS__)
JAX_RAGGED_ATTN_REGISTER_STRUCT(
    jax_ragged_attn::AttentionConfig JAX_RAGGED_ATTN_CONFIG_FIELDS(JAX_RAGGED_ATTN_STRUCT_MEMBER));
#undef JAX_RAGGED_ATTN_REGISTER_STRUCT
#undef JAX_RAGGED_ATTN_STRUCT_MEMBER

namespace jax_ragged_attn {
namespace {

using Int32Buffer = ffi::Buffer<ffi::S32>;

// Bytes per element of q, k, v, o and the gradients.
int64_t element_bytes(const AttentionConfig& c) { return static_cast<int64_t>(ffi::ByteWidth(element_type(c.dtype))); }

ffi::Error check_index(const char* name, const Int32Buffer& buffer, int64_t expected, const AttentionConfig& c) {
  return check_buffer(name, buffer, ffi::DataType::S32, {expected}, c);
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

// `elements` into a buffer of the configured dtype.
void* at(void* base, int64_t elements, const AttentionConfig& c) {
  return static_cast<char*>(base) + elements * element_bytes(c);
}

// Device pointers of the three parts, checked against their shapes first.
struct Parts {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
};

ffi::Error qkv_parts(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                     const AttentionConfig& c, Parts* parts) {
  FFI_RETURN_IF_ERROR(check_packing(c));
  const ffi::DataType t = element_type(c.dtype);
  FFI_RETURN_IF_ERROR(check_buffer("q", q, t, q_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("k", k, t, k_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("v", v, t, v_shape(c), c));
  *parts = {q.untyped_data(), at(k.untyped_data(), k_part_offset(c), c), at(v.untyped_data(), v_part_offset(c), c)};
  return ffi::Error::Success();
}

// A result as the initial buffers aliased to it are compared with it.
struct ResultView {
  const char* name;
  ffi::DataType type;
  ffi::Span<const int64_t> dims;
};

// The initial buffers after the index arrays, each aliased to a result, so it has that result's type and
// shape: none; or each result but the workspace, in order (zero-filled outputs: rows the kernel does not own
// read 0 without a pass over them); or check mode's canary-filled workspace and then each other result
// (`results` ends with the workspace). Any other count or order means Python and this handler disagree.
ffi::Error check_guarded_args(const ffi::RemainingArgs& guarded, const std::vector<ResultView>& results,
                              const AttentionConfig& c) {
  if (guarded.empty()) return ffi::Error::Success();
  const bool with_workspace = guarded.size() == results.size();
  FFI_CHECK(with_workspace || guarded.size() == results.size() - 1)
      << "after the index arrays come either the " << results.size() - 1
      << " results but the workspace (zero-filled outputs) or the workspace and then those results (check "
      << "mode), " << results.size() << " in all; got " << guarded.size() << " [" << c.describe() << "]";
  for (size_t i = 0; i < guarded.size(); ++i) {
    const ResultView& result = !with_workspace ? results[i] : i == 0 ? results.back() : results[i - 1];
    ffi::ErrorOr<ffi::AnyBuffer> arg = guarded.get<ffi::AnyBuffer>(i);
    if (arg.has_error()) return arg.error();
    FFI_RETURN_IF_ERROR(check_buffer(std::string("the initial buffer aliased to ") + result.name, *arg, result.type,
                                     std::vector<int64_t>(result.dims.begin(), result.dims.end()), c));
  }
  return ffi::Error::Success();
}

// An output buffer and the rows in it that sequences may own (a packed gradient buffer has one region per part).
struct OwnedRows {
  RowRegion region;
  RowOwnership owner;
};
struct OutputRows {
  void* data;
  size_t bytes;
  std::vector<OwnedRows> parts;
};

ffi::Error check_zero_outputs(const AttentionConfig& c) {
  FFI_CHECK(c.zero_outputs >= 0 && c.zero_outputs <= static_cast<int64_t>(ZeroOutputs::kPoisoned))
      << "zero_outputs must be 0 (no), 1 (all), 2 (unowned) or 3 (poisoned), got " << c.zero_outputs;
  return ffi::Error::Success();
}

// Before the graph runs, as the zero_outputs attribute asks (ZeroOutputs, checked by check_zero_outputs): rows the
// graph does not own (padding, rows past max_seqlen, sequences without keys) must read 0.
ffi::Error zero_unowned_outputs(int32_t device, const std::vector<OutputRows>& outputs, const AttentionConfig& c,
                                cudaStream_t stream) {
  const auto mode = static_cast<ZeroOutputs>(c.zero_outputs);
  if (mode == ZeroOutputs::kNo) return ffi::Error::Success();
  std::string unavailable = mode == ZeroOutputs::kAll ? "not asked for" : prepare_own_kernels(device);
  FFI_CHECK(mode != ZeroOutputs::kPoisoned || unavailable.empty())
      << "row masking 'poisoned' needs the row-zeroing kernel: " << unavailable;
  for (const OutputRows& output : outputs) {
    if (!unavailable.empty()) {  // the whole output, at the copy engines' rate
      FFI_RETURN_IF_ERROR(zero_async(output.data, output.bytes, stream));
      continue;
    }
    if (mode == ZeroOutputs::kPoisoned) FFI_RETURN_IF_ERROR(fill_async(output.data, 0xFF, output.bytes, stream));
    for (const OwnedRows& part : output.parts) {
      FFI_RETURN_IF_ERROR(zero_unowned_rows(part.region, part.owner, stream));
    }
  }
  return ffi::Error::Success();
}

ffi::Error forward_impl(cudaStream_t stream, int32_t device, PinnedGraphs* pins, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, Int32Buffer seq_len_q, Int32Buffer seq_len_kv, Int32Buffer offset_q,
                        Int32Buffer offset_k, Int32Buffer offset_v, Int32Buffer offset_o, Int32Buffer offset_stats,
                        ffi::RemainingArgs guarded, ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::Buffer<ffi::F32>> stats, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                        AttentionConfig c) {
  const IndexArgs idx{seq_len_q, seq_len_kv, offset_q, offset_k, offset_v, offset_o, offset_stats};
  FFI_RETURN_IF_ERROR(check_guarded_args(guarded,
                                         {{"o", o->element_type(), o->dimensions()},
                                          {"stats", stats->element_type(), stats->dimensions()},
                                          {"workspace", workspace->element_type(), workspace->dimensions()}},
                                         c));
  Parts in;
  FFI_RETURN_IF_ERROR(qkv_parts(q, k, v, c, &in));
  FFI_RETURN_IF_ERROR(check_indices(idx, c));
  FFI_RETURN_IF_ERROR(check_buffer("o", *o, element_type(c.dtype), o_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("stats", *stats, ffi::DataType::F32, stats_shape(c), c));
  FFI_RETURN_IF_ERROR(check_zero_outputs(c));

  std::shared_ptr<const CachedGraph> graph;
  FFI_RETURN_IF_ERROR(pinned_graph(pins, device, [&](auto* out) { return forward_graph(device, c, out); }, &graph));
  FFI_RETURN_IF_ERROR(check_workspace(static_cast<int64_t>(workspace->element_count()), graph->workspace_bytes, c));
  const int64_t o_row = c.num_heads_q * c.head_dim_v * element_bytes(c);
  const RowOwnership queries{offset_o.untyped_data(), c.num_heads_q * c.head_dim_v, seq_len_q.untyped_data(), nullptr,
                             c.num_seqs};
  const RowOwnership stats_owner{offset_stats.untyped_data(), c.stats_token_major ? c.num_heads_q : 1,
                                 seq_len_q.untyped_data(), nullptr, c.num_seqs};
  // Token-major stats: a row of Hq floats; head-major: one float in each of Hq slices of Tq.
  const RowRegion stats_rows =
      c.stats_token_major ? RowRegion{stats->untyped_data(), c.capacity_q, c.num_heads_q * 4, c.num_heads_q * 4}
                          : RowRegion{stats->untyped_data(), c.capacity_q, 4, 4, c.num_heads_q, c.capacity_q * 4};
  FFI_RETURN_IF_ERROR(zero_unowned_outputs(
      device,
      {{o->untyped_data(), o->size_bytes(), {{{o->untyped_data(), c.capacity_q, o_row, o_row}, queries}}},
       {stats->untyped_data(), stats->size_bytes(), {{stats_rows, stats_owner}}}},
      c, stream));

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

// The backward's results per packing: one gradient buffer per input buffer, of that input's shape, then
// the workspace. `part` says which gradient buffer holds dQ, dK and dV: a packed one holds several, each
// at its part's offset in a token's row.
struct GradientLayout {
  std::vector<std::pair<const char*, std::vector<int64_t>>> buffers;  // name, shape
  int part[3];
};

GradientLayout gradient_layout(const AttentionConfig& c) {
  if (packed_qkv(c)) return {{{"d_qkv", qkv_shape(c)}}, {0, 0, 0}};
  if (packed_kv(c)) return {{{"d_q", q_shape(c)}, {"d_kv", kv_shape(c)}}, {0, 1, 1}};
  return {{{"d_q", q_shape(c)}, {"d_k", k_shape(c)}, {"d_v", v_shape(c)}}, {0, 1, 2}};
}

ffi::Error backward_impl(cudaStream_t stream, int32_t device, PinnedGraphs* pins, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer d_o, ffi::Buffer<ffi::F32> stats,
                         Int32Buffer seq_len_q, Int32Buffer seq_len_kv, Int32Buffer offset_q, Int32Buffer offset_k,
                         Int32Buffer offset_v, Int32Buffer offset_o, Int32Buffer offset_stats,
                         ffi::RemainingArgs guarded, ffi::RemainingRets rets, AttentionConfig c) {
  const IndexArgs idx{seq_len_q, seq_len_kv, offset_q, offset_k, offset_v, offset_o, offset_stats};
  // The packing decides the result list, so it must be a valid one before the results are read.
  FFI_RETURN_IF_ERROR(check_packing(c));
  const GradientLayout layout = gradient_layout(c);
  const size_t num_gradients = layout.buffers.size();
  FFI_CHECK(rets.size() == num_gradients + 1)
      << "the backward with packing " << c.packing << " returns " << num_gradients
      << " gradient buffer(s) and then the workspace (" << num_gradients + 1 << " results), got " << rets.size() << " ["
      << c.describe() << "]";
  std::vector<ffi::AnyBuffer> results;
  std::vector<ResultView> views;
  for (size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
    if (ret.has_error()) return ret.error();
    results.push_back(**ret);
    views.push_back({i < num_gradients ? layout.buffers[i].first : "workspace", results.back().element_type(),
                     results.back().dimensions()});
  }
  const ffi::AnyBuffer& workspace = results.back();
  FFI_CHECK(workspace.element_type() == ffi::DataType::U8)
      << "the backward's last result is the workspace, uint8; got type " << dtype_name(workspace.element_type()) << " ["
      << c.describe() << "]";
  FFI_RETURN_IF_ERROR(check_guarded_args(guarded, views, c));

  const ffi::DataType t = element_type(c.dtype);
  for (size_t i = 0; i < num_gradients; ++i) {
    const auto& [name, shape] = layout.buffers[i];
    FFI_RETURN_IF_ERROR(check_buffer(name, results[i], t, shape, c));
  }
  const Parts grads{at(results[layout.part[0]].untyped_data(), 0, c),
                    at(results[layout.part[1]].untyped_data(), k_part_offset(c), c),
                    at(results[layout.part[2]].untyped_data(), v_part_offset(c), c)};

  Parts in;
  FFI_RETURN_IF_ERROR(qkv_parts(q, k, v, c, &in));
  FFI_RETURN_IF_ERROR(check_indices(idx, c));
  FFI_RETURN_IF_ERROR(check_buffer("o", o, t, o_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("d_o", d_o, t, o_shape(c), c));
  FFI_RETURN_IF_ERROR(check_buffer("stats", stats, ffi::DataType::F32, stats_shape(c), c));
  FFI_RETURN_IF_ERROR(check_zero_outputs(c));

  std::shared_ptr<const CachedGraph> graph;
  FFI_RETURN_IF_ERROR(pinned_graph(pins, device, [&](auto* out) { return backward_graph(device, c, out); }, &graph));
  FFI_RETURN_IF_ERROR(check_workspace(static_cast<int64_t>(workspace.element_count()), graph->workspace_bytes, c));
  // Each part of a gradient buffer has its own rows: dQ's are the queries', dK's and dV's the keys' (and a
  // sequence without queries gets its dK/dV rows zeroed too, whatever cuDNN does with them).
  const RowOwnership queries{offset_q.untyped_data(), q_token_stride(c), seq_len_q.untyped_data(), nullptr, c.num_seqs};
  const RowOwnership keys{offset_k.untyped_data(), k_token_stride(c), seq_len_kv.untyped_data(),
                          seq_len_q.untyped_data(), c.num_seqs};
  const RowOwnership values{offset_v.untyped_data(), v_token_stride(c), seq_len_kv.untyped_data(),
                            seq_len_q.untyped_data(), c.num_seqs};
  const int64_t e = element_bytes(c);
  const OwnedRows part_rows[3] = {
      {{grads.q, c.capacity_q, q_token_stride(c) * e, c.num_heads_q * c.head_dim_qk * e}, queries},
      {{grads.k, c.capacity_kv, k_token_stride(c) * e, c.num_heads_kv * c.head_dim_qk * e}, keys},
      {{grads.v, c.capacity_kv, v_token_stride(c) * e, c.num_heads_kv * c.head_dim_v * e}, values}};
  std::vector<OutputRows> outputs;
  for (size_t i = 0; i < num_gradients; ++i) {
    outputs.push_back({results[i].untyped_data(), results[i].size_bytes(), {}});
    for (int part = 0; part < 3; ++part) {
      if (layout.part[part] == static_cast<int>(i)) outputs.back().parts.push_back(part_rows[part]);
    }
  }
  FFI_RETURN_IF_ERROR(zero_unowned_outputs(device, outputs, c, stream));

  std::unordered_map<int64_t, void*> pack = {
      {static_cast<int64_t>(TensorUid::kQ), in.q},
      {static_cast<int64_t>(TensorUid::kK), in.k},
      {static_cast<int64_t>(TensorUid::kV), in.v},
      {static_cast<int64_t>(TensorUid::kO), o.untyped_data()},
      {static_cast<int64_t>(TensorUid::kDO), d_o.untyped_data()},
      {static_cast<int64_t>(TensorUid::kStats), stats.untyped_data()},
      {static_cast<int64_t>(TensorUid::kDQ), grads.q},
      {static_cast<int64_t>(TensorUid::kDK), grads.k},
      {static_cast<int64_t>(TensorUid::kDV), grads.v},
  };
  add_indices(pack, idx);
  return execute_graph(device, *graph, stream, pack, workspace.untyped_data());
}

// The initialize stage (pinned_graphs.h): runs before every execution, outside any CUDA-graph capture, so the
// graph is built and pinned here and the execute stage never builds one inside a capture. The row-zeroing kernel
// is readied here too: loading its module is not capture-safe either.
ffi::Error initialize_impl(Direction direction, int32_t device, PinnedGraphs* pins, AttentionConfig c) {
  FFI_RETURN_IF_ERROR(check_zero_outputs(c));
  c.zero_outputs = 0;  // not part of the graph (graph_cache.cc); checked above
  std::shared_ptr<const CachedGraph> graph;
  FFI_RETURN_IF_ERROR(pinned_graph(
      pins, device,
      [&](auto* out) {
        return direction == Direction::kForward ? forward_graph(device, c, out) : backward_graph(device, c, out);
      },
      &graph));
  (void)prepare_own_kernels(device);  // where it cannot load, the execute stage falls back to memset
  return ffi::Error::Success();
}

ffi::Error initialize_forward(int32_t device, PinnedGraphs* pins, AttentionConfig c) {
  return initialize_impl(Direction::kForward, device, pins, c);
}
ffi::Error initialize_backward(int32_t device, PinnedGraphs* pins, AttentionConfig c) {
  return initialize_impl(Direction::kBackward, device, pins, c);
}

}  // namespace
}  // namespace jax_ragged_attn

#define JAX_RAGGED_ATTN_INITIALIZE_BINDING              \
  ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()    \
      .Ctx<ffi::DeviceOrdinal>()                        \
      .Ctx<ffi::State<jax_ragged_attn::PinnedGraphs>>() \
      .Attrs<jax_ragged_attn::AttentionConfig>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnForwardInitialize, jax_ragged_attn::initialize_forward,
                              JAX_RAGGED_ATTN_INITIALIZE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnBackwardInitialize, jax_ragged_attn::initialize_backward,
                              JAX_RAGGED_ATTN_INITIALIZE_BINDING);

#define JAX_RAGGED_ATTN_INDEX_ARGS                   \
  .Arg<ffi::Buffer<ffi::S32>>()     /* seq_len_q */  \
      .Arg<ffi::Buffer<ffi::S32>>() /* seq_len_kv */ \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_q */   \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_k */   \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_v */   \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_o */   \
      .Arg<ffi::Buffer<ffi::S32>>() /* offset_stats */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnForward, jax_ragged_attn::forward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<jax_ragged_attn::PinnedGraphs>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                              JAX_RAGGED_ATTN_INDEX_ARGS
                                  .RemainingArgs()               // [workspace,] o, stats: see above
                                  .Ret<ffi::AnyBuffer>()         // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // stats
                                  .Ret<ffi::Buffer<ffi::U8>>()   // workspace
                                  .Attrs<jax_ragged_attn::AttentionConfig>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnBackward, jax_ragged_attn::backward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<jax_ragged_attn::PinnedGraphs>>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // o
                                  .Arg<ffi::AnyBuffer>()         // d_o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // stats
                              JAX_RAGGED_ATTN_INDEX_ARGS
                                  .RemainingArgs()  // [workspace,] each gradient: see above
                                  .RemainingRets()  // the gradients per packing, then the workspace
                                  .Attrs<jax_ragged_attn::AttentionConfig>(),
                              {ffi::Traits::kCmdBufferCompatible});

// File-local, also in a unity build (CMakeLists.txt) where the next source follows in the same unit.
#undef JAX_RAGGED_ATTN_INITIALIZE_BINDING
#undef JAX_RAGGED_ATTN_INDEX_ARGS
