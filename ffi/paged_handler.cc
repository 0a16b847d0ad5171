// The handler of cuDNN's paged SDPA forward (paged_graph.h), separate from the training handlers: it checks
// every buffer against the configuration, fetches the cached graph and launches it. Like those it allocates
// and synchronises nothing: the workspace is an ordinary XLA result whose size Python asked for at trace
// time (paged_graph_info), so it is safe inside XLA's command buffers.
//
//   args:       q [B, Sq, Hq, Dqk] (packed: [T, Hq, Dqk]), k_cache [num_pages, page_size, Hkv, Dqk], v_cache
//               [num_pages, page_size, Hkv, Dv] (bfloat16 or float16, all alike), page_table int32 [B, max_pages]
//               (every entry a sequence uses inside [0, num_pages)), seq_len_q int32 [B] (<= Sq; packed: also
//               <= the sequence's rows), seq_len_kv int32 [B] (<= max_pages * page_size), offset_q, offset_o
//               and offset_stats int32 [B + 1] (packed: the rows' ragged offsets, paged_graph.h; dense: [0])
//   results:    o like q with Dv, stats float32 [B, Hq, Sq] (packed: [T, Hq]), workspace uint8
//   attributes: the PagedConfig fields (paged_config.h), by name
//
// cuDNN writes the rows of each sequence's first seq_len_q queries that have keys; the others are left as
// they were (Python masks them).
#include "paged_handler.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "check.h"
#include "graph_cache.h"
#include "paged_graph.h"
#include "pinned_graphs.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define JAX_RAGGED_ATTN_PAGED_MEMBER(type, name, label) , ::xla::ffi::StructMember<type>(#name)
// Expands the field list into the macro's argument list before the macro splits it at the commas.
#define JAX_RAGGED_ATTN_REGISTER_PAGED(...) XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(__VA_ARGS__)
JAX_RAGGED_ATTN_REGISTER_PAGED(jax_ragged_attn::PagedConfig JAX_RAGGED_ATTN_PAGED_FIELDS(JAX_RAGGED_ATTN_PAGED_MEMBER));
#undef JAX_RAGGED_ATTN_REGISTER_PAGED
#undef JAX_RAGGED_ATTN_PAGED_MEMBER

