// The static configuration of one ragged attention call. It arrives as the FFI call's attributes (decoded
// by name into this struct) and, at trace time, from Python; it is the graph-cache key.
//
// The fields are declared once, in JAX_RAGGED_ATTN_CONFIG_FIELDS; the struct, its key, describe(), the
// FFI attribute decoding (handlers.cc), the Python-dict decoding and the exported field list (module.cc)
// are all generated from it. A new field is one line here, its value in Python's ffi_attributes
// (jax_ragged_attn/backends/cudnn/graphs.py), and its use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace jax_ragged_attn {

enum class DType : int64_t { kBFloat16 = 0, kFloat16 = 1 };

// The buffers' element type for a DType value (the dtype field of this and the paged configuration).
inline xla::ffi::DataType element_type(int64_t dtype) {
  return dtype == static_cast<int64_t>(DType::kFloat16) ? xla::ffi::DataType::F16 : xla::ffi::DataType::BF16;
}

// How q, k and v lie in memory. Packed layouts are the fused projections' outputs, read (and their
// gradients written) in place through strides: no split, no concatenate.
enum class Packing : int64_t {
  kSeparate = 0,  // q [Tq, Hq, Dqk], k [Tkv, Hkv, Dqk], v [Tkv, Hkv, Dv]
  kKV = 1,        // q [Tq, Hq, D], kv [Tkv, 2, Hkv, D]
  kQKV = 2,       // qkv [T, 3, H, D] (Tq = Tkv, Hq = Hkv)
};

// What the handler does, before the graph runs, so that rows the graph does not own (padding, rows past
// max_seqlen, sequences without keys) read 0.
enum class ZeroOutputs : int64_t {
  kNo = 0,        // nothing: the outputs came in zero-filled, or Python masks them afterwards
  kAll = 1,       // cudaMemsetAsync over every output
  kUnowned = 2,   // the row-zeroing kernel over the rows no sequence owns (kAll where it cannot load)
  kPoisoned = 3,  // testing: every output filled with NaN (0xFF bytes), then kUnowned: a row the graph should
                  // own but leaves unwritten reads NaN
};

// X(type, name, default, label in describe(), value names in describe(): "a|b|c" for 0, 1, 2; "" prints
// the number). The order is the attribute order Python builds and the order of the struct's members.
#define JAX_RAGGED_ATTN_CONFIG_FIELDS(X)                                                                         \
  X(int64_t, num_seqs, 0, "B", "")                                                                               \
  X(int64_t, capacity_q, 0, "Tq", "") /* rows of q, padding included */                                          \
  X(int64_t, capacity_kv, 0, "Tkv", "")                                                                          \
  X(int64_t, num_heads_q, 0, "Hq", "")                                                                           \
  X(int64_t, num_heads_kv, 0, "Hkv", "")                                                                         \
  X(int64_t, head_dim_qk, 0, "Dqk", "")                                                                          \
  X(int64_t, head_dim_v, 0, "Dv", "")                                                                            \
  X(int64_t, max_seqlen_q, 0, "max_seqlen_q", "")                                                                \
  X(int64_t, max_seqlen_kv, 0, "max_seqlen_kv", "")                                                              \
  X(int64_t, dtype, 0, "dtype", "bfloat16|float16") /* DType */                                                  \
  X(float, scale, 1.0f, "scale", "")                                                                             \
  X(float, softcap, 0.0f, "softcap", "") /* > 0: scores capped to softcap * tanh(s / softcap); 0: no cap */      \
  X(int64_t, bottom_right, 0, "alignment", "top_left|bottom_right") /* the diagonal's alignment */               \
  X(int64_t, left_bound, -1, "left_bound", "")   /* keys at most this far left of the diagonal; -1 unbounded */  \
  X(int64_t, right_bound, -1, "right_bound", "") /* keys at most this far right of the diagonal; -1 unbounded */ \
  X(int64_t, stats_token_major, 0, "stats", "head_major|token_major") /* stats [H, T] or [T, H] */               \
  /* backward: bound the ragged intermediates by the capacities */                                               \
  X(int64_t, use_max_total_seq_len, 1, "max_total_seq_len", "unset|capacity")                                    \
  X(int64_t, deterministic, 0, "deterministic", "") /* backward: cuDNN's deterministic algorithm */              \
  X(int64_t, plan_index, -1, "plan", "") /* which of cuDNN's candidate plans runs; -1: the heuristic's first */  \
  X(int64_t, packing, 0, "packing", "none|kv|qkv") /* Packing */                                                 \
  /* how rows the graph does not own come to read 0 (ZeroOutputs), done by the handler before the graph runs. */ \
  /* Not part of the graph: one cached graph serves every value (graph_cache.cc's cached_graph). */              \
  X(int64_t, zero_outputs, 0, "zero_outputs", "no|all|unowned|poisoned") /* ZeroOutputs */

