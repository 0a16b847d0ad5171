// The Python module: handler capsules, cuDNN loading, trace-time graph queries and the sizing math.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_config.h"
#include "cache_index.h"
#include "check.h"
#include "cudnn_frontend_version.h"
#include "cudnn_library.h"
#include "cudnn_version.h"
#include "graph_cache.h"
#include "handlers.h"
#include "own_kernels.h"
#include "paged_config.h"
#include "paged_graph.h"
#include "paged_handler.h"
#include "pinned_graphs.h"
#include "sizing.h"
#include "zero_rows.h"

namespace nb = nanobind;

namespace jax_ragged_attn {
namespace {

// Every FFI target the extension registers, each under the role Python knows it by. Python registers them all
// for platform "CUDA" in one loop (backends/shared/extension.py) and calls them by these names.
struct Target {
  const char* role;
  const char* name;
  XLA_FFI_Handler* execute;
  // The attention handlers' initialize stage, which pins their graph (pinned_graphs.h says why); such a target
  // is a bundle of FFI stages with JaxRaggedAttnInstantiate. nullptr: a plain handler.
  XLA_FFI_Handler* initialize;
};

const Target kTargets[] = {
    // The ragged attention's two handlers; check mode and the packed layouts are the same two (handlers.cc).
    {"forward", "jax_ragged_attn_forward", JaxRaggedAttnForward, JaxRaggedAttnForwardInitialize},
    {"backward", "jax_ragged_attn_backward", JaxRaggedAttnBackward, JaxRaggedAttnBackwardInitialize},
    // cuDNN's paged SDPA forward for the KV-cache op (paged_handler.h).
    {"paged_forward", "jax_ragged_attn_paged_forward", JaxRaggedAttnPagedForward, JaxRaggedAttnPagedInitialize},
    // Our own kernels' handlers for other backends: unused rows of packed buffers zeroed (zero_rows.h), a KV
    // cache's lengths and page table clamped for kernels that read them unchecked (cache_index.h).
    {"zero_rows", "jax_ragged_attn_zero_rows", JaxRaggedAttnZeroRows, nullptr},
    {"clamp_cache_index", "jax_ragged_attn_clamp_cache_index", JaxRaggedAttnClampCacheIndex, nullptr},
};

nb::capsule handler_capsule(XLA_FFI_Handler* handler) { return nb::capsule(reinterpret_cast<void*>(handler)); }

// A target's handler as jax.ffi.register_ffi_target takes it: a capsule, or a dict of stage capsules.
nb::object handler_registration(const Target& target) {
  if (target.initialize == nullptr) return handler_capsule(target.execute);
  nb::dict stages;
  stages["instantiate"] = handler_capsule(JaxRaggedAttnInstantiate);
  stages["initialize"] = handler_capsule(target.initialize);
  stages["execute"] = handler_capsule(target.execute);
  return stages;
}

template <typename T>
T get(const nb::dict& d, const char* name) {
  if (!d.contains(name)) throw nb::key_error(name);
  return nb::cast<T>(d[name]);
}

// A configuration (AttentionConfig, PagedConfig) from the dict Python builds with the same names as the FFI
// call's attributes. Every field is required and no other key is accepted: a misspelt or stale key would
// otherwise be ignored silently. `what` names the configuration in the error.
template <typename Config>
Config config_from_dict(const nb::dict& d, const char* what) {
  Config c;
  std::set<std::string> known;
  Config::for_each_field(c, [&](const char* name, auto&) { known.insert(name); });
  std::string unknown;
  for (auto [key, value] : d) {
    const std::string name = nb::cast<std::string>(key);
    if (!known.count(name)) unknown += (unknown.empty() ? "" : ", ") + name;
  }
  if (!unknown.empty()) throw nb::value_error(("unknown " + std::string(what) + " field(s): " + unknown).c_str());
  Config::for_each_field(c,
                         [&](const char* name, auto& value) { value = get<std::decay_t<decltype(value)>>(d, name); });
  return c;
}

AttentionConfig attention_config(const nb::dict& d) { return config_from_dict<AttentionConfig>(d, "configuration"); }
PagedConfig paged_config(const nb::dict& d) { return config_from_dict<PagedConfig>(d, "paged configuration"); }

// The decoded configuration back as a dict: what the handlers and the graph cache see.
nb::dict decode_config(const nb::dict& config) {
  const AttentionConfig c = attention_config(config);
  nb::dict d;
  AttentionConfig::for_each_field(c, [&](const char* name, const auto& value) { d[name] = value; });
  return d;
}

std::string describe_config(const nb::dict& config) { return attention_config(config).describe(); }

std::string paged_problem(const nb::dict& config) { return paged_config_problem(paged_config(config)); }

// A configuration's fields in order, as (name, attribute type).
template <size_t N>
nb::list field_list(const ConfigField (&fields)[N]) {
  nb::list list;
  for (const ConfigField& field : fields) list.append(nb::make_tuple(field.name, field.type));
  return list;
}
nb::list config_fields() { return field_list(kConfigFields); }
nb::list paged_config_fields() { return field_list(kPagedConfigFields); }

void load_cudnn_or_raise(const std::string& fallback_path) {
  const xla::ffi::Error status = load_cudnn(fallback_path);
  if (status.failure()) throw std::runtime_error(status.message());
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

// Runs `query` with `device` current and without the GIL (a graph build takes up to a second: other Python
// threads trace and dispatch meanwhile); the caller's device is current again on the way out.
template <typename Query>
xla::ffi::Error on_device(int device, Query&& query) {
  nb::gil_scoped_release released;
  ScopedCurrentDevice current;
  FFI_RETURN_IF_ERROR(current.set(device));
  return query();
}

// A trace-time answer: the status as data (Python raises NotImplementedError for "unsupported" and
// RuntimeError otherwise) and, where a graph was built or found, what it needs.
nb::dict graph_answer(const xla::ffi::Error& status, const std::shared_ptr<const CachedGraph>& graph) {
  nb::dict info;
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

// Builds (or finds) the training graph of `direction` on `device` and describes it.
nb::dict graph_info(const std::string& direction, int device, const nb::dict& config) {
  const AttentionConfig c = attention_config(config);
  std::shared_ptr<const CachedGraph> graph;
  std::string row_zeroing;
  const xla::ffi::Error status = on_device(device, [&] {
    FFI_RETURN_IF_ERROR(direction == "forward" ? forward_graph(device, c, &graph, /*in_handler=*/false)
                                               : backward_graph(device, c, &graph, /*in_handler=*/false));
    // Readied with the graphs, at trace time, so no handler loads it while XLA may capture its stream; where
    // it cannot run, the handlers zero whole outputs instead (own_kernels.h).
    row_zeroing = prepare_own_kernels(device);
    return xla::ffi::Error::Success();
  });
  nb::dict info = graph_answer(status, graph);
  if (status.success()) info["row_zeroing"] = row_zeroing.empty() ? std::string("ready") : row_zeroing;
  return info;
}

// The same for the paged forward's graph.
nb::dict paged_graph_info(int device, const nb::dict& config) {
  const PagedConfig c = paged_config(config);
  std::shared_ptr<const CachedGraph> graph;
  const xla::ffi::Error status = on_device(device, [&] { return paged_graph(device, c, &graph); });
  return graph_answer(status, graph);
}

// Times every candidate plan of the graph for `config`; errors come back as data, like graph_info's.
nb::dict tune(const std::string& direction, int device, const nb::dict& config) {
  const AttentionConfig c = attention_config(config);
  std::vector<PlanTiming> plans;
  const xla::ffi::Error status =
      on_device(device, [&] { return tune_plans(device, direction == "forward", c, &plans); });
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
  const BackwardIntermediates s = full_extent_backward_intermediates(
      attention_config(config), current_build_settings(Direction::kBackward).dp_workspace_limit_set);
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

  // {name: handler} for every target (kTargets). The state type the attention handlers share must be
  // registered before them (state_type_registrations).
  m.def("registrations", []() {
    nb::dict d;
    for (const Target& target : kTargets) d[target.name] = handler_registration(target);
    return d;
  });
  // {role: name} for every target.
  m.def("targets", []() {
    nb::dict d;
    for (const Target& target : kTargets) d[target.role] = target.name;
    return d;
  });
  m.def("state_type_registrations", []() {
    nb::dict registration;
    registration["type_id"] = nb::capsule(reinterpret_cast<void*>(&PinnedGraphs::id));
    registration["type_info"] = nb::capsule(const_cast<void*>(static_cast<const void*>(&kPinnedGraphsTypeInfo)));
    nb::dict d;
    d["jax_ragged_attn.pinned_graphs"] = registration;
    return d;
  });
  m.def("paged_config_fields", &paged_config_fields,
        "The paged configuration's fields in order, as (name, attribute type: \"int64\" or \"float32\").");
  m.def("paged_config_problem", &paged_problem, nb::arg("config"),
        "Why the paged configuration is invalid, or \"\" (raises on a missing or unknown field).");
  m.def("paged_graph_info", &paged_graph_info, nb::arg("device"), nb::arg("config"));
  m.def("config_fields", &config_fields,
        "The configuration's fields in order, as (name, attribute type: \"int64\" or \"float32\").");
  m.def("decode_config", &decode_config, nb::arg("config"),
        "The configuration as the extension decodes it (raises on a missing or unknown field).");
  m.def("describe_config", &describe_config, nb::arg("config"));
  m.def("load_cudnn", &load_cudnn_or_raise, nb::arg("fallback_path") = "");
  m.def("cudnn_version", &cudnn_version);
  m.attr("frontend_version") =
      nb::make_tuple(CUDNN_FRONTEND_MAJOR_VERSION, CUDNN_FRONTEND_MINOR_VERSION, CUDNN_FRONTEND_PATCH_VERSION);
  // The cuDNN headers the extension was compiled against (major * 10000 + minor * 100 + patch): the frontend
  // turns on a feature only where both these and the loaded library have it (min of the two versions), so a
  // build against older headers runs a newer cuDNN on the older paths.
  m.attr("cudnn_header_version") = CUDNN_VERSION;
  m.def("graph_info", &graph_info, nb::arg("direction"), nb::arg("device"), nb::arg("config"));
  m.def("tune_plans", &tune, nb::arg("direction"), nb::arg("device"), nb::arg("config"));
  // "" when our own kernels are loaded and readied on `device`, else why they cannot run there.
  m.def("prepare_own_kernels", &prepare_own_kernels, nb::arg("device"));
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
