// Plan kernels (spec §3.4 with the project's out-of-range rules, README "Out-of-range values").
//
// plan_offsets: one block scans the whole batch in tiles (no batch-size cap), writes the
//   per-request offsets, seeds, counts and the overflow flag, and clears everything past bs.
// plan_entries: a fixed grid expands the verify entries; the total is read on the device, so a
//   captured graph replays correctly for any batch content.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kPlanItemsPerThread = 4;

template <bool kHasLut>
__device__ __forceinline__ i64 swa_translate(i64 value, const i64* lut, i64 lut_len, i64& clamped) {
  if (!kHasLut || value < 0) return value;
  if (value > lut_len - 1) {
    ++clamped;
    value = lut_len - 1;
  }
  return lut[value];
}

__device__ __forceinline__ i64 clamp64(i64 v, i64 lo, i64 hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Exclusive block-wide scan of two sums; returns the block totals through the references.
__device__ __forceinline__ void block_exclusive_scan2(i64& a, i64& b, i64& total_a, i64& total_b) {
  __shared__ i64 warp_a[32], warp_b[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  i64 ia = a, ib = b;
  for (int o = 1; o < 32; o <<= 1) {
    const i64 ua = __shfl_up_sync(0xffffffffu, ia, o), ub = __shfl_up_sync(0xffffffffu, ib, o);
    if (lane >= o) { ia += ua; ib += ub; }
  }
  if (lane == 31) { warp_a[warp] = ia; warp_b[warp] = ib; }
  __syncthreads();
  if (warp == 0) {
    i64 wa = lane < nwarps ? warp_a[lane] : 0, wb = lane < nwarps ? warp_b[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const i64 ua = __shfl_up_sync(0xffffffffu, wa, o), ub = __shfl_up_sync(0xffffffffu, wb, o);
      if (lane >= o) { wa += ua; wb += ub; }
    }
    warp_a[lane] = wa;  // inclusive prefix of the warp totals
    warp_b[lane] = wb;
  }
  __syncthreads();
  const i64 before_a = warp ? warp_a[warp - 1] : 0, before_b = warp ? warp_b[warp - 1] : 0;
  total_a = warp_a[nwarps - 1];
  total_b = warp_b[nwarps - 1];
  a = before_a + ia - a;
  b = before_b + ib - b;
  __syncthreads();  // warp_a/warp_b are reused by the next tile
}

template <bool kHasLut, bool kHasPool>
__global__ void plan_offsets(const i64* __restrict__ req_pool_indices, const i64* __restrict__ prefix_lens,
                             const i64* __restrict__ extend_seq_lens, i64 bs, const int* __restrict__ req_to_token,
                             i64 rtt_rows, i64 rtt_cols, i64 rtt_stride, i64 window, const i64* __restrict__ lut,
                             i64 lut_len, const i64* __restrict__ valid_lens, i64 pool_cols,
                             i64* __restrict__ verify_offsets, i64* __restrict__ write_offsets,
                             i64* __restrict__ seeds, i64 write_req_capacity, int* __restrict__ verify_num_valid,
                             int* __restrict__ enable, int* __restrict__ write_num_valid_reqs, i64 verify_capacity,
                             unsigned long long* __restrict__ out_of_range_count) {
  __shared__ i64 carry_v, carry_w;
  if (threadIdx.x == 0) { carry_v = 0; carry_w = 0; }
  __syncthreads();
  i64 errors = 0;
  const i64 tile = static_cast<i64>(blockDim.x) * kPlanItemsPerThread;
  for (i64 base = 0; base < bs; base += tile) {
    i64 vlen[kPlanItemsPerThread], wlen[kPlanItemsPerThread];
    i64 sum_v = 0, sum_w = 0;
    const i64 first = base + static_cast<i64>(threadIdx.x) * kPlanItemsPerThread;
#pragma unroll
    for (int k = 0; k < kPlanItemsPerThread; ++k) {
      const i64 r = first + k;
      vlen[k] = wlen[k] = 0;
      if (r >= bs) continue;
      const i64 rp = req_pool_indices[r], prefix = prefix_lens[r], extend = extend_seq_lens[r];
      const bool active = rp != 0;
      const bool rp_ok = rp >= 0 && rp < rtt_rows;
      const bool prefix_ok = prefix >= 0 && prefix <= rtt_cols;
      i64 seed = -1;
      if (active) {
        errors += !rp_ok + !prefix_ok + (extend < 0);
        if (kHasPool) {
          const i64 vl = valid_lens[r];
          errors += vl < 0 || vl > pool_cols;
        }
        const i64 start = window > 0 ? (prefix - window > 0 ? prefix - window : 0) : 0;
        const i64 end = clamp64(prefix, 0, rtt_cols);
        if (rp_ok && end > start) vlen[k] = end - start;
        wlen[k] = extend > 0 ? extend : 0;
        if (rp_ok && prefix_ok && prefix > 0 && wlen[k] > 0)
          seed = swa_translate<kHasLut>(req_to_token[rp * rtt_stride + prefix - 1], lut, lut_len, errors);
      }
      if (r < write_req_capacity) seeds[r] = seed;
      sum_v += vlen[k];
      sum_w += wlen[k];
    }
    i64 total_v, total_w;
    block_exclusive_scan2(sum_v, sum_w, total_v, total_w);
    i64 off_v = carry_v + sum_v, off_w = carry_w + sum_w;
#pragma unroll
    for (int k = 0; k < kPlanItemsPerThread; ++k) {
      const i64 r = first + k;
      if (r >= bs) break;
      verify_offsets[r] = off_v;
      write_offsets[r] = off_w;
      off_v += vlen[k];
      off_w += wlen[k];
    }
    __syncthreads();  // everyone has read the carries
    if (threadIdx.x == 0) { carry_v += total_v; carry_w += total_w; }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const i64 total = carry_v;
    verify_offsets[bs] = total;
    write_offsets[bs] = carry_w;
    *verify_num_valid = static_cast<int>(total < verify_capacity ? total : verify_capacity);
    *enable = total <= verify_capacity ? 1 : 0;
    *write_num_valid_reqs = static_cast<int>(bs);
  }
  // Nothing stale past the batch (spec Part 1, decision 4).
  for (i64 r = bs + threadIdx.x; r < write_req_capacity; r += blockDim.x) {
    seeds[r] = -1;
    verify_offsets[r + 1] = 0;
    write_offsets[r + 1] = 0;
  }
  __shared__ i64 block_errors;
  if (threadIdx.x == 0) block_errors = 0;
  __syncthreads();
  if (errors) atomicAdd(reinterpret_cast<unsigned long long*>(&block_errors), static_cast<unsigned long long>(errors));
  __syncthreads();
  if (threadIdx.x == 0 && block_errors) atomicAdd(out_of_range_count, static_cast<unsigned long long>(block_errors));
}

// Each warp expands a contiguous range of entries, 32 at a time; each lane keeps its owner row and
// walks it forward, so the binary search runs once per warp lane rather than per entry.
template <bool kHasLut, bool kHasPool>
__global__ void plan_entries(const i64* __restrict__ req_pool_indices, const i64* __restrict__ prefix_lens, i64 bs,
                             const int* __restrict__ req_to_token, i64 rtt_stride, i64 window,
                             const i64* __restrict__ lut, i64 lut_len, const int* __restrict__ pool,
                             i64 pool_stride, i64 pool_cols, const i64* __restrict__ valid_lens, i64 token_offset,
                             const i64* __restrict__ verify_offsets, const int* __restrict__ enable,
                             i64* __restrict__ out_slots, i64* __restrict__ out_tokens, i64* __restrict__ out_positions,
                             i64* __restrict__ out_prev, unsigned long long* __restrict__ out_of_range_count) {
  const i64 total = verify_offsets[bs];
  if (total <= 0 || *enable == 0) return;
  const int lane = threadIdx.x & 31;
  const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const i64 num_warps = (static_cast<i64>(gridDim.x) * blockDim.x) >> 5;
  const i64 per_warp = ((total + num_warps - 1) / num_warps + 31) & ~static_cast<i64>(31);
  const i64 begin = warp * per_warp;
  if (begin >= total) return;
  const i64 end = begin + per_warp < total ? begin + per_warp : total;

  i64 t = begin + lane < total ? begin + lane : total - 1;
  i64 lo = 0, hi = bs;  // largest r with verify_offsets[r] <= t
  while (hi - lo > 1) {
    const i64 mid = (lo + hi) >> 1;
    if (verify_offsets[mid] <= t) lo = mid; else hi = mid;
  }
  i64 r = lo;
  i64 clamped = 0;
  for (i64 chunk = begin; chunk < end; chunk += 32) {
    t = chunk + lane;
    if (t < end) {
      while (r + 1 < bs && verify_offsets[r + 1] <= t) ++r;
      const i64 prefix = prefix_lens[r];
      const i64 start = window > 0 ? (prefix - window > 0 ? prefix - window : 0) : 0;
      const i64 p = start + (t - verify_offsets[r]);
      const i64 row = req_pool_indices[r];
      const int* rtt_row = req_to_token + row * rtt_stride;
      out_slots[t] = swa_translate<kHasLut>(rtt_row[p], lut, lut_len, clamped);
      out_prev[t] = p > 0 ? swa_translate<kHasLut>(rtt_row[p - 1], lut, lut_len, clamped) : -1;
      out_positions[t] = p;
      i64 token = -1;
      if (kHasPool) {
        const i64 q = p + token_offset;
        const i64 limit = valid_lens[r] < pool_cols ? valid_lens[r] : pool_cols;
        if (q >= 0 && q < limit) token = pool[row * pool_stride + q];
      }
      out_tokens[t] = token;
    }
  }
  warp_add(out_of_range_count, clamped);
}

}  // namespace kvcanary
