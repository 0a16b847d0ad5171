// The project's own CUDA kernels: jax_ragged_attn_zero_unowned_rows zeroes the rows of an output that the cuDNN
// graph will not write; jax_ragged_attn_clamp_cache_index (at the end) clamps a KV cache's lengths and page table
// into the cache for a kernel that reads them without bounds.
//
// Not compiled by the build. scripts/generate_own_kernels_ptx.sh turns it into PTX (ffi/own_kernels_ptx.inc),
// which the extension hands to the CUDA runtime's JIT at run time (own_kernels.cc): the build needs no CUDA
// toolkit, and one wheel serves every GPU the driver knows. tests/test_row_zeroing.py checks that the
// checked-in PTX is this file's.
//
// Why: an output row that no sequence owns (padding past the last sequence, rows past max_seqlen, sequences
// without keys) must read 0, and zeroing whole outputs first costs a full write of each (W1's forward: 32 us of
// 768). Usually almost every row is owned, so this kernel's cost is one binary search per row.
//
// Ownership comes from the index arrays the graph itself reads: sequence i owns the rows
// [starts[i] / scale, starts[i] / scale + lengths[i]) (starts: a ragged offset array, non-decreasing because
// Python sanitises cu_seqlens first; scale: the elements per row in that offset). With `gate`, sequence i owns
// its rows only where gate[i] > 0 (dK/dV rows of a sequence with no queries). Zeroing more than cuDNN skips is
// harmless: the kernel runs before the graph, which then writes every row it owns.
//
// One launch zeroes up to JAX_RAGGED_ATTN_MAX_ZERO_REGIONS outputs that share the ownership (FA3's Q, K, V and
// dQ, dK, dV): each row's sequence is searched once for all of them.

#include "row_zeroing_params.h"

extern "C" __global__ void jax_ragged_attn_zero_unowned_rows(
    ZeroRowsRegions regions,  // the outputs (row_zeroing_params.h)
    const int* starts, long long scale, const int* lengths, const int* gate, int num_seqs) {
  // Each warp takes 32 consecutive rows, one per lane, so the binary searches (a few dependent loads each:
  // latency, not bandwidth) run 32 to a warp; then the whole warp zeroes each unowned row of the 32 in turn,
  // in every output that has the row, its lanes over the row's words (coalesced) and slices.
  const int lane = threadIdx.x & 31;
  int rows = 0;
  for (int r = 0; r < regions.count; ++r) rows = max(rows, regions.rows[r]);
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
  for (long long first = warp * 32; first < rows; first += warps * 32) {
    const long long row = first + lane;
    bool unowned = false;
    if (row < rows) {
      // The sequence the row would belong to: the last one starting at or before it.
      const long long at = row * scale;
      int lo = 0, hi = num_seqs;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (static_cast<long long>(starts[mid]) <= at) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      const int seq = lo - 1;
      unowned = !(seq >= 0 && (gate == nullptr || gate[seq] > 0) &&
                  at < static_cast<long long>(starts[seq]) + static_cast<long long>(lengths[seq]) * scale);
    }
    const unsigned pending_rows = __ballot_sync(0xffffffffu, unowned);
    for (int r = 0; r < regions.count; ++r) {
      const int words = regions.words[r], slices = regions.slices[r];
      const long long row_stride = regions.row_stride[r], slice_stride = regions.slice_stride[r];
      char* const base = regions.base[r];
      // Rows of whole 16-byte words at 16-byte aligned addresses (every q/k/v/out/gradient row of head dim a
      // multiple of 8 in 16-bit types): 16-byte stores. Rows of many narrow slices (head-major stats: one
      // float per slice) keep the flat 4-byte loop, which spreads a row's slices over the lanes.
      const int quads = words >> 2;
      const bool wide = (words & 3) == 0 && (slices == 1 || quads >= 32) &&
                        ((reinterpret_cast<unsigned long long>(base) | static_cast<unsigned long long>(row_stride) |
                          static_cast<unsigned long long>(slice_stride)) &
                         15) == 0;
      for (unsigned pending = pending_rows; pending != 0; pending &= pending - 1) {
        const long long unowned_row = first + __ffs(pending) - 1;
        if (unowned_row >= regions.rows[r]) break;  // this output has fewer rows; the bits go up with the row
        char* p = base + unowned_row * row_stride;
        if (wide) {
          // 16-byte stores, slice by slice: a quarter of the store instructions and no division per store. A
          // context-parallel device's key window is mostly rows no piece owns, where 4-byte stores with a
          // division each are issue-bound.
          for (int slice = 0; slice < slices; ++slice) {
            int4* out = reinterpret_cast<int4*>(p + slice * slice_stride);
            for (int i = lane; i < quads; i += 32) out[i] = make_int4(0, 0, 0, 0);
          }
        } else {
          for (int i = lane; i < slices * words; i += 32) {
            reinterpret_cast<int*>(p + (i / words) * slice_stride)[i % words] = 0;
          }
        }
      }
    }
  }
}

// cache_seqlens clamped into [0, capacity] and page-table entries outside [0, num_pages) replaced by page 0, in
// one launch: FlashAttention-3's kvcache kernel reads both without bounds, so these are what keeps a bad length
// or entry from making it read outside the cache. As XLA code the two are two fusions (shapes [B] and [B, P], which
// XLA does not fuse), a launch each: at 8 x 2k decode several microseconds of a call of tens. Elementwise over
// each flat array, so any leading batch axes (vmap) are served alike.
extern "C" __global__ void jax_ragged_attn_clamp_cache_index(const int* lengths, int* lengths_out,
                                                             long long num_lengths, long long capacity,
                                                             const int* table, int* table_out, long long num_entries,
                                                             long long num_pages) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_lengths + num_entries;
       i += stride) {
    if (i < num_lengths) {
      const long long n = lengths[i];
      lengths_out[i] = static_cast<int>(n < 0 ? 0 : (n > capacity ? capacity : n));
    } else {
      const long long j = i - num_lengths;
      const int page = table[j];
      table_out[j] = page >= 0 && page < num_pages ? page : 0;
    }
  }
}
