#include "autotune.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "check.h"
#include "cudnn_library.h"
#include "layouts.h"

namespace jax_ragged_attn {
namespace {

namespace fe = cudnn_frontend;

// The CUDA runtime through the same dlopen'ed library as everything else (no link-time dependency).
template <typename Fn>
Fn cudart(const char* name) {
  return reinterpret_cast<Fn>(fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDART, name));
}

// Returns from the enclosing function with the runtime's name and description of a failed call's status.
#define CUDA_OK(call, what)                                                 \
  if (const cudaError_t cuda_status = (call); cuda_status == cudaSuccess) { \
  } else                                                                    \
    return ErrorStream(xla::ffi::ErrorCode::kInternal)                      \
           << "autotuning: " << what << ": " << cuda_error_string(cuda_status)

// Device memory freed on every path out.
class Scratch {
 public:
  ~Scratch() {
    auto free_fn = cudart<cudaError_t (*)(void*)>("cudaFree");
    for (void* p : allocations_) free_fn(p);
  }
  xla::ffi::Error alloc(int64_t bytes, void** out) {
    auto malloc_fn = cudart<cudaError_t (*)(void**, size_t)>("cudaMalloc");
    auto memset_fn = cudart<cudaError_t (*)(void*, int, size_t)>("cudaMemset");
    const size_t size = static_cast<size_t>(std::max<int64_t>(bytes, 256));
    CUDA_OK(malloc_fn(out, size), "cudaMalloc of " << size << " bytes");
    allocations_.push_back(*out);
    CUDA_OK(memset_fn(*out, 0, size), "cudaMemset");  // zeros: finite inputs, timing does not depend on them
    return xla::ffi::Error::Success();
  }
  xla::ffi::Error upload(const std::vector<int32_t>& values, void** out) {
    FFI_RETURN_IF_ERROR(alloc(static_cast<int64_t>(values.size() * sizeof(int32_t)), out));
    auto copy_fn = cudart<cudaError_t (*)(void*, const void*, size_t, cudaMemcpyKind)>("cudaMemcpy");
    CUDA_OK(copy_fn(*out, values.data(), values.size() * sizeof(int32_t), cudaMemcpyHostToDevice), "cudaMemcpy");
    return xla::ffi::Error::Success();
  }

 private:
  std::vector<void*> allocations_;
};

// Equal sequences filling each capacity (at most max_seqlen long): what the kernel sees in a full batch.
std::vector<int32_t> cumulative(int64_t num_seqs, int64_t length, int64_t per_token) {
  std::vector<int32_t> cu(num_seqs + 1);
  for (int64_t b = 0; b <= num_seqs; ++b) cu[b] = static_cast<int32_t>(b * length * per_token);
  return cu;
}

// One buffer per tensor, laid out as the graph addresses it: `capacity` rows of the tensor's token stride
// (a packed row for packed q/k/v, whose part starts at its offset in the row), so no plan can address past
// the scratch memory whatever the packing.
xla::ffi::Error tensor_buffer(Scratch& scratch, int64_t capacity, int64_t token_stride, int64_t part_offset,
                              int64_t elem_size, void** out) {
  void* base = nullptr;
  FFI_RETURN_IF_ERROR(scratch.alloc(capacity * token_stride * elem_size, &base));
  *out = static_cast<char*>(base) + part_offset * elem_size;
  return xla::ffi::Error::Success();
}

xla::ffi::Error variant_pack(Scratch& scratch, const AttentionConfig& c, bool forward,
                             std::unordered_map<int64_t, void*>* pack) {
  const int64_t b = c.num_seqs;
  const int64_t len_q = std::min(c.max_seqlen_q, c.capacity_q / std::max<int64_t>(b, 1));
  const int64_t len_kv = std::min(c.max_seqlen_kv, c.capacity_kv / std::max<int64_t>(b, 1));
  const int64_t io = 2;  // bf16 / fp16 bytes
  struct Spec {
    TensorUid id;
    int64_t capacity, token_stride, part_offset, elem_size;
  };
  const int64_t o_stride = c.num_heads_q * c.head_dim_v;
  std::vector<Spec> tensors = {{TensorUid::kQ, c.capacity_q, q_token_stride(c), 0, io},
                               {TensorUid::kK, c.capacity_kv, k_token_stride(c), k_part_offset(c), io},
                               {TensorUid::kV, c.capacity_kv, v_token_stride(c), v_part_offset(c), io},
                               {TensorUid::kO, c.capacity_q, o_stride, 0, io},
                               {TensorUid::kStats, c.capacity_q, c.num_heads_q, 0, 4}};
  if (!forward) {
    tensors.insert(tensors.end(), {{TensorUid::kDO, c.capacity_q, o_stride, 0, io},
                                   {TensorUid::kDQ, c.capacity_q, q_token_stride(c), 0, io},
                                   {TensorUid::kDK, c.capacity_kv, k_token_stride(c), k_part_offset(c), io},
                                   {TensorUid::kDV, c.capacity_kv, v_token_stride(c), v_part_offset(c), io}});
  }
  for (const Spec& t : tensors) {
    FFI_RETURN_IF_ERROR(tensor_buffer(scratch, t.capacity, t.token_stride, t.part_offset, t.elem_size,
                                      &(*pack)[static_cast<int64_t>(t.id)]));
  }
  const std::vector<std::pair<TensorUid, std::vector<int32_t>>> indices = {
      {TensorUid::kSeqLenQ, std::vector<int32_t>(b, static_cast<int32_t>(len_q))},
      {TensorUid::kSeqLenKV, std::vector<int32_t>(b, static_cast<int32_t>(len_kv))},
      {TensorUid::kOffsetQ, cumulative(b, len_q, q_token_stride(c))},
      {TensorUid::kOffsetK, cumulative(b, len_kv, k_token_stride(c))},
      {TensorUid::kOffsetV, cumulative(b, len_kv, v_token_stride(c))},
      {TensorUid::kOffsetO, cumulative(b, len_q, o_stride)},
      {TensorUid::kOffsetStats, cumulative(b, len_q, c.stats_token_major ? c.num_heads_q : 1)}};
  for (const auto& [id, values] : indices) {
    FFI_RETURN_IF_ERROR(scratch.upload(values, &(*pack)[static_cast<int64_t>(id)]));
  }
  return xla::ffi::Error::Success();
}

}  // namespace

