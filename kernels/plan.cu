// Plan kernels (docs/format.md §4 with the project's out-of-range rules, README "Out-of-range values").
//
// plan_fused (bs <= kFusedMaxBs, one launch): every block scans the batch into shared memory;
//   block 0 also writes the per-request outputs; then all blocks expand the verify entries.
// plan_offsets + plan_entries (any bs, two launches): one block scans the batch in tiles and
//   writes the per-request outputs; then a fixed grid expands the entries, reading the total on
//   the device.
// Either way the grid depends only on shapes, so a captured graph replays any batch content.
//
// Every kernel is instantiated for each table kind (kTable): the slot of a request's position is
// read through table_row / table_slot below, so the scan and the expansion never see the layout.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kPlanItemsPerThread = 4;
constexpr i64 kI64Max = 0x7fffffffffffffffLL;
constexpr i64 kNoSeed = -kI64Max - 1;  // INT64_MIN: table_slot never returns it (slots saturate at +-kI64Max)

// Table kinds (mirrored by kvcanary_cupy.tables.TableKind).
constexpr int kTableReqToToken = 0;    // SGLang req_to_token: a slot per token, row 0 = padding
constexpr int kTableVirtualPages = 1;  // req_to_token of virtual token ids + virtual_to_physical pages
constexpr int kTableBlock = 2;         // vLLM block table: a block id per block_size tokens
constexpr int kTablePagedKv = 3;       // FlashInfer CSR: kv_indptr / kv_indices, rows = batch rows

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
  const i64* req_pool_indices;  // null with a PagedKvIndices table (rows are batch rows)
  const i64* prefix_lens;
  const i64* extend_seq_lens;
  const void* table;  // req_to_token (int32), block_table or kv_indices (int32 or int64)
  const void* kv_indptr;  // [bs + 1] int32 or int64, PagedKvIndices only
  const i64* virtual_to_physical;  // ReqToToken with virtual pages only
  const i64* lut;  // null without an SWA LUT
  const int* pool;  // expected-token pool, null without one
  const i64* valid_lens;
  i64 bs;
  i64 table_rows;  // rows of req_to_token / block_table; entries of kv_indices
  i64 table_cols;  // entries per row of req_to_token / block_table
  i64 table_stride;  // elements between rows of req_to_token / block_table
  i64 page_size;  // tokens per block / page (1 for a plain req_to_token)
  i64 page_shift;  // log2(page_size) when it is a power of two, else -1
  u64 page_magic;  // else value / page_size == umulhi(value, page_magic) >> page_magic_shift (value < 2**62)
  i64 page_magic_shift;
  i64 page_id_limit;  // (2**63 - 1) / page_size: ids beyond +-this saturate (page_slot)
  i64 null_block;  // BlockTable: this id addresses the padding slot 0
  i64 num_virtual_pages;  // length of virtual_to_physical
  i64 window, lut_len, pool_stride, pool_cols, token_offset;
  int table_is_int64, kv_indptr_is_int64;
};

// Everything a plan writes, one pointer per field of VerifyPlan then WritePlan (mirrored by
// PLAN_OUTPUTS in cupy_backend.py, derived from the records' field table in plans.py).
struct PlanOutputs {
  i64* verify_slot_indices;  // the four verify entry arrays, [verify_capacity]
  i64* verify_expected_tokens;
  i64* verify_expected_positions;
  i64* verify_prev_slot_indices;
  int* verify_num_valid;
  int* enable;
  unsigned long long* out_of_range_count;
  i64* write_offsets;  // [write_req_capacity + 1]
  i64* write_seed_slot_indices;  // [write_req_capacity]
  int* write_num_valid_reqs;
  i64* verify_offsets;  // [write_req_capacity + 1]
  i64 verify_capacity, write_req_capacity;
  int clear_whole_capacity;  // the WritePlan is not known to be clean past write_num_valid_reqs
};