namespace jax_ragged_attn {
namespace {

ffi::Error paged_forward_impl(cudaStream_t stream, int32_t device, PinnedGraphs* pins, ffi::AnyBuffer q,
                              ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> seq_len_q, ffi::Buffer<ffi::S32> seq_len_kv,
                              ffi::Buffer<ffi::S32> offset_q, ffi::Buffer<ffi::S32> offset_o,
                              ffi::Buffer<ffi::S32> offset_stats, ffi::Result<ffi::AnyBuffer> o,
                              ffi::Result<ffi::Buffer<ffi::F32>> stats, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                              PagedConfig c) {
  const std::string problem = paged_config_problem(c);
  FFI_CHECK(problem.empty()) << problem;
  const ffi::DataType t = element_type(c.dtype);
  const ffi::DataType s32 = ffi::DataType::S32;
  const int64_t b = c.num_seqs;
  // Packed: [T, Hq, D] rows; dense: [B, Sq, Hq, D].
  const auto rows_of = [&](int64_t dim) {
    return c.packed() ? std::vector<int64_t>{c.total_q, c.num_heads_q, dim}
                      : std::vector<int64_t>{b, c.seqlen_q, c.num_heads_q, dim};
  };
  FFI_RETURN_IF_ERROR(check_buffer("q", q, t, rows_of(c.head_dim_qk), c));
  FFI_RETURN_IF_ERROR(
      check_buffer("k_cache", k_cache, t, {c.num_pages, c.page_size, c.num_heads_kv, c.head_dim_qk}, c));
  FFI_RETURN_IF_ERROR(check_buffer("v_cache", v_cache, t, {c.num_pages, c.page_size, c.num_heads_kv, c.head_dim_v}, c));
  FFI_RETURN_IF_ERROR(check_buffer("page_table", page_table, s32, {b, c.max_pages}, c));
  FFI_RETURN_IF_ERROR(check_buffer("seq_len_q", seq_len_q, s32, {b}, c));
  FFI_RETURN_IF_ERROR(check_buffer("seq_len_kv", seq_len_kv, s32, {b}, c));
  const int64_t offsets = c.packed() ? b + 1 : 0;
  FFI_RETURN_IF_ERROR(check_buffer("offset_q", offset_q, s32, {offsets}, c));
  FFI_RETURN_IF_ERROR(check_buffer("offset_o", offset_o, s32, {offsets}, c));
  FFI_RETURN_IF_ERROR(check_buffer("offset_stats", offset_stats, s32, {offsets}, c));
  FFI_RETURN_IF_ERROR(check_buffer("o", *o, t, rows_of(c.head_dim_v), c));
  const std::vector<int64_t> stats_shape =
      c.packed() ? std::vector<int64_t>{c.total_q, c.num_heads_q} : std::vector<int64_t>{b, c.num_heads_q, c.seqlen_q};
  FFI_RETURN_IF_ERROR(check_buffer("stats", *stats, ffi::DataType::F32, stats_shape, c));
  FFI_CHECK(workspace->dimensions().size() == 1) << "the workspace must be a 1-D uint8 buffer [" << c.describe() << "]";

  std::shared_ptr<const CachedGraph> graph;
  FFI_RETURN_IF_ERROR(pinned_graph(pins, device, [&](auto* out) { return paged_graph(device, c, out); }, &graph));
  FFI_RETURN_IF_ERROR(check_workspace(static_cast<int64_t>(workspace->element_count()), graph->workspace_bytes, c));
  std::unordered_map<int64_t, void*> pack = {
      {static_cast<int64_t>(PagedUid::kQ), q.untyped_data()},
      {static_cast<int64_t>(PagedUid::kK), k_cache.untyped_data()},
      {static_cast<int64_t>(PagedUid::kV), v_cache.untyped_data()},
      {static_cast<int64_t>(PagedUid::kO), o->untyped_data()},
      {static_cast<int64_t>(PagedUid::kStats), stats->untyped_data()},
      {static_cast<int64_t>(PagedUid::kPageTable), page_table.untyped_data()},
      {static_cast<int64_t>(PagedUid::kSeqLenQ), seq_len_q.untyped_data()},
      {static_cast<int64_t>(PagedUid::kSeqLenKV), seq_len_kv.untyped_data()},
  };
  if (c.packed()) {
    pack[static_cast<int64_t>(PagedUid::kOffsetQ)] = offset_q.untyped_data();
    pack[static_cast<int64_t>(PagedUid::kOffsetO)] = offset_o.untyped_data();
    pack[static_cast<int64_t>(PagedUid::kOffsetStats)] = offset_stats.untyped_data();
  }
  return execute_graph(device, *graph, stream, pack, workspace->untyped_data());
}

// The initialize stage (pinned_graphs.h): the graph built and pinned outside any CUDA-graph capture.
ffi::Error paged_initialize_impl(int32_t device, PinnedGraphs* pins, PagedConfig c) {
  const std::string problem = paged_config_problem(c);
  FFI_CHECK(problem.empty()) << problem;
  std::shared_ptr<const CachedGraph> graph;
  return pinned_graph(pins, device, [&](auto* out) { return paged_graph(device, c, out); }, &graph);
}

}  // namespace
}  // namespace jax_ragged_attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnPagedInitialize, jax_ragged_attn::paged_initialize_impl,
                              ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<jax_ragged_attn::PinnedGraphs>>()
                                  .Attrs<jax_ragged_attn::PagedConfig>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRaggedAttnPagedForward, jax_ragged_attn::paged_forward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<jax_ragged_attn::PinnedGraphs>>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_len_q
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_len_kv
                                  .Arg<ffi::Buffer<ffi::S32>>()  // offset_q
                                  .Arg<ffi::Buffer<ffi::S32>>()  // offset_o
                                  .Arg<ffi::Buffer<ffi::S32>>()  // offset_stats
                                  .Ret<ffi::AnyBuffer>()         // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // stats
                                  .Ret<ffi::Buffer<ffi::U8>>()   // workspace
                                  .Attrs<jax_ragged_attn::PagedConfig>(),
                              {ffi::Traits::kCmdBufferCompatible});
