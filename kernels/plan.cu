// Plan kernels (docs/format.md §4 with the project's out-of-range rules, README "Out-of-range values").
//
// plan_fused (bs <= kFusedMaxBs, one launch): every block scans the batch into shared memory;
//   block 0 also writes the per-request outputs; then all blocks expand the verify entries.
// plan_offsets + plan_entries (any bs, two launches): one block scans the batch in tiles and
//   writes the per-request outputs; then a fixed grid expands the entries, reading the total on
//   the device.
// Either way the grid depends only on shapes, so a captured graph replays any batch content.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kPlanItemsPerThread = 4;
constexpr i64 kNoSeed = -(1LL << 62);  // outside the int32 range of req_to_token values

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

// Block-wide exclusive scan of the warps' totals (a, b): returns through the references what the
// earlier warps of the block hold, and the block's totals.  Lane 31 of each warp holds its totals.
__device__ __forceinline__ void scan_warp_totals(i64 a, i64 b, i64& before_a, i64& before_b, i64& total_a, i64& total_b) {
  __shared__ i64 warp_a[32], warp_b[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  if (lane == 31) { warp_a[warp] = a; warp_b[warp] = b; }
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
  before_a = warp ? warp_a[warp - 1] : 0;
  before_b = warp ? warp_b[warp - 1] : 0;
  total_a = warp_a[nwarps - 1];
  total_b = warp_b[nwarps - 1];
  __syncthreads();  // warp_a/warp_b are reused by the next tile
}

constexpr int kPlanMaxThreads = 1024;
constexpr i64 kFusedMaxBs = 2048;  // plan_fused keeps verify offsets in shared memory

// Everything a plan reads, passed by value (mirrored by PLAN_INPUTS in cupy_backend.py).
struct PlanInputs {
  const i64* req_pool_indices;
  const i64* prefix_lens;
  const i64* extend_seq_lens;
  const int* req_to_token;
  const i64* lut;  // null without an SWA LUT
  const int* pool;  // expected-token pool, null without one
  const i64* valid_lens;
  i64 bs, rtt_rows, rtt_cols, rtt_stride, window, lut_len, pool_stride, pool_cols, token_offset;
};

// Everything a plan writes (mirrored by PLAN_OUTPUTS in cupy_backend.py).
struct PlanOutputs {
  i64* verify_offsets;  // [write_req_capacity + 1]
  i64* write_offsets;  // [write_req_capacity + 1]
  i64* seeds;  // [write_req_capacity]
  int* verify_num_valid;
  int* enable;
  int* write_num_valid_reqs;
  unsigned long long* out_of_range_count;
  i64* slots;  // the four verify entry arrays, [verify_capacity]
  i64* tokens;
  i64* positions;
  i64* prev;
  i64 write_req_capacity, verify_capacity;
};
static_assert(sizeof(PlanInputs) == 128 && sizeof(PlanOutputs) == 104, "mirrored in cupy_backend.py");

__device__ __forceinline__ i64 window_start(i64 prefix, i64 window) {
  return window > 0 && prefix - window > 0 ? prefix - window : 0;
}

// Scans the whole batch with one block in tiles of blockDim * kPlanItemsPerThread rows.  Rows are
// warp-striped (item k of lane l in warp w is row tile + (w * K + k) * 32 + l), so every load and
// store is coalesced; the scan follows row order.  Returns the total number of verify entries
// (to every thread).  With write_outputs the block writes the per-request outputs, the counts
// and the out-of-range count; with smem_verify_offsets (bs <= kFusedMaxBs) it also keeps the
// verify offsets in shared memory.
template <bool kHasLut, bool kHasPool>
__device__ i64 plan_scan(const PlanInputs& in, const PlanOutputs& out, bool write_outputs, i64* smem_verify_offsets) {
  __shared__ i64 carry_v, carry_w;
  __shared__ unsigned long long block_errors;
  if (threadIdx.x == 0) { carry_v = 0; carry_w = 0; block_errors = 0; }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  i64 errors = 0;
  const i64 bs = in.bs;
  const i64 tile = static_cast<i64>(blockDim.x) * kPlanItemsPerThread;
  for (i64 base = 0; base < bs; base += tile) {
    i64 vlen[kPlanItemsPerThread], wlen[kPlanItemsPerThread];
    i64 rp[kPlanItemsPerThread], prefix[kPlanItemsPerThread], extend[kPlanItemsPerThread];
    i64 seed_raw[kPlanItemsPerThread];
    const i64 first = base + static_cast<i64>(warp) * kPlanItemsPerThread * 32 + lane;
    // Three phases so that the loads of all items are in flight together: inputs, seed gathers, math.
#pragma unroll
    for (int k = 0; k < kPlanItemsPerThread; ++k) {
      const i64 r = first + 32 * k;
      const bool in_batch = r < bs;
      rp[k] = in_batch ? in.req_pool_indices[r] : 0;
      prefix[k] = in_batch ? in.prefix_lens[r] : 0;
      extend[k] = in_batch ? in.extend_seq_lens[r] : 0;
    }
#pragma unroll
    for (int k = 0; k < kPlanItemsPerThread; ++k) {
      // Active, in range, with a prefix and something to write (rows past bs have rp 0).
      const bool seeded = write_outputs && rp[k] > 0 && rp[k] < in.rtt_rows && prefix[k] > 0 &&
                          prefix[k] <= in.rtt_cols && extend[k] > 0;
      seed_raw[k] = seeded ? in.req_to_token[rp[k] * in.rtt_stride + prefix[k] - 1] : kNoSeed;
    }
#pragma unroll
    for (int k = 0; k < kPlanItemsPerThread; ++k) {
      const i64 r = first + 32 * k;
      vlen[k] = wlen[k] = 0;
      const bool active = rp[k] != 0;  // rows past bs have rp 0
      const bool rp_ok = rp[k] >= 0 && rp[k] < in.rtt_rows;
      const bool prefix_ok = prefix[k] >= 0 && prefix[k] <= in.rtt_cols;
      i64 seed = -1;
      if (active) {
        errors += !rp_ok + !prefix_ok + (extend[k] < 0);
        if (kHasPool) {
          const i64 lens = in.valid_lens[r];  // loaded late: fewer live registers
          errors += lens < 0 || lens > in.pool_cols;
        }
        const i64 start = window_start(prefix[k], in.window);
        const i64 end = clamp64(prefix[k], 0, in.rtt_cols);
        if (rp_ok && end > start) vlen[k] = end - start;
        wlen[k] = extend[k] > 0 ? extend[k] : 0;
        if (seed_raw[k] != kNoSeed) seed = swa_translate<kHasLut>(seed_raw[k], in.lut, in.lut_len, errors);
      }
      if (write_outputs && r < bs) out.seeds[r] = seed;
    }
    // Inclusive warp scans of the K items, interleaved so that their shuffles overlap; then the
    // exclusive offsets within the warp, rows ordered item-major (item k follows all of item k-1).
    // Warps past the batch (most of the block for a small batch) skip it: their items are all 0,
    // which already are their offsets, and shuffles are what the scan costs.
    i64 run_v = 0, run_w = 0;
    if (first - lane < bs) {
      i64 iv[kPlanItemsPerThread], iw[kPlanItemsPerThread];
#pragma unroll
      for (int k = 0; k < kPlanItemsPerThread; ++k) { iv[k] = vlen[k]; iw[k] = wlen[k]; }
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
        for (int k = 0; k < kPlanItemsPerThread; ++k) {
          const i64 uv = __shfl_up_sync(0xffffffffu, iv[k], o), uw = __shfl_up_sync(0xffffffffu, iw[k], o);
          if (lane >= o) { iv[k] += uv; iw[k] += uw; }
        }
      }
#pragma unroll
      for (int k = 0; k < kPlanItemsPerThread; ++k) {
        vlen[k] = run_v + iv[k] - vlen[k];
        wlen[k] = run_w + iw[k] - wlen[k];
        run_v += __shfl_sync(0xffffffffu, iv[k], 31);
        run_w += __shfl_sync(0xffffffffu, iw[k], 31);
      }
    }
    // Add what the earlier warps of this tile and the earlier tiles hold.
    i64 warp_v, warp_w, total_v, total_w;
    scan_warp_totals(run_v, run_w, warp_v, warp_w, total_v, total_w);
    const i64 before_v = carry_v + warp_v, before_w = carry_w + warp_w;
#pragma unroll
    for (int k = 0; k < kPlanItemsPerThread; ++k) {
      const i64 r = first + 32 * k;
      if (r >= bs) break;
      if (smem_verify_offsets) smem_verify_offsets[r] = before_v + vlen[k];
      if (write_outputs) {
        out.verify_offsets[r] = before_v + vlen[k];
        out.write_offsets[r] = before_w + wlen[k];
      }
    }
    __syncthreads();  // everyone has read the carries
    if (threadIdx.x == 0) { carry_v += total_v; carry_w += total_w; }
    __syncthreads();
  }
  const i64 total = carry_v;
  if (threadIdx.x == 0 && smem_verify_offsets) smem_verify_offsets[bs] = total;
  if (write_outputs) {
    if (threadIdx.x == 0) {
      out.verify_offsets[bs] = total;
      out.write_offsets[bs] = carry_w;
      *out.verify_num_valid = static_cast<int>(total < out.verify_capacity ? total : out.verify_capacity);
      *out.enable = total <= out.verify_capacity ? 1 : 0;
      *out.write_num_valid_reqs = static_cast<int>(bs);
    }
    // Nothing stale past the batch (README, array conventions).
    for (i64 r = bs + threadIdx.x; r < out.write_req_capacity; r += blockDim.x) {
      out.seeds[r] = -1;
      out.verify_offsets[r + 1] = 0;
      out.write_offsets[r + 1] = 0;
    }
    if (errors) atomicAdd(&block_errors, static_cast<unsigned long long>(errors));
    __syncthreads();
    if (threadIdx.x == 0 && block_errors) atomicAdd(out.out_of_range_count, block_errors);
  }
  __syncthreads();
  return total;
}