__device__ __forceinline__ i64 window_start(i64 prefix, i64 window) {
  return window > 0 && prefix - window > 0 ? prefix - window : 0;
}

// ---- table addressing ------------------------------------------------------------------------

// id * page_size + offset (0 <= offset < page_size), or +-kI64Max for an id at or beyond
// +-page_id_limit, whose slots could leave int64: such a slot lies outside any canary and is
// skipped and counted by verify/write like any other.
__device__ __forceinline__ i64 page_slot(const PlanInputs& in, i64 id, i64 offset) {
  if (id >= in.page_id_limit) return kI64Max;
  if (id <= -in.page_id_limit) return -kI64Max;
  return id * in.page_size + offset;
}

// A request's row of the table: `base` indexes its first entry, `len` is its length in tokens
// (the bound of prefix_lens); ok is false for a row outside the table.
struct TableRow {
  i64 base, len;
  bool ok;
};

template <int kTable>
__device__ __forceinline__ TableRow table_row(const PlanInputs& in, i64 r, i64 rp) {
  if (kTable == kTablePagedKv) {
    const i64 lo = load_index(in.kv_indptr, in.kv_indptr_is_int64, r);
    const i64 hi = load_index(in.kv_indptr, in.kv_indptr_is_int64, r + 1);
    const bool ok = lo >= 0 && lo <= hi && hi <= in.table_rows;
    return {ok ? lo : 0, ok ? (hi - lo) * in.page_size : 0, ok};
  }
  const bool ok = rp >= 0 && rp < in.table_rows;
  return {ok ? rp * in.table_stride : 0, kTable == kTableBlock ? in.table_cols * in.page_size : in.table_cols, ok};
}

// page = value / page_size, offset = value % page_size for 0 <= value < 2**62 (positions are below
// a row's length, at most 2**62; virtual token ids are int32): a shift or a multiply, no division.
__device__ __forceinline__ i64 page_of(const PlanInputs& in, i64 value, i64& offset) {
  const i64 page = in.page_shift >= 0 ? value >> in.page_shift
                                      : static_cast<i64>(__umul64hi(static_cast<u64>(value), in.page_magic) >> in.page_magic_shift);
  offset = value - page * in.page_size;
  return page;
}

// The KV slot of position p (0 <= p < row.len) of a valid row.  `errors` counts virtual token
// ids past virtual_to_physical (they address the padding slot 0).
template <int kTable>
__device__ __forceinline__ i64 table_slot(const PlanInputs& in, const TableRow& row, i64 p, i64& errors) {
  if (kTable == kTableReqToToken) return static_cast<const int*>(in.table)[row.base + p];
  i64 offset;
  if (kTable == kTableVirtualPages) {
    const i64 token = static_cast<const int*>(in.table)[row.base + p];
    if (token < 0) return token;  // negative ids pass through, as in a plain req_to_token
    const i64 page = page_of(in, token, offset);
    if (page >= in.num_virtual_pages) {
      ++errors;
      return 0;
    }
    const i64 physical = in.virtual_to_physical[page];
    return physical == -1 ? 0 : page_slot(in, physical, offset);  // -1: unbound page
  }
  const i64 id = load_index(in.table, in.table_is_int64, row.base + page_of(in, p, offset));
  if (kTable == kTableBlock && id == in.null_block) return 0;
  return page_slot(in, id, offset);
}

// ---- the batch scan --------------------------------------------------------------------------

// Rows [bs, end) may still hold an earlier plan's per-request outputs: up to the batch size that
// plan wrote (read before this plan overwrites it), or the whole capacity when that count is not
// a batch size or the host does not know the WritePlan to be clean past it.
__device__ __forceinline__ i64 stale_rows_end(const PlanOutputs& out) {
  const i64 previous = *out.write_num_valid_reqs;
  if (out.clear_whole_capacity || previous < 0 || previous > out.write_req_capacity) return out.write_req_capacity;
  return previous;
}

