// The Python module: handler capsules, cuDNN loading, trace-time graph queries and the sizing math.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "attention_config.h"
#include "cudnn_frontend_version.h"
#include "cudnn_library.h"
#include "graphs.h"
#include "handlers.h"
#include "sizing.h"

namespace nb = nanobind;

namespace jax_ragged_attn {
namespace {

template <typename T>
T get(const nb::dict& d, const char* name) {
  if (!d.contains(name)) throw nb::key_error(name);
  return nb::cast<T>(d[name]);
}

// The same names as the FFI call's attributes, so Python builds one dict for both.
AttentionConfig config_from_dict(const nb::dict& d) {
  AttentionConfig c;
  c.num_seqs = get<int64_t>(d, "num_seqs");
  c.capacity_q = get<int64_t>(d, "capacity_q");
  c.capacity_kv = get<int64_t>(d, "capacity_kv");
  c.num_heads_q = get<int64_t>(d, "num_heads_q");
  c.num_heads_kv = get<int64_t>(d, "num_heads_kv");
  c.head_dim_qk = get<int64_t>(d, "head_dim_qk");
  c.head_dim_v = get<int64_t>(d, "head_dim_v");
  c.max_seqlen_q = get<int64_t>(d, "max_seqlen_q");
  c.max_seqlen_kv = get<int64_t>(d, "max_seqlen_kv");
  c.dtype = get<int64_t>(d, "dtype");
  c.scale = get<float>(d, "scale");
  c.bottom_right = get<int64_t>(d, "bottom_right");
  c.left_bound = get<int64_t>(d, "left_bound");
  c.right_bound = get<int64_t>(d, "right_bound");
  c.stats_token_major = get<int64_t>(d, "stats_token_major");
  c.use_max_total_seq_len = get<int64_t>(d, "use_max_total_seq_len");
  c.deterministic = get<int64_t>(d, "deterministic");
  c.plan_index = get<int64_t>(d, "plan_index");
  c.packing = get<int64_t>(d, "packing");
  return c;
}

const char* error_kind(const xla::ffi::Error& e) {
  if (e.success()) return "ok";
  switch (*e.errc()) {
    case xla::ffi::ErrorCode::kUnimplemented:
      return "unsupported";
    case xla::ffi::ErrorCode::kUnavailable:
      return "unavailable";
    default:
      return "error";
  }
}

// Builds (or finds) the graph on `device` and describes it. Errors come back as data: Python raises
// NotImplementedError for "unsupported" and RuntimeError otherwise.
nb::dict graph_info(const std::string& direction, int device, const nb::dict& config) {
  const AttentionConfig c = config_from_dict(config);
  nb::dict info;
  xla::ffi::Error status = set_current_device(device);
  std::shared_ptr<const CachedGraph> graph;
  if (status.success()) {
    status = direction == "forward" ? forward_graph(device, c, &graph, /*in_handler=*/false)
                                    : backward_graph(device, c, &graph, /*in_handler=*/false);
  }
  info["status"] = error_kind(status);
  info["message"] = status.message();
  if (graph) {
    info["workspace_bytes"] = graph->workspace_bytes;
    info["max_total_seq_len_applied"] = graph->max_total_seq_len_applied;
    info["frontend_region_bytes"] = graph->frontend_region_bytes;
    info["expected_intermediate_bytes"] = graph->expected_intermediate_bytes;
    info["fell_back"] = graph->fell_back;
    info["plan_index"] = graph->plan_index;
    info["plan_name"] = graph->plan_name;
  }
  return info;
}

// Times every candidate plan of the graph for `config`; errors come back as data, like graph_info's.
nb::dict tune(const std::string& direction, int device, const nb::dict& config) {
  const AttentionConfig c = config_from_dict(config);
  std::vector<PlanTiming> plans;
  xla::ffi::Error status = set_current_device(device);
  if (status.success()) status = tune_plans(device, direction == "forward", c, &plans);
  nb::dict result;
  result["status"] = error_kind(status);
  result["message"] = status.message();
  nb::list timings;
  for (const PlanTiming& p : plans) {
    nb::dict d;
    d["index"] = p.index;
    d["name"] = p.name;
    d["ok"] = p.ok;
    d["message"] = p.message;
    d["workspace_bytes"] = p.workspace_bytes;
    d["median_ms"] = p.median_ms;
    timings.append(d);
  }
  result["plans"] = timings;
  return result;
}

nb::dict intermediates(const nb::dict& config) {
  const BackwardIntermediates s = full_extent_backward_intermediates(config_from_dict(config));
  nb::dict out;
  out["softmax_sum"] = s.softmax_sum;
  out["dq_accum"] = s.dq_accum;
  out["dk_fullhead"] = s.dk_fullhead;
  out["dv_fullhead"] = s.dv_fullhead;
  out["total"] = s.total();
  return out;
}

}  // namespace
}  // namespace jax_ragged_attn

NB_MODULE(_ext, m) {
  using namespace jax_ragged_attn;
  m.doc() = "cuDNN ragged attention for JAX: XLA FFI handlers and trace-time graph queries.";

  m.def("registrations", []() {
    nb::dict d;
    d["jax_ragged_attn_forward"] = nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnForward));
    d["jax_ragged_attn_backward"] = nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnBackward));
    d["jax_ragged_attn_forward_guarded"] = nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnForwardGuarded));
    d["jax_ragged_attn_backward_guarded"] = nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnBackwardGuarded));
    d["jax_ragged_attn_backward_kvpacked"] = nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnBackwardKVPacked));
    d["jax_ragged_attn_backward_kvpacked_guarded"] =
        nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnBackwardKVPackedGuarded));
    d["jax_ragged_attn_backward_qkvpacked"] = nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnBackwardQKVPacked));
    d["jax_ragged_attn_backward_qkvpacked_guarded"] =
        nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnBackwardQKVPackedGuarded));
    return d;
  });
  m.def("load_cudnn", [](const std::string& fallback_path) {
    xla::ffi::Error status = load_cudnn(fallback_path);
    if (status.failure()) throw std::runtime_error(status.message());
  }, nb::arg("fallback_path") = "");
  m.def("cudnn_version", &cudnn_version);
  m.attr("frontend_version") = nb::make_tuple(CUDNN_FRONTEND_MAJOR_VERSION, CUDNN_FRONTEND_MINOR_VERSION,
                                              CUDNN_FRONTEND_PATCH_VERSION);
  m.def("graph_info", &graph_info, nb::arg("direction"), nb::arg("device"), nb::arg("config"));
  m.def("tune_plans", &tune, nb::arg("direction"), nb::arg("device"), nb::arg("config"));
  m.def("graph_cache_stats", []() {
    const GraphCacheStats s = graph_cache_stats();
    nb::dict d;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["handler_builds"] = s.handler_builds;
    d["evictions"] = s.evictions;
    d["size"] = s.size;
    d["capacity"] = s.capacity;
    return d;
  });
  m.def("set_graph_cache_capacity", &set_graph_cache_capacity, nb::arg("capacity"));
  m.def("set_full_extent_fallback_enabled", &set_full_extent_fallback_enabled, nb::arg("enabled"));
  m.def("ragged_span_bytes", &ragged_span_bytes, nb::arg("max_total_seq_len"), nb::arg("dim"), nb::arg("stride"),
        nb::arg("elem_size"));
  m.def("token_stride_only_bytes", &token_stride_only_bytes, nb::arg("max_total_seq_len"), nb::arg("stride"),
        nb::arg("elem_size"));
  m.def("full_extent_backward_intermediates", &intermediates, nb::arg("config"));
}