// Expands verify entries [0, total) over the whole grid.  Each warp takes a contiguous range, 32
// entries at a time; each lane finds its owner row by binary search once, then walks it forward
// with the row cached in registers, so consecutive entries cost no search.
template <bool kHasLut, bool kHasPool>
__device__ void expand_entries(const PlanInputs& in, const PlanOutputs& out, const i64* verify_offsets, i64 total) {
  const int lane = threadIdx.x & 31;
  const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const i64 num_warps = (static_cast<i64>(gridDim.x) * blockDim.x) >> 5;
  const i64 per_warp = ((total + num_warps - 1) / num_warps + 31) & ~static_cast<i64>(31);
  const i64 begin = warp * per_warp;
  if (begin >= total) return;
  const i64 end = begin + per_warp < total ? begin + per_warp : total;

  i64 t = begin + lane < total ? begin + lane : total - 1;
  i64 lo = 0, hi = in.bs;  // largest r with verify_offsets[r] <= t
  while (hi - lo > 1) {
    const i64 mid = (lo + hi) >> 1;
    if (verify_offsets[mid] <= t) lo = mid; else hi = mid;
  }
  i64 r = lo;
  i64 row_begin = verify_offsets[r], row_next = verify_offsets[r + 1];
  i64 row = in.req_pool_indices[r], start = window_start(in.prefix_lens[r], in.window);
  i64 clamped = 0;
  for (i64 chunk = begin; chunk < end; chunk += 32) {
    t = chunk + lane;
    if (t < end) {
      if (t >= row_next) {  // verify_offsets[bs] == total > t ends the walk
        do row_next = verify_offsets[++r + 1]; while (t >= row_next);
        row_begin = verify_offsets[r];
        row = in.req_pool_indices[r];
        start = window_start(in.prefix_lens[r], in.window);
      }
      const i64 p = start + (t - row_begin);
      const int* rtt_row = in.req_to_token + row * in.rtt_stride;
      out.slots[t] = swa_translate<kHasLut>(rtt_row[p], in.lut, in.lut_len, clamped);
      out.prev[t] = p > 0 ? swa_translate<kHasLut>(rtt_row[p - 1], in.lut, in.lut_len, clamped) : -1;
      out.positions[t] = p;
      i64 token = -1;
      if (kHasPool) {
        const i64 q = p + in.token_offset;
        const i64 limit = in.valid_lens[r] < in.pool_cols ? in.valid_lens[r] : in.pool_cols;
        if (q >= 0 && q < limit) token = in.pool[row * in.pool_stride + q];
      }
      out.tokens[t] = token;
    }
  }
  warp_add(out.out_of_range_count, clamped);
}

template <bool kHasLut, bool kHasPool>
__global__ void __launch_bounds__(kPlanMaxThreads) plan_fused(PlanInputs in, PlanOutputs out) {
  __shared__ i64 verify_offsets[kFusedMaxBs + 1];
  const i64 total = plan_scan<kHasLut, kHasPool>(in, out, blockIdx.x == 0, verify_offsets);
  if (total > 0 && total <= out.verify_capacity) expand_entries<kHasLut, kHasPool>(in, out, verify_offsets, total);
}

template <bool kHasLut, bool kHasPool>
__global__ void __launch_bounds__(kPlanMaxThreads) plan_offsets(PlanInputs in, PlanOutputs out) {
  plan_scan<kHasLut, kHasPool>(in, out, true, nullptr);
}

template <bool kHasLut, bool kHasPool>
__global__ void plan_entries(PlanInputs in, PlanOutputs out) {
  const i64 total = out.verify_offsets[in.bs];
  if (total > 0 && *out.enable != 0) expand_entries<kHasLut, kHasPool>(in, out, out.verify_offsets, total);
}

}  // namespace kvcanary