// Scans the whole batch with one block in tiles of blockDim * kPlanItemsPerThread rows.  Rows are
// warp-striped (item k of lane l in warp w is row tile + (w * K + k) * 32 + l), so every load and
// store is coalesced; the scan follows row order.  Returns the total number of verify entries
// (to every thread).  With write_outputs the block writes the per-request outputs, the counts
// and the out-of-range count; with smem_verify_offsets (bs <= kFusedMaxBs) it also keeps the
// verify offsets in shared memory.
template <int kTable, bool kHasLut, bool kHasPool>
__device__ i64 plan_scan(const PlanInputs& in, const PlanOutputs& out, bool write_outputs, i64* smem_verify_offsets) {
  __shared__ i64 carry_v, carry_w, stale_end;
  __shared__ unsigned long long block_errors;
  if (threadIdx.x == 0) {
    carry_v = 0; carry_w = 0; block_errors = 0;
    stale_end = write_outputs ? stale_rows_end(out) : 0;
  }
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
    // A req_to_token row 0 marks a padding request (rp 0); rows past bs are padding too.
#pragma unroll
    for (int k = 0; k < kPlanItemsPerThread; ++k) {
      const i64 r = first + 32 * k;
      const bool in_batch = r < bs;
      rp[k] = in_batch && in.req_pool_indices ? in.req_pool_indices[r] : 0;
      prefix[k] = in_batch ? in.prefix_lens[r] : 0;
      extend[k] = in_batch ? in.extend_seq_lens[r] : 0;
    }
#pragma unroll
    for (int k = 0; k < kPlanItemsPerThread; ++k) {
      const i64 r = first + 32 * k;
      const bool active = r < bs && (kTable > kTableVirtualPages || rp[k] != 0);
      seed_raw[k] = kNoSeed;
      if (write_outputs && active && prefix[k] > 0 && extend[k] > 0) {
        const TableRow row = table_row<kTable>(in, r, rp[k]);
        if (row.ok && prefix[k] <= row.len) seed_raw[k] = table_slot<kTable>(in, row, prefix[k] - 1, errors);
      }
    }
#pragma unroll
    for (int k = 0; k < kPlanItemsPerThread; ++k) {
      const i64 r = first + 32 * k;
      vlen[k] = wlen[k] = 0;
      const bool active = r < bs && (kTable > kTableVirtualPages || rp[k] != 0);
      i64 seed = -1;
      if (active) {
        const TableRow row = table_row<kTable>(in, r, rp[k]);
        const bool prefix_ok = prefix[k] >= 0 && prefix[k] <= row.len;
        errors += !row.ok + !prefix_ok + (extend[k] < 0);
        if (kHasPool) {
          const i64 lens = in.valid_lens[r];  // loaded late: fewer live registers
          errors += lens < 0 || lens > in.pool_cols;
        }
        const i64 start = window_start(prefix[k], in.window);
        const i64 end = clamp64(prefix[k], 0, row.len);
        if (row.ok && end > start) vlen[k] = end - start;
        wlen[k] = extend[k] > 0 ? extend[k] : 0;
        if (seed_raw[k] != kNoSeed) seed = swa_translate<kHasLut>(seed_raw[k], in.lut, in.lut_len, errors);
      }
      if (write_outputs && r < bs) out.write_seed_slot_indices[r] = seed;
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
    // Nothing stale past the batch (README, array conventions): rows the earlier plan wrote.
    for (i64 r = bs + threadIdx.x; r < stale_end; r += blockDim.x) {
      out.write_seed_slot_indices[r] = -1;
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

// ---- the entry expansion ---------------------------------------------------------------------

// Expands verify entries [0, total) over the whole grid.  Each warp takes a contiguous range, 32
// entries at a time; each lane finds its owner request by binary search once, then walks it
// forward with the request's table row cached in registers, so consecutive entries cost no search.
template <int kTable, bool kHasLut, bool kHasPool>
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
  // A request with entries has a valid table row: its pool row is its table row (batch row for CSR).
  i64 pool_row = kTable == kTablePagedKv ? r : in.req_pool_indices[r];
  TableRow row = table_row<kTable>(in, r, pool_row);
  i64 start = window_start(in.prefix_lens[r], in.window);
  i64 clamped = 0;
  for (i64 chunk = begin; chunk < end; chunk += 32) {
    t = chunk + lane;
    const bool live = t < end;
    i64 p = 0, slot = 0, slot_errors = 0;
    bool prev_is_left_lane = false;
    if (live) {
      if (t >= row_next) {  // verify_offsets[bs] == total > t ends the walk
        do row_next = verify_offsets[++r + 1]; while (t >= row_next);
        row_begin = verify_offsets[r];
        pool_row = kTable == kTablePagedKv ? r : in.req_pool_indices[r];
        row = table_row<kTable>(in, r, pool_row);
        start = window_start(in.prefix_lens[r], in.window);
      }
      p = start + (t - row_begin);
      slot = swa_translate<kHasLut>(table_slot<kTable>(in, row, p, slot_errors), in.lut, in.lut_len, slot_errors);
      prev_is_left_lane = lane > 0 && t > row_begin;  // entry t - 1 is position p - 1 of this row
    }
    // The predecessor of entry t is usually entry t - 1, looked up by the lane to the left: take
    // its slot (and the out-of-range counts of that lookup, so the count is the same as looking
    // it up again) instead of reading the table a second time.
    const i64 left_slot = __shfl_up_sync(0xffffffffu, slot, 1);
    const i64 left_errors = __shfl_up_sync(0xffffffffu, slot_errors, 1);
    if (live) {
      clamped += slot_errors;
      i64 prev = -1;
      if (prev_is_left_lane) {
        prev = left_slot;
        clamped += left_errors;
      } else if (p > 0) {
        prev = swa_translate<kHasLut>(table_slot<kTable>(in, row, p - 1, clamped), in.lut, in.lut_len, clamped);
      }
      out.verify_slot_indices[t] = slot;
      out.verify_prev_slot_indices[t] = prev;
      out.verify_expected_positions[t] = p;
      i64 token = -1;
      if (kHasPool) {
        const i64 q = p + in.token_offset;
        const i64 limit = in.valid_lens[r] < in.pool_cols ? in.valid_lens[r] : in.pool_cols;
        if (q >= 0 && q < limit) token = in.pool[pool_row * in.pool_stride + q];
      }
      out.verify_expected_tokens[t] = token;
    }
  }
  warp_add(out.out_of_range_count, clamped);
}

template <int kTable, bool kHasLut, bool kHasPool>
__global__ void __launch_bounds__(kPlanMaxThreads) plan_fused(PlanInputs in, PlanOutputs out) {
  __shared__ i64 verify_offsets[kFusedMaxBs + 1];
  const i64 total = plan_scan<kTable, kHasLut, kHasPool>(in, out, blockIdx.x == 0, verify_offsets);
  if (total > 0 && total <= out.verify_capacity) expand_entries<kTable, kHasLut, kHasPool>(in, out, verify_offsets, total);
}

template <int kTable, bool kHasLut, bool kHasPool>
__global__ void __launch_bounds__(kPlanMaxThreads) plan_offsets(PlanInputs in, PlanOutputs out) {
  plan_scan<kTable, kHasLut, kHasPool>(in, out, true, nullptr);
}

template <int kTable, bool kHasLut, bool kHasPool>
__global__ void plan_entries(PlanInputs in, PlanOutputs out) {
  const i64 total = out.verify_offsets[in.bs];
  if (total > 0 && *out.enable != 0) expand_entries<kTable, kHasLut, kHasPool>(in, out, out.verify_offsets, total);
}

}  // namespace kvcanary