// The attribute type Python must pass for a field's C++ type (jax.ffi attributes are typed); a field of
// any other type does not compile until it is added here and in Python's ffi_kwargs.
template <typename T>
constexpr const char* attribute_type();
template <>
constexpr const char* attribute_type<int64_t>() {
  return "int64";
}
template <>
constexpr const char* attribute_type<float>() {
  return "float32";
}

struct ConfigField {
  const char* name;
  const char* type;  // attribute_type()
};

#define JAX_RAGGED_ATTN_FIELD_ENTRY(type, name, default_value, label, names) {#name, attribute_type<type>()},
inline constexpr ConfigField kConfigFields[] = {JAX_RAGGED_ATTN_CONFIG_FIELDS(JAX_RAGGED_ATTN_FIELD_ENTRY)};
#undef JAX_RAGGED_ATTN_FIELD_ENTRY
inline constexpr size_t kNumConfigFields = sizeof(kConfigFields) / sizeof(kConfigFields[0]);

namespace internal {

// The `value`-th of the '|'-separated `names`, or the number itself when there is no such name.
template <typename T>
void describe_value(std::ostringstream& s, T value, const char* names) {
  std::string all(names);
  if (!all.empty() && value >= 0) {
    size_t start = 0;
    for (T i = 0; i < value && start != std::string::npos; ++i) {
      start = all.find('|', start);
      if (start != std::string::npos) ++start;
    }
    if (start != std::string::npos) {
      s << all.substr(start, all.find('|', start) - start);
      return;
    }
  }
  s << value;
}

}  // namespace internal

struct AttentionConfig {
#define JAX_RAGGED_ATTN_FIELD_MEMBER(type, name, default_value, label, names) type name = default_value;
  JAX_RAGGED_ATTN_CONFIG_FIELDS(JAX_RAGGED_ATTN_FIELD_MEMBER)
#undef JAX_RAGGED_ATTN_FIELD_MEMBER

  // Every field, in order: a graph is reused only for a configuration equal in all of them.
  auto key() const {
#define JAX_RAGGED_ATTN_FIELD_KEY(type, name, default_value, label, names) std::make_tuple(name),
    return std::tuple_cat(JAX_RAGGED_ATTN_CONFIG_FIELDS(JAX_RAGGED_ATTN_FIELD_KEY) std::tuple<>());
#undef JAX_RAGGED_ATTN_FIELD_KEY
  }
  bool operator==(const AttentionConfig& other) const { return key() == other.key(); }
  bool operator<(const AttentionConfig& other) const { return key() < other.key(); }

  // Calls f(name, field) for every field of `self` (const or not), in order: the Python-dict decoding
  // (module.cc) is written once for this and the paged configuration.
  template <typename Self, typename F>
  static void for_each_field(Self& self, F&& f) {
#define JAX_RAGGED_ATTN_FIELD_VISIT(type, name, default_value, label, names) f(#name, self.name);
    JAX_RAGGED_ATTN_CONFIG_FIELDS(JAX_RAGGED_ATTN_FIELD_VISIT)
#undef JAX_RAGGED_ATTN_FIELD_VISIT
  }

  // "B=2 Tq=128 ... packing=none": every field, for error messages.
  std::string describe() const {
    std::ostringstream s;
    const char* separator = "";
#define JAX_RAGGED_ATTN_FIELD_DESCRIBE(type, name, default_value, label, names) \
  s << separator << label << "=";                                               \
  internal::describe_value(s, name, names);                                     \
  separator = " ";
    JAX_RAGGED_ATTN_CONFIG_FIELDS(JAX_RAGGED_ATTN_FIELD_DESCRIBE)
#undef JAX_RAGGED_ATTN_FIELD_DESCRIBE
    return s.str();
  }
};

}  // namespace jax_ragged_attn
