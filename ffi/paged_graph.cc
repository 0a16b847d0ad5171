#include "paged_graph.h"

#include <algorithm>
#include <climits>
#include <sstream>
#include <utility>
#include <vector>

#include "check.h"
#include "cudnn_library.h"
#include "graph_cache.h"
#include "lru_graph_cache.h"

namespace jax_ragged_attn {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

int64_t uid(PagedUid u) { return static_cast<int64_t>(u); }

fe::DataType_t io_data_type(const PagedConfig& c) {
  return c.dtype == static_cast<int64_t>(DType::kFloat16) ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

// `ragged_offset`: null for a dense tensor; else the packed rows' offsets (paged_graph.h).
TensorPtr input(fe::graph::Graph& g, PagedUid id, const char* name, std::vector<int64_t> dim,
                std::vector<int64_t> stride, fe::DataType_t type, const TensorPtr& ragged_offset = nullptr) {
  auto attributes = fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid(id))
                        .set_dim(std::move(dim))
                        .set_stride(std::move(stride))
                        .set_data_type(type);
  if (ragged_offset) attributes.set_ragged_offset(ragged_offset);
  return g.tensor(attributes);
}

void mark_output(const TensorPtr& t, PagedUid id, std::vector<int64_t> dim, std::vector<int64_t> stride,
                 fe::DataType_t type, const TensorPtr& ragged_offset = nullptr) {
  t->set_output(true).set_uid(uid(id)).set_dim(std::move(dim)).set_stride(std::move(stride)).set_data_type(type);
  if (ragged_offset) t->set_ragged_offset(ragged_offset);
}

// The fields apply_forward_masks reads, from the paged configuration: always bottom-right (a query's position
// counts from the end of its sequence's keys), the band's extent bounded by Sq and the cache's capacity.
AttentionConfig mask_config(const PagedConfig& c) {
  AttentionConfig m;
  m.num_seqs = c.num_seqs;
  m.max_seqlen_q = c.seqlen_q;
  m.max_seqlen_kv = c.max_seq_len_kv();
  m.softcap = c.softcap;
  m.bottom_right = 1;
  m.left_bound = c.left_bound;
  m.right_bound = c.right_bound;
  return m;
}

// implementation: the frontend's AUTO (its unified SDPA node where that accepts the graph, cuDNN >= 9.15) or
// COMPOSITE, which paged_graph() retries with where AUTO's build fails (build_forward_auto_then_composite):
// packed queries, the combination the frontend's paged-prefill sample runs on the composite node, and softcap
// on cuDNN 9.28.
xla::ffi::Error build_paged(cudnnHandle_t handle, const PagedConfig& c, fe::AttentionImplementation_t implementation,
                            CachedGraph* out) {
  auto g = std::make_shared<InspectableGraph>();
  const fe::DataType_t io = io_data_type(c);
  g->set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const int64_t b = c.num_seqs, s = c.seqlen_q, hq = c.num_heads_q, hkv = c.num_heads_kv;
  const int64_t dqk = c.head_dim_qk, dv = c.head_dim_v, pages = c.num_pages, rows = c.page_size;

  // Row-major [B, Sq, Hq, D] (packed: [T, Hq, D] at ragged offsets, the batch stride then unused) and
  // [pages, page_size, Hkv, D] arrays, seen as cuDNN's (b, h, s, d).
  TensorPtr offset_q, offset_o, offset_stats;
  if (c.packed()) {
    offset_q = input(*g, PagedUid::kOffsetQ, "offset_q", {b + 1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT32);
    offset_o = input(*g, PagedUid::kOffsetO, "offset_o", {b + 1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT32);
    offset_stats =
        input(*g, PagedUid::kOffsetStats, "offset_stats", {b + 1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT32);
  }
  auto q = input(*g, PagedUid::kQ, "q", {b, hq, s, dqk}, {s * hq * dqk, dqk, hq * dqk, 1}, io, offset_q);
  auto k = input(*g, PagedUid::kK, "k_cache", {pages, hkv, rows, dqk}, {rows * hkv * dqk, dqk, hkv * dqk, 1}, io);
  auto v = input(*g, PagedUid::kV, "v_cache", {pages, hkv, rows, dv}, {rows * hkv * dv, dv, hkv * dv, 1}, io);
  auto table = input(*g, PagedUid::kPageTable, "page_table", {b, 1, c.max_pages, 1}, {c.max_pages, c.max_pages, 1, 1},
                     fe::DataType_t::INT32);
  auto seq_len_q = input(*g, PagedUid::kSeqLenQ, "seq_len_q", {b, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT32);
  auto seq_len_kv = input(*g, PagedUid::kSeqLenKV, "seq_len_kv", {b, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT32);

  fe::graph::SDPA_attributes attributes;
  attributes.set_name("paged_sdpa_forward")
      .set_generate_stats(true)
      .set_attn_scale(c.scale)
      .set_paged_attention_k_table(table)
      .set_paged_attention_v_table(table)
      // Set, not inferred from the table: the frontend warns when it has to guess (and paged_config_problem
      // keeps the product within int).
      .set_paged_attention_max_seq_len_kv(static_cast<int>(c.max_seq_len_kv()))
      .set_implementation(implementation);
  apply_forward_masks(attributes, mask_config(c), seq_len_q, seq_len_kv);
  auto [o, stats] = g->sdpa(q, k, v, attributes);
  mark_output(o, PagedUid::kO, {b, hq, s, dv}, {s * hq * dv, dv, hq * dv, 1}, io, offset_o);
  if (c.packed()) {  // token-major rows [T, Hq] at offset_stats
    mark_output(stats, PagedUid::kStats, {b, hq, s, 1}, {s * hq, 1, hq, 1}, fe::DataType_t::FLOAT, offset_stats);
  } else {  // dense [B, Hq, Sq]
    mark_output(stats, PagedUid::kStats, {b, hq, s, 1}, {hq * s, s, 1, 1}, fe::DataType_t::FLOAT);
  }

  FFI_RETURN_IF_ERROR(finalize_graph(*g, handle, /*plan_index=*/-1, c.describe(), /*tuning=*/false, out));
  out->graph = std::move(g);
  return xla::ffi::Error::Success();
}

// build_paged, with a frontend exception reported as an error.
xla::ffi::Error build_paged_guarded(cudnnHandle_t handle, const PagedConfig& c,
                                    fe::AttentionImplementation_t implementation, CachedGraph* out) {
  try {
    return build_paged(handle, c, implementation, out);
  } catch (const std::exception& e) {
    return ErrorStream(xla::ffi::ErrorCode::kInternal)
           << "building the paged cuDNN graph threw: " << e.what() << " [" << c.describe() << "]";
  }
}

// Bounded like graph_cache.cc's (a server's batch sizes and table widths vary), by the same cache template;
// the cuDNN handle is graph_cache.cc's, borrowed through with_cudnn_handle.
constexpr int64_t kCapacity = 64;
LruGraphCache<std::pair<int, PagedConfig>, CachedGraph> paged_graphs(kCapacity);

}  // namespace

std::string paged_config_problem(const PagedConfig& c) {
  std::ostringstream s;
  if (std::min({c.num_seqs, c.seqlen_q, c.num_heads_q, c.num_heads_kv, c.head_dim_qk, c.head_dim_v, c.num_pages,
                c.page_size, c.max_pages}) < 1) {
    s << "every size must be >= 1";
  } else if (c.num_heads_q % c.num_heads_kv != 0) {
    s << "Hq must be a multiple of Hkv";
  } else if (c.dtype != static_cast<int64_t>(DType::kBFloat16) && c.dtype != static_cast<int64_t>(DType::kFloat16)) {
    s << "dtype must be 0 (bfloat16) or 1 (float16)";
  } else if (c.left_bound < -1 || c.right_bound < -1) {
    s << "left_bound and right_bound must be -1 (unbounded) or >= 0";
  } else if (c.max_pages > INT_MAX / c.page_size) {
    s << "max_pages * page_size must fit cuDNN's int max_seq_len_kv";
  } else if (c.total_q < 0) {
    s << "total_q must be 0 (dense queries) or the packed queries' rows";
  } else if (c.packed() && c.total_q > INT_MAX / (c.num_heads_q * std::max(c.head_dim_qk, c.head_dim_v))) {
    s << "packed queries' offsets (T * Hq * D elements) must fit int32";
  } else {
    return "";
  }
  s << " [" << c.describe() << "]";
  return s.str();
}

xla::ffi::Error paged_graph(int device, const PagedConfig& c, std::shared_ptr<const CachedGraph>* out) {
  const std::string problem = paged_config_problem(c);
  FFI_CHECK(problem.empty()) << problem;
  FFI_CHECK(cudnn_loaded()) << "cuDNN is not loaded; import jax_ragged_attn on a CUDA backend first";
  // T only sizes the buffers (paged_graph.h): one graph serves every T of a packed configuration.
  PagedConfig key = c;
  key.total_q = c.packed() ? 1 : 0;
  return paged_graphs.get(
      std::make_pair(device, key),
      [&](CachedGraph* graph) -> xla::ffi::Error {
        RelaxedStreamCapture relaxed;
        return with_cudnn_handle(device, [&](cudnnHandle_t handle) -> xla::ffi::Error {
          return build_forward_auto_then_composite([&](fe::AttentionImplementation_t implementation) {
            return build_paged_guarded(handle, c, implementation, graph);
          });
        });
      },
      out);
}

}  // namespace jax_ragged_attn