xla::ffi::Error time_candidate_plans(cudnnHandle_t handle, InspectableGraph& graph, const AttentionConfig& config,
                                     bool forward, std::vector<PlanTiming>* out) {
  const int64_t count = graph.get_execution_plan_count();
  int64_t largest_workspace = 0;
  for (int64_t i = 0; i < count; ++i) {
    PlanTiming plan;
    plan.index = i;
    fe::error_t status = graph.build_plan_at_index(i);
    if (status.is_good()) status = graph.get_workspace_size_plan_at_index(i, plan.workspace_bytes);
    if (graph.get_plan_name_at_index(i, plan.name).is_bad()) plan.name = "?";
    plan.ok = status.is_good();
    if (!plan.ok) plan.message = status.get_message();
    largest_workspace = std::max(largest_workspace, plan.ok ? plan.workspace_bytes : 0);
    out->push_back(plan);
  }

  Scratch scratch;
  std::unordered_map<int64_t, void*> pack;
  FFI_RETURN_IF_ERROR(variant_pack(scratch, config, forward, &pack));
  void* workspace = nullptr;
  FFI_RETURN_IF_ERROR(scratch.alloc(largest_workspace, &workspace));

  using Event = cudaEvent_t;
  auto create = cudart<cudaError_t (*)(Event*)>("cudaEventCreate");
  auto destroy = cudart<cudaError_t (*)(Event)>("cudaEventDestroy");
  auto record = cudart<cudaError_t (*)(Event, cudaStream_t)>("cudaEventRecord");
  auto wait = cudart<cudaError_t (*)(Event)>("cudaEventSynchronize");
  auto elapsed = cudart<cudaError_t (*)(float*, Event, Event)>("cudaEventElapsedTime");
  auto synchronize = cudart<cudaError_t (*)()>("cudaDeviceSynchronize");
  Event start = nullptr, stop = nullptr;
  CUDA_OK(create(&start), "cudaEventCreate");
  CUDA_OK(create(&stop), "cudaEventCreate");
  struct Events {  // destroyed on every path out
    decltype(destroy) fn;
    Event a, b;
    ~Events() {
      fn(a);
      fn(b);
    }
  } events{destroy, start, stop};
  // The legacy default stream: tuning runs at trace time, when nothing of ours is in flight.
  FFI_CHECK(fe::detail::set_stream(handle, nullptr) == CUDNN_STATUS_SUCCESS) << "autotuning: cudnnSetStream";

  constexpr int kWarmup = 2, kTimed = 9;  // the median of 9 after 2 warm-up runs
  for (PlanTiming& plan : *out) {
    if (!plan.ok) continue;
    fe::error_t status;
    for (int i = 0; i < kWarmup && status.is_good(); ++i) {
      status = graph.execute_plan_at_index(handle, pack, workspace, plan.index);
    }
    std::vector<float> times;
    for (int i = 0; i < kTimed && status.is_good(); ++i) {
      CUDA_OK(record(start, nullptr), "cudaEventRecord");
      status = graph.execute_plan_at_index(handle, pack, workspace, plan.index);
      CUDA_OK(record(stop, nullptr), "cudaEventRecord");
      CUDA_OK(wait(stop), "cudaEventSynchronize");
      float ms = 0;
      CUDA_OK(elapsed(&ms, start, stop), "cudaEventElapsedTime");
      times.push_back(ms);
    }
    // A plan that fails at run time is skipped, like one that fails to build; a sticky CUDA error is not.
    CUDA_OK(synchronize(), "cudaDeviceSynchronize after plan " << plan.index);
    if (status.is_bad()) {
      plan.ok = false;
      plan.message = status.get_message();
      continue;
    }
    std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
    plan.median_ms = times[times.size() / 2];
  }
  return xla::ffi::Error::Success();
}

}  // namespace jax_ragged_attn

// File-local, also in a unity build (CMakeLists.txt) where the next source follows in the same unit.
#undef CUDA_OK
