// The row-zeroing kernel's outputs, passed by value as one kernel parameter. Included by the kernel
// (own_kernels.cu, compiled to PTX by nvcc) and by its launcher (own_kernels.cc, compiled by the host compiler),
// so both sides read one layout; the static_assert pins its size, which tests/test_row_zeroing.py checks
// against the PTX's parameter.
#pragma once

// Up to this many outputs that share one ownership (a call's Q, K, V, or dQ, dK, dV) are zeroed by one launch:
// the rows' sequences are found once, and the host and the GPU see one kernel, not one per output.
#define JAX_RAGGED_ATTN_MAX_ZERO_REGIONS 4

struct ZeroRowsRegions {
  // Output i: row r, slice s starts at base[i] + s * slice_stride[i] + r * row_stride[i], and words[i] 4-byte
  // words from there are the output's in that slice.
  char* base[JAX_RAGGED_ATTN_MAX_ZERO_REGIONS];
  long long slice_stride[JAX_RAGGED_ATTN_MAX_ZERO_REGIONS];
  long long row_stride[JAX_RAGGED_ATTN_MAX_ZERO_REGIONS];
  int words[JAX_RAGGED_ATTN_MAX_ZERO_REGIONS];
  int slices[JAX_RAGGED_ATTN_MAX_ZERO_REGIONS];
  int rows[JAX_RAGGED_ATTN_MAX_ZERO_REGIONS];
  int count;  // outputs in use, 1..JAX_RAGGED_ATTN_MAX_ZERO_REGIONS
};

static_assert(sizeof(ZeroRowsRegions) == 152, "the row-zeroing kernel's parameter layout changed");
