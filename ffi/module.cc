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
#include "cudnn_version.h"
#include "cudnn_library.h"
#include "graph_cache.h"
#include "handlers.h"
#include "paged_config.h"
#include "paged_graph.h"
#include "paged_handler.h"
#include "own_kernels.h"
#include "pinned_graphs.h"
#include "zero_rows.h"
#include "sizing.h"

namespace nb = nanobind;

namespace jax_ragged_attn {
namespace {

// The FFI target names the handlers are registered under.
constexpr const char* kForwardTarget = "jax_ragged_attn_forward";
constexpr const char* kBackwardTarget = "jax_ragged_attn_backward";
constexpr const char* kZeroRowsTarget = "jax_ragged_attn_zero_rows";
constexpr const char* kClampCacheIndexTarget = "jax_ragged_attn_clamp_cache_index";
constexpr const char* kPagedTarget = "jax_ragged_attn_paged_forward";

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
  Config::for_each_field(c, [&](const char* name, auto& value) { value = get<std::decay_t<decltype(value)>>(d, name); });
  return c;
}

AttentionConfig attention_config(const nb::dict& d) { return config_from_dict<AttentionConfig>(d, "configuration"); }
PagedConfig paged_config(const nb::dict& d) { return config_from_dict<PagedConfig>(d, "paged configuration"); }

// The decoded configuration back as a dict: what the handlers and the graph cache see.
nb::dict config_to_dict(const AttentionConfig& c) {
  nb::dict d;
  AttentionConfig::for_each_field(c, [&](const char* name, const auto& value) { d[name] = value; });
  return d;
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

// The stages of an attention handler, as jax.ffi.register_ffi_target takes them.
nb::dict stage_bundle(void* initialize, void* execute) {
  nb::dict stages;
  stages["instantiate"] = nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnInstantiate));
  stages["initialize"] = nb::capsule(initialize);
  stages["execute"] = nb::capsule(execute);
  return stages;
}

}  // namespace
}  // namespace jax_ragged_attn

NB_MODULE(_ext, m) {
  using namespace jax_ragged_attn;
  m.doc() = "cuDNN ragged attention for JAX: XLA FFI handlers and trace-time graph queries.";

  // Each attention handler is a bundle of FFI stages (pinned_graphs.h says why), registered as a dict of stage
  // capsules; the state type they share must be registered before them (state_type_registrations).
  m.def("registrations", []() {
    nb::dict d;
    d[kForwardTarget] = stage_bundle(reinterpret_cast<void*>(JaxRaggedAttnForwardInitialize),
                                     reinterpret_cast<void*>(JaxRaggedAttnForward));
    d[kBackwardTarget] = stage_bundle(reinterpret_cast<void*>(JaxRaggedAttnBackwardInitialize),
                                      reinterpret_cast<void*>(JaxRaggedAttnBackward));
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
  m.def("targets", []() {
    nb::dict d;
    d["forward"] = kForwardTarget;
    d["backward"] = kBackwardTarget;
    return d;
  });
  // The attention handlers are the two above; the zero-rows utility (zero_rows.h), which other backends use
  // on their buffers, is registered on its own.
  m.def("zero_rows_registration", []() {
    return nb::make_tuple(kZeroRowsTarget, nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnZeroRows)));
  });
  // The KV-cache index clamp (cache_index.h), for kernels that read a cache's lengths and page table unchecked.
  m.def("cache_index_registration", []() {
    return nb::make_tuple(kClampCacheIndexTarget,
                          nb::capsule(reinterpret_cast<void*>(JaxRaggedAttnClampCacheIndex)));
  });
  // cuDNN's paged SDPA forward for the KV-cache op (paged_handler.h), a handler of its own, registered like the
  // zero-rows utility.
  m.def("paged_registration", []() {
    return nb::make_tuple(kPagedTarget, stage_bundle(reinterpret_cast<void*>(JaxRaggedAttnPagedInitialize),
                                                     reinterpret_cast<void*>(JaxRaggedAttnPagedForward)));
  });
  m.def("paged_config_fields", []() {
    nb::list fields;
    for (const ConfigField& field : kPagedConfigFields) fields.append(nb::make_tuple(field.name, field.type));
    return fields;
  }, "The paged configuration's fields in order, as (name, attribute type: \"int64\" or \"float32\").");
  m.def("paged_config_problem",
        [](const nb::dict& config) { return paged_config_problem(paged_config(config)); },
        nb::arg("config"), "Why the paged configuration is invalid, or \"\" (raises on a missing or unknown field).");
  m.def("paged_graph_info", &paged_graph_info, nb::arg("device"), nb::arg("config"));
  m.def("config_fields", []() {
    nb::list fields;
    for (const ConfigField& field : kConfigFields) fields.append(nb::make_tuple(field.name, field.type));
    return fields;
  }, "The configuration's fields in order, as (name, attribute type: \"int64\" or \"float32\").");
  m.def("decode_config", [](const nb::dict& config) { return config_to_dict(attention_config(config)); },
        nb::arg("config"), "The configuration as the extension decodes it (raises on a missing or unknown field).");
  m.def("describe_config", [](const nb::dict& config) { return attention_config(config).describe(); },
        nb::arg("config"));
  m.def("load_cudnn", [](const std::string& fallback_path) {
    xla::ffi::Error status = load_cudnn(fallback_path);
    if (status.failure()) throw std::runtime_error(status.message());
  }, nb::arg("fallback_path") = "");
  m.def("cudnn_version", &cudnn_version);
  m.attr("frontend_version") = nb::make_tuple(CUDNN_FRONTEND_MAJOR_VERSION, CUDNN_FRONTEND_MINOR_VERSION,
                                              CUDNN_FRONTEND_PATCH_VERSION);
  // The cuDNN headers the extension was compiled against (major * 10000 + minor * 100 + patch): the frontend
  // turns on a feature only where both these and the loaded library have it (min of the two versions), so a
  // build against older headers runs a newer cuDNN on the older paths.
  m.attr("cudnn_header_version") = CUDNN_VERSION;
  m.def("graph_info", &graph_info, nb::arg("direction"), nb::arg("device"), nb::arg("config"));
  m.def("tune_plans", &tune, nb::arg("direction"), nb::arg("device"), nb::arg("config"));
  // "" when the row-zeroing kernel is loaded and readied on `device`, else why it cannot run there.
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
