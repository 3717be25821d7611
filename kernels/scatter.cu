// scatter_req_token_ids: pool_out[rp, :width] = int32(flat_in[start:start+width]).
//
// Batch rows may share a pool row: then, for every (pool row, column), the largest batch row that
// writes the column wins, as in the NumPy backend.  A row skips the columns that a later row of
// the same pool row writes, found by scanning the later rows' pool indices, so every element is
// written by one thread only: no races and no scratch memory.  A block takes groups of up to
// kScatterMaxGroupRows consecutive rows and one scan serves the whole group (about
// bs^2 / (2 * group rows) index loads in all, served from L2); threads then stride over columns.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kScatterMaxGroupRows = 32;

// What batch row r writes: columns [lo, hi) of `pool_row` (-1: nothing) from flat_in[start + col].
struct ScatterRow {
  i64 pool_row, start, lo, hi;
  bool out_of_range;
};

__device__ __forceinline__ ScatterRow scatter_row(const i64* offsets, const i64* req_pool_indices, i64 r, i64 num_values,
                                                  i64 pool_rows, i64 pool_cols) {
  ScatterRow s;
  s.start = offsets[r];
  // A wrapping difference, as NumPy's (signed overflow is undefined in C++).
  const i64 length = static_cast<i64>(static_cast<u64>(offsets[r + 1]) - static_cast<u64>(s.start));
  const i64 width = length < 0 ? 0 : (length < pool_cols ? length : pool_cols);
  // Columns c < width whose source start + c lies in [0, num_values); nothing overflows past `none`.
  const bool none = s.start >= num_values || s.start < -width;
  s.lo = none ? 0 : (s.start < 0 ? -s.start : 0);
  s.hi = none ? 0 : (num_values - s.start < width ? num_values - s.start : width);
  const i64 rp = req_pool_indices[r];
  const bool rp_ok = rp >= 0 && rp < pool_rows;
  s.out_of_range = !rp_ok || length < 0 || s.hi - s.lo < width;
  s.pool_row = rp_ok && s.lo < s.hi ? rp : -1;
  return s;
}

// Whether a batch row after r writes column col of pool row rp (the slow path, taken only when a
// later row's source starts before flat_in, itself an out-of-range value).
__device__ bool written_later(const i64* offsets, const i64* req_pool_indices, i64 r, i64 rp, i64 col, i64 bs,
                              i64 num_values, i64 pool_rows, i64 pool_cols) {
  for (i64 q = r + 1; q < bs; ++q) {
    if (req_pool_indices[q] != rp) continue;
    const ScatterRow later = scatter_row(offsets, req_pool_indices, q, num_values, pool_rows, pool_cols);
    if (later.lo <= col && col < later.hi) return true;
  }
  return false;
}

__global__ void scatter_req_token_ids(const i64* __restrict__ flat_in, i64 num_values, const i64* __restrict__ offsets,
                                      const i64* __restrict__ req_pool_indices, i64 bs, int* __restrict__ pool_out,
                                      i64 pool_rows, i64 pool_cols, i64 pool_stride, i64 group_rows,
                                      unsigned long long* __restrict__ out_of_range_count) {
  wait_for_prior_grids();
  __shared__ i64 s_pool_row[kScatterMaxGroupRows], s_start[kScatterMaxGroupRows];
  __shared__ i64 s_lo[kScatterMaxGroupRows], s_hi[kScatterMaxGroupRows];
  __shared__ long long s_taken[kScatterMaxGroupRows];  // later rows with lo == 0 write columns [0, s_taken)
  __shared__ int s_gapped[kScatterMaxGroupRows];       // a later row writes columns [lo > 0, hi)
  const i64 num_groups = (bs + group_rows - 1) / group_rows;
  for (i64 g = blockIdx.x; g < num_groups; g += gridDim.x) {
    const i64 first = g * group_rows;
    const int rows = static_cast<int>(bs - first < group_rows ? bs - first : group_rows);
    const int t = threadIdx.x;
    if (t < rows) {
      const ScatterRow s = scatter_row(offsets, req_pool_indices, first + t, num_values, pool_rows, pool_cols);
      if (s.out_of_range && out_of_range_count) atomicAdd(out_of_range_count, 1ULL);
      s_pool_row[t] = s.pool_row;
      s_start[t] = s.start;
      s_lo[t] = s.lo;
      s_hi[t] = s.hi;
      s_taken[t] = 0;
      s_gapped[t] = 0;
    }
    __syncthreads();
    for (i64 q = first + 1 + t; q < bs; q += blockDim.x) {
      const i64 rq = req_pool_indices[q];
      if (rq < 0 || rq >= pool_rows) continue;
      bool loaded = false;
      ScatterRow later;
      for (int j = 0; j < rows && first + j < q; ++j) {
        if (s_pool_row[j] != rq) continue;
        if (!loaded) {
          later = scatter_row(offsets, req_pool_indices, q, num_values, pool_rows, pool_cols);
          loaded = true;
        }
        if (later.pool_row < 0) break;  // row q writes nothing
        if (later.lo == 0) {
          atomicMax(&s_taken[j], later.hi);
        } else {
          atomicOr(&s_gapped[j], 1);
        }
      }
    }
    __syncthreads();
    for (int j = 0; j < rows; ++j) {
      const i64 rp = s_pool_row[j];
      if (rp < 0) continue;
      const i64 start = s_start[j], hi = s_hi[j], begin = s_lo[j] > s_taken[j] ? s_lo[j] : s_taken[j];
      const bool gapped = s_gapped[j] != 0;
      int* row = pool_out + rp * pool_stride;
      for (i64 col = begin + t; col < hi; col += blockDim.x) {
        if (gapped && written_later(offsets, req_pool_indices, first + j, rp, col, bs, num_values, pool_rows, pool_cols)) {
          continue;
        }
        row[col] = static_cast<int>(flat_in[start + col]);
      }
    }
    __syncthreads();  // the next group reuses the shared rows
  }
}

}  // namespace kvcanary
