// scatter_req_token_ids (spec §3.8): pool_out[rp, :width] = int32(flat_in[start:start+width]).
// One block per request (block-stride over requests), threads over columns.
#include "canary_common.cuh"

namespace kvcanary {

__global__ void scatter_req_token_ids(const i64* __restrict__ flat_in, i64 num_values, const i64* __restrict__ offsets,
                                      const i64* __restrict__ req_pool_indices, i64 bs, int* __restrict__ pool_out,
                                      i64 pool_rows, i64 pool_cols, i64 pool_stride,
                                      unsigned long long* __restrict__ out_of_range_count) {
  for (i64 r = blockIdx.x; r < bs; r += gridDim.x) {
    const i64 rp = req_pool_indices[r], start = offsets[r], length = offsets[r + 1] - start;
    const i64 width = length < 0 ? 0 : (length > pool_cols ? pool_cols : length);
    const bool rp_ok = rp >= 0 && rp < pool_rows;
    if (threadIdx.x == 0 && out_of_range_count) {
      const bool bad = !rp_ok || length < 0 || (width > 0 && (start < 0 || start + width > num_values));
      if (bad) atomicAdd(out_of_range_count, 1ULL);
    }
    if (!rp_ok) continue;
    for (i64 col = threadIdx.x; col < width; col += blockDim.x) {
      const i64 src = start + col;
      if (src >= 0 && src < num_values) pool_out[rp * pool_stride + col] = static_cast<int>(flat_in[src]);
    }
  }
}

}  // namespace kvcanary
