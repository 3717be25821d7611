// Plan kernels (docs/format.md §4 with the project's out-of-range rules, README "Out-of-range values").
//
// No block needs another to run first (nothing to reset between plans, no order between blocks to
// rely on; a large plan_offsets block waits a bounded time for earlier shares' totals, below):
// plan_small (up to 32 requests, one launch, no block-wide barrier before the expansion): every
//   warp scans the batch with shuffles, a row per lane, into shared arrays of its own and expands
//   its share of the verify entries from them, taking each request's row by shuffle from the lane
//   that scanned it (no reload); warp 0 of a spare last block writes the per-request outputs
//   beside the expansion.
// plan_fused (up to PLAN_FUSED_MAX_ROWS requests, one launch): every block scans the whole batch
//   into shared memory (a verify and a write offset per row), expands its share of the verify
//   entries from there and writes the per-request outputs of its share of the rows.
// plan_offsets + plan_entries (a larger batch, two launches): block b sums the rows before its
//   share, scans its share in tiles of shared memory and writes their outputs; then a fixed grid
//   expands the entries from those offsets, reading the total on the device.
// Either way the grid depends only on shapes, so a captured graph replays any batch content.
//
// Every kernel is instantiated for each table layout (kTable): the slot of a request's position is
// read through table_row / SlotLookup below, so the scan and the expansion never see the layout.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kPlanThreads = 512;  // plan_fused and plan_offsets blocks
constexpr int kScanRowsPerLane = 9;  // the most rows a lane sums in a pass of a long scan (odd: scan_pass_blocked)
constexpr int kSumUnroll = 8;  // rows whose loads a thread issues together in sum_rows
constexpr int kPlanSmallRows = 32;  // plan_small: a batch of up to a warp's width, a row per lane
constexpr i64 kI64Max = 0x7fffffffffffffffLL;
constexpr i64 kNoSeed = -kI64Max - 1;  // INT64_MIN: table_slot never returns it (slots saturate at +-kI64Max)

// Table layouts (kTable; mirrored by kvcanary_cupy.jit.TableLayout).  Each table kind (mirrored by
// kvcanary_cupy.tables.TableKind) has its general layout, of the kind's value.  A block or page
// table that the host knows to have int32 ids (and kv_indptr), a power-of-two page size, an int32
// null block and rows of at most 2**31 - 1 tokens (block_table's width, or kv_indices' length,
// times the page size) also has a narrow layout (kTableNarrow added; cupy_backend.table_layout
// picks it), which finds slots with 32-bit shifts and masks and never decides at run time.
constexpr int kTableReqToToken = 0;    // SGLang req_to_token: a slot per token, row 0 = padding
constexpr int kTableVirtualPages = 1;  // req_to_token of virtual token ids + virtual_to_physical pages
constexpr int kTableBlock = 2;         // vLLM block table: a block id per block_size tokens
constexpr int kTablePagedKv = 3;       // FlashInfer CSR: kv_indptr / kv_indices, rows = batch rows
constexpr int kTableNarrow = 4;
constexpr int kTableBlockNarrow = kTableBlock | kTableNarrow;
constexpr int kTablePagedKvNarrow = kTablePagedKv | kTableNarrow;

__host__ __device__ constexpr int table_kind(int table) { return table & ~kTableNarrow; }
__host__ __device__ constexpr bool is_narrow(int table) { return (table & kTableNarrow) != 0; }

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

// Inclusive scan of (a, b) over the lanes of a warp.
__device__ __forceinline__ void warp_inclusive_scan(i64& a, i64& b) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const i64 ua = __shfl_up_sync(0xffffffffu, a, o), ub = __shfl_up_sync(0xffffffffu, b, o);
    if (lane >= o) { a += ua; b += ub; }
  }
}

// Block-wide exclusive scan of the warps' totals (a, b): returns through the references what the
// earlier warps of the block hold, and the block's totals.  Lane 31 of each warp holds its totals.
__device__ __forceinline__ void scan_warp_totals(i64 a, i64 b, i64& before_a, i64& before_b, i64& total_a, i64& total_b) {
  __shared__ i64 warp_a[32], warp_b[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  if (lane == 31) { warp_a[warp] = a; warp_b[warp] = b; }
  __syncthreads();
  if (warp == 0) {
    i64 wa = lane < nwarps ? warp_a[lane] : 0, wb = lane < nwarps ? warp_b[lane] : 0;
    warp_inclusive_scan(wa, wb);
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
  unsigned long long* scan_state;  // the WritePlan's ScanState (plan_offsets), or null: none
  i64 scan_state_min_rows;  // smaller batches leave it alone (it costs more than it saves there)
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

// A request's row of the table: where its entries start, its length in tokens (the bound of
// prefix_lens), and ok, false for a row outside the table (whose entries are never read).  A
// general layout's row: `base` indexes its first entry; narrow (block and page tables): int32 ids,
// page_size and len below 2**31, so SlotLookup can work in 32 bits and no slot can saturate.
template <int kTable, bool kNarrowLayout = is_narrow(kTable)>
struct TableRow {
  i64 base, len;
  bool ok, narrow;
};

// A narrow layout's row: the global address of its first id (kept as an integer, which shuffles
// and selects carry without the compiler forgetting that it is global: read as a pointer, such an
// address is read with a generic load) and its length in 32 bits.
template <int kTable>
struct TableRow<kTable, true> {
  size_t ids;
  int len;
  bool ok;
};

constexpr i64 kNarrowLimit = 0x7fffffffLL;

template <int kTable>
__device__ __forceinline__ TableRow<kTable> table_row(const PlanInputs& in, i64 r, i64 rp) {
  if constexpr (is_narrow(kTable)) {  // the host's guarantees (above) keep every value in int32
    const size_t ids = __cvta_generic_to_global(in.table);
    const int shift = static_cast<int>(in.page_shift);
    if constexpr (kTable == kTablePagedKvNarrow) {
      const int lo = static_cast<const int*>(in.kv_indptr)[r], hi = static_cast<const int*>(in.kv_indptr)[r + 1];
      const bool ok = lo >= 0 && lo <= hi && hi <= static_cast<int>(in.table_rows);
      return {ids + (ok ? lo : 0) * sizeof(int), ok ? (hi - lo) << shift : 0, ok};
    } else {
      const bool ok = rp >= 0 && rp < in.table_rows;
      return {ids + (ok ? rp * in.table_stride : 0) * sizeof(int), static_cast<int>(in.table_cols) << shift, ok};
    }
  } else if constexpr (kTable == kTablePagedKv) {
    const i64 lo = load_index(in.kv_indptr, in.kv_indptr_is_int64, r);
    const i64 hi = load_index(in.kv_indptr, in.kv_indptr_is_int64, r + 1);
    const bool ok = lo >= 0 && lo <= hi && hi <= in.table_rows;
    const i64 len = ok ? (hi - lo) * in.page_size : 0;
    return {ok ? lo : 0, len, ok, !in.table_is_int64 && in.page_size <= kNarrowLimit && len <= kNarrowLimit};
  } else {
    const bool ok = rp >= 0 && rp < in.table_rows;
    const i64 len = kTable == kTableBlock ? in.table_cols * in.page_size : in.table_cols;
    return {ok ? rp * in.table_stride : 0, len, ok, !in.table_is_int64 && in.page_size <= kNarrowLimit && len <= kNarrowLimit};
  }
}

// page = value / page_size, offset = value % page_size for 0 <= value < 2**62 (positions are below
// a row's length, at most 2**62; virtual token ids are int32): a shift or a multiply, no division.
__device__ __forceinline__ i64 page_of(const PlanInputs& in, i64 value, i64& offset) {
  const i64 page = in.page_shift >= 0 ? value >> in.page_shift
                                      : static_cast<i64>(__umul64hi(static_cast<u64>(value), in.page_magic) >> in.page_magic_shift);
  offset = value - page * in.page_size;
  return page;
}

// Whether a slot lookup (table_slot, then the SWA LUT) can count an out-of-range value.
template <int kTable, bool kHasLut>
constexpr bool kLookupCounts = kTable == kTableVirtualPages || kHasLut;

// The KV slot of position p (0 <= p < row.len) of a valid row, looked up in two steps so that
// several lookups' loads can be in flight together: start() issues the load of the table element
// that holds p (and waits for nothing: the narrow and req_to_token paths keep it 32-bit, decide
// nothing on it), slot() waits for it and returns the slot.  slot() counts into `errors` the
// virtual token ids past virtual_to_physical (they address the padding slot 0).
template <int kTable, bool kNarrowLayout = is_narrow(kTable)>
struct SlotLookup {
  i64 wide_element, offset;  // the element of the wide path; p's offset in its page (block and page tables)
  int element;  // the element of every other path: a slot, a token id, or a block / page id
  bool narrow;

  __device__ __forceinline__ void start(const PlanInputs& in, const TableRow<kTable>& row, i64 p) {
    narrow = kTable <= kTableVirtualPages || row.narrow;
    if (kTable <= kTableVirtualPages) {
      element = static_cast<const int*>(in.table)[row.base + p];
    } else if (narrow) {  // int32 ids, a general page size: a shift or a 32-bit division, one multiply-add in slot()
      const unsigned q = static_cast<unsigned>(p), size = static_cast<unsigned>(in.page_size);
      const unsigned page = in.page_shift >= 0 ? q >> in.page_shift : q / size;
      element = static_cast<const int*>(in.table)[row.base + page];
      offset = q - page * size;
    } else {
      wide_element = load_index(in.table, in.table_is_int64, row.base + page_of(in, p, offset));
    }
  }

  __device__ __forceinline__ i64 slot(const PlanInputs& in, i64& errors) const {
    if (kTable == kTableReqToToken) return element;
    if (kTable == kTableVirtualPages) {
      const i64 token = element;
      if (token < 0) return token;  // negative ids pass through, as in a plain req_to_token
      i64 page_offset;
      const i64 page = page_of(in, token, page_offset);
      if (page >= in.num_virtual_pages) {
        ++errors;
        return 0;
      }
      const i64 physical = in.virtual_to_physical[page];
      return physical == -1 ? 0 : page_slot(in, physical, page_offset);  // -1: unbound page
    }
    if (narrow) {  // no saturation: |id * page_size| < 2**62
      const i64 slot = static_cast<i64>(element) * static_cast<int>(in.page_size) + offset;
      return kTable == kTableBlock && element == in.null_block ? 0 : slot;
    }
    if (kTable == kTableBlock && wide_element == in.null_block) return 0;
    return page_slot(in, wide_element, offset);
  }
};

// a * b, 32 x 32 -> 64 bits in one multiply(-add) (NVVM widens the operands to 64 bits first).
__device__ __forceinline__ i64 mul_wide(int a, int b) {
  i64 product;
  asm("mul.wide.s32 %0, %1, %2;" : "=l"(product) : "r"(a), "r"(b));
  return product;
}

// ... in a narrow layout: p's page is p >> page_shift, its offset p & (page_size - 1), its slot
// id * page_size + offset, all but the slot in 32 bits (no saturation: |id * page_size| < 2**62).
// The id comes through the read-only data cache (__ldg): the warps of a block read the same few
// ids of a row (H200, W3 plan: CSR 1.033 -> 1.021x req_to_token, block table unchanged; an
// L2-only load, __ldcg, was slower for both).
template <int kTable>
struct SlotLookup<kTable, true> {
  int id;
  unsigned offset;

  __device__ __forceinline__ void start(const PlanInputs& in, const TableRow<kTable>& row, i64 p) {
    const unsigned q = static_cast<unsigned>(p);
    id = __ldg(static_cast<const int*>(__cvta_global_to_generic(row.ids)) + (q >> static_cast<unsigned>(in.page_shift)));
    offset = q & (static_cast<unsigned>(in.page_size) - 1);
  }

  __device__ __forceinline__ i64 slot(const PlanInputs& in, i64&) const {
    const i64 slot = mul_wide(id, static_cast<int>(in.page_size)) + offset;
    return kTable == kTableBlockNarrow && id == static_cast<int>(in.null_block) ? 0 : slot;
  }
};

template <int kTable>
__device__ __forceinline__ i64 table_slot(const PlanInputs& in, const TableRow<kTable>& row, i64 p, i64& errors) {
  SlotLookup<kTable> lookup;
  lookup.start(in, row, p);
  return lookup.slot(in, errors);
}

// ---- the batch scan --------------------------------------------------------------------------

// Rows [bs, end) may still hold an earlier plan's per-request outputs: up to the batch size that
// plan wrote (read before this plan overwrites it), or the whole capacity when that count is not
// a batch size or the host does not know the WritePlan to be clean past it.
__device__ __forceinline__ i64 stale_rows_end(const PlanOutputs& out, i64 previous) {
  if (out.clear_whole_capacity || previous < 0 || previous > out.write_req_capacity) return out.write_req_capacity;
  return previous;
}

// Whether a request of a batch of bs may write `extend` (>= 0) new tokens: extend * bs <= 2**63 - 1,
// so no running sum of the batch's write lengths leaves int64 (extend_limit in the NumPy backend).
__device__ __forceinline__ bool extend_fits(i64 extend, i64 bs) {
  const unsigned long long e = static_cast<unsigned long long>(extend), b = static_cast<unsigned long long>(bs);
  return __umul64hi(e, b) == 0 && e * b <= static_cast<unsigned long long>(kI64Max);
}

// Whether row r (r < bs) plans anything: a req_to_token row 0 marks a padding request.
template <int kTable>
__device__ __forceinline__ bool row_active(i64 rp) { return kTable > kTableVirtualPages || rp != 0; }

// Row r's verify and write lengths: its window of the prefix inside its table row, and its new
// tokens (0 for an inactive row).
template <int kTable>
__device__ __forceinline__ void row_lengths(const PlanInputs& in, const TableRow<kTable>& row, i64 rp, i64 prefix, i64 extend, i64& v,
                                            i64& w) {
  v = w = 0;
  if (!row_active<kTable>(rp)) return;
  const i64 start = window_start(prefix, in.window), end = clamp64(prefix, 0, row.len);
  v = row.ok && end > start ? end - start : 0;
  w = extend > 0 && extend_fits(extend, in.bs) ? extend : 0;
}

// ... of row r, its table row looked up only for an active row.
template <int kTable>
__device__ __forceinline__ void row_lengths(const PlanInputs& in, i64 r, i64 rp, i64 prefix, i64 extend, i64& v, i64& w) {
  v = w = 0;
  if (row_active<kTable>(rp)) row_lengths<kTable>(in, table_row<kTable>(in, r, rp), rp, prefix, extend, v, w);
}

// Loads kRows rows (req_pool_indices, prefix_lens, extend_seq_lens) spaced `stride` apart from
// `first`, those below `last`, all in flight together.
template <int kRows>
struct RowGroup {
  i64 rp[kRows], prefix[kRows], extend[kRows];

  __device__ __forceinline__ void load(const PlanInputs& in, i64 first, i64 stride, i64 last) {
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const i64 r = first + k * stride;
      const bool have = r < last;
      rp[k] = have && in.req_pool_indices ? in.req_pool_indices[r] : 0;
      prefix[k] = have ? in.prefix_lens[r] : 0;
      extend[k] = have ? in.extend_seq_lens[r] : 0;
    }
  }
};

// The verify and write lengths of rows [lo, hi) summed over the block (every thread gets them);
// a sum needs fewer registers than a scan, so more rows are in flight at once.
template <int kTable>
__device__ void sum_rows(const PlanInputs& in, i64 lo, i64 hi, i64& total_v, i64& total_w) {
  i64 sum_v = 0, sum_w = 0;
  for (i64 first = lo + threadIdx.x; first < hi; first += static_cast<i64>(kSumUnroll) * blockDim.x) {
    RowGroup<kSumUnroll> g;
    g.load(in, first, blockDim.x, hi);
#pragma unroll
    for (int k = 0; k < kSumUnroll; ++k) {
      i64 v = 0, w = 0;
      const i64 r = first + k * blockDim.x;
      if (r < hi) row_lengths<kTable>(in, r, g.rp[k], g.prefix[k], g.extend[k], v, w);
      sum_v += v;
      sum_w += w;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    sum_v += __shfl_xor_sync(kFullMask, sum_v, o);
    sum_w += __shfl_xor_sync(kFullMask, sum_w, o);
  }
  i64 before_v, before_w;
  scan_warp_totals(sum_v, sum_w, before_v, before_w, total_v, total_w);
}

// One pass of scan_rows over rows [base, min(end, base + 64)) of a warp's chunk: two rows a lane,
// base + lane and base + 32 + lane, each 32 scanned with shuffles (their scans interleaved); the
// offsets, relative to the warp's first row, go to the shared arrays, and run_v / run_w (the
// warp's rows so far) grow by the pass's lengths.
template <int kTable>
__device__ __forceinline__ void scan_pass_strided(const PlanInputs& in, i64 lo, i64 base, i64 end, i64* voff, i64* woff, i64& run_v,
                                                  i64& run_w) {
  constexpr int kRows = 2;
  const int lane = threadIdx.x & 31;
  RowGroup<kRows> g;
  g.load(in, lo + base + lane, 32, lo + end);
  i64 v[kRows], w[kRows], inc_v[kRows], inc_w[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const i64 i = base + 32 * k + lane;
    v[k] = w[k] = 0;
    if (i < end) row_lengths<kTable>(in, lo + i, g.rp[k], g.prefix[k], g.extend[k], v[k], w[k]);
    inc_v[k] = v[k];
    inc_w[k] = w[k];
  }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const i64 uv = __shfl_up_sync(kFullMask, inc_v[k], o), uw = __shfl_up_sync(kFullMask, inc_w[k], o);
      if (lane >= o) { inc_v[k] += uv; inc_w[k] += uw; }
    }
  }
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const i64 i = base + 32 * k + lane;
    if (i < end) {
      voff[i] = run_v + inc_v[k] - v[k];
      woff[i] = run_w + inc_w[k] - w[k];
    }
    run_v += __shfl_sync(kFullMask, inc_v[k], 31);
    run_w += __shfl_sync(kFullMask, inc_w[k], 31);
  }
}

// ... for longer chunks: rows [base, end), at most 32 * kPerLane, in two steps over the shared
// arrays.  The lanes load the rows coalesced (base + 32 k + lane) and stage their lengths there;
// then each lane takes kPerLane consecutive rows (base + kPerLane * lane + k), sums them, and one
// warp scan of the lane sums places them all: a shuffle scan per 32 * kPerLane rows instead of
// one per 32 (the scan of a few thousand rows, which every block of a one-launch plan runs, was
// bound by its shuffles and 64-bit adds).  kPerLane is odd, so the lanes' accesses (kPerLane * 8
// bytes apart) fall in distinct bank pairs.
template <int kTable, int kPerLane>
__device__ __forceinline__ void scan_pass_blocked(const PlanInputs& in, i64 lo, i64 base, i64 end, i64* voff, i64* woff, i64& run_v,
                                                  i64& run_w) {
  static_assert(kPerLane % 2 == 1, "scan_pass_blocked: an odd number of rows a lane");
  const int lane = threadIdx.x & 31;
  RowGroup<kPerLane> g;
  g.load(in, lo + base + lane, 32, lo + end);
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const i64 i = base + 32 * k + lane;
    if (i < end) {
      i64 v, w;
      row_lengths<kTable>(in, lo + i, g.rp[k], g.prefix[k], g.extend[k], v, w);
      voff[i] = v;
      woff[i] = w;
    }
  }
  __syncwarp();
  const i64 mine = base + kPerLane * lane;
  i64 v[kPerLane], w[kPerLane], sum_v = 0, sum_w = 0;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const bool have = mine + k < end;
    v[k] = have ? voff[mine + k] : 0;
    w[k] = have ? woff[mine + k] : 0;
    sum_v += v[k];
    sum_w += w[k];
  }
  i64 inc_v = sum_v, inc_w = sum_w;
  warp_inclusive_scan(inc_v, inc_w);
  i64 at_v = run_v + inc_v - sum_v, at_w = run_w + inc_w - sum_w;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    if (mine + k < end) {
      voff[mine + k] = at_v;
      woff[mine + k] = at_w;
    }
    at_v += v[k];
    at_w += w[k];
  }
  run_v += __shfl_sync(kFullMask, inc_v, 31);
  run_w += __shfl_sync(kFullMask, inc_w, 31);
}

// The blocked pass for `per_lane` rows a lane (odd, 3 to kPerLane), its variant picked once per
// pass (per_lane is the same for every warp of the block).
template <int kTable, int kPerLane>
__device__ __forceinline__ void scan_pass(int per_lane, const PlanInputs& in, i64 lo, i64 base, i64 end, i64* voff, i64* woff,
                                          i64& run_v, i64& run_w) {
  if constexpr (kPerLane > 3) {
    if (per_lane < kPerLane) return scan_pass<kTable, kPerLane - 2>(per_lane, in, lo, base, end, voff, woff, run_v, run_w);
  }
  if constexpr (kPerLane >= 3) scan_pass_blocked<kTable, kPerLane>(in, lo, base, end, voff, woff, run_v, run_w);
}

// Turns rows [lo, lo + n) into offsets in shared memory: voff[i] / woff[i] = carry + the verify /
// write lengths of rows lo .. lo + i - 1, and voff[n] / woff[n] = the carries past the last row
// (returned through carry_v / carry_w).  Warp w takes a contiguous chunk of the rows, in passes
// of 64 rows (scan_pass_strided) or, with kRowsPerLane > 1 and chunks longer than 64 rows, of
// 32 * per_lane rows (per_lane odd, at most kRowsPerLane: scan_pass_blocked); then the block
// scans the warps' totals and each warp adds what precedes it.
template <int kTable, int kRowsPerLane>
__device__ void scan_rows(const PlanInputs& in, i64 lo, i64 n, i64* voff, i64* woff, i64& carry_v, i64& carry_w) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const i64 chunk = ((n + num_warps - 1) / num_warps + 31) & ~static_cast<i64>(31);
  const i64 first_row = min(n, warp * chunk), last_row = min(n, first_row + chunk);
  i64 run_v = 0, run_w = 0;  // this warp's rows so far
  const int per_lane = kRowsPerLane == 1 || chunk <= 64 ? 1 : static_cast<int>(min(static_cast<i64>(kRowsPerLane), (chunk >> 5) | 1));
  if (per_lane == 1) {
    for (i64 base = first_row; base < last_row; base += 64) scan_pass_strided<kTable>(in, lo, base, last_row, voff, woff, run_v, run_w);
  } else {
    for (i64 base = first_row; base < last_row; base += 32 * per_lane)
      scan_pass<kTable, kRowsPerLane>(per_lane, in, lo, base, min(last_row, base + 32 * per_lane), voff, woff, run_v, run_w);
  }
  i64 before_v, before_w, total_v, total_w;
  scan_warp_totals(run_v, run_w, before_v, before_w, total_v, total_w);
  before_v += carry_v;
  before_w += carry_w;
  for (i64 i = first_row + lane; i < last_row; i += 32) {
    voff[i] += before_v;
    woff[i] += before_w;
  }
  carry_v += total_v;
  carry_w += total_w;
  if (threadIdx.x == 0) {
    voff[n] = carry_v;
    woff[n] = carry_w;
  }
  __syncthreads();
}

// The per-request outputs of one row, in two steps: begin() loads the row (or start() takes it
// loaded, with its table row) and issues its seed gather and counts its out-of-range values,
// finish() (which waits for the gather) writes the verify and write offsets (from the shared
// arrays, index r - base) and the seed, and returns the row's out-of-range count.  Work issued
// between the two hides the gather's latency.
template <int kTable, bool kHasLut, bool kHasPool>
struct RowOutput {
  i64 r, rp, seed_raw, errors;
  bool have;

  __device__ __forceinline__ void begin(const PlanInputs& in, i64 row, i64 hi) {
    const bool in_batch = row < hi;
    const i64 pool_index = in_batch && in.req_pool_indices ? in.req_pool_indices[row] : 0;
    const bool active = in_batch && row_active<kTable>(pool_index);
    start(in, row, in_batch, pool_index, in_batch ? in.prefix_lens[row] : 0, in_batch ? in.extend_seq_lens[row] : 0,
          active ? table_row<kTable>(in, row, pool_index) : TableRow<kTable>{});
  }

  // `table`: the table row of an active row in the batch (else unused).
  __device__ __forceinline__ void start(const PlanInputs& in, i64 row, bool in_batch, i64 pool_index, i64 prefix, i64 extend,
                                        const TableRow<kTable>& table) {
    r = row;
    have = in_batch;
    rp = pool_index;
    seed_raw = kNoSeed;
    errors = 0;
    if (!have || !row_active<kTable>(rp)) return;
    const bool prefix_ok = prefix >= 0 && prefix <= table.len;
    const bool extend_ok = extend >= 0 && extend_fits(extend, in.bs);
    errors = !table.ok + !prefix_ok + !extend_ok;
    if (table.ok && prefix_ok && prefix > 0 && extend_ok && extend > 0) seed_raw = table_slot<kTable>(in, table, prefix - 1, errors);
  }

  __device__ __forceinline__ i64 finish(const PlanInputs& in, const PlanOutputs& out, const i64* voff, const i64* woff,
                                        i64 base) {
    if (!have) return 0;
    i64 seed = -1;
    if (row_active<kTable>(rp)) {
      if (kHasPool) {
        const i64 lens = in.valid_lens[r];
        errors += lens < 0 || lens > in.pool_cols;
      }
      if (seed_raw != kNoSeed) seed = swa_translate<kHasLut>(seed_raw, in.lut, in.lut_len, errors);
    }
    out.write_seed_slot_indices[r] = seed;
    out.verify_offsets[r] = voff[r - base];
    out.write_offsets[r] = woff[r - base];
    return errors;
  }
};

// The per-request outputs of rows [lo, hi), a thread per row, two rows' gathers in flight at once.
template <int kTable, bool kHasLut, bool kHasPool>
__device__ i64 write_row_outputs(const PlanInputs& in, const PlanOutputs& out, const i64* voff, const i64* woff, i64 base,
                                 i64 lo, i64 hi) {
  i64 errors = 0;
  for (i64 first = lo + threadIdx.x; first < hi; first += 2 * static_cast<i64>(blockDim.x)) {
    RowOutput<kTable, kHasLut, kHasPool> a, b;
    a.begin(in, first, hi);
    b.begin(in, first + blockDim.x, hi);
    errors += a.finish(in, out, voff, woff, base) + b.finish(in, out, voff, woff, base);
  }
  return errors;
}

// The batch-wide outputs, by one block (the one that read `previous`, the batch size the earlier
// plan wrote, before this plan overwrites it): the ends of the offsets, the counts, and the rows
// of the earlier plan past this batch cleared.
__device__ void finish_plan(const PlanOutputs& out, i64 bs, i64 total_v, i64 total_w, i64 previous) {
  __shared__ i64 stale_end;
  if (threadIdx.x == 0) {
    stale_end = stale_rows_end(out, previous);
    out.verify_offsets[bs] = total_v;
    out.write_offsets[bs] = total_w;
    *out.verify_num_valid = static_cast<int>(total_v < out.verify_capacity ? total_v : out.verify_capacity);
    *out.enable = total_v <= out.verify_capacity ? 1 : 0;
    *out.write_num_valid_reqs = static_cast<int>(bs);
  }
  __syncthreads();
  // Nothing stale past the batch (README, array conventions): rows the earlier plan wrote.
  for (i64 r = bs + threadIdx.x; r < stale_end; r += blockDim.x) {
    out.write_seed_slot_indices[r] = -1;
    out.verify_offsets[r + 1] = 0;
    out.write_offsets[r + 1] = 0;
  }
}

// Rows of the scan's shared arrays: what the launch's dynamic shared memory holds (a verify and a
// write offset per row, and their ends), so the host sizes the tile by sizing the memory.
__device__ __forceinline__ i64 scan_tile_rows() {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return static_cast<i64>(bytes / (2 * sizeof(i64))) - 1;
}

// ---- the entry expansion ---------------------------------------------------------------------

// One lane's verify entry of a 32-entry chunk of a warp: entry t checks `slot` at `position`
// against `prev` (its predecessor's slot, -1 for none) and `token` (-1: unchecked); with
// prev_is_left_lane the predecessor is entry t - 1, the left lane's entry of the same chunk.  A
// lane past the warp's range (live false) holds slot 0, prev -1 and token -1.
struct PlannedEntry {
  i64 t, slot, prev, position;
  int token;  // -1 or an entry of the int32 pool (int: a register less across a verifying sink)
  bool live, prev_is_left_lane;
};

// Where expand_entries hands the entries, kChunks chunks of a warp at a time (every lane calls it,
// converged).  StoreEntries keeps them in the VerifyPlan, a chunk at a time (more chunks per step
// only made the store-only plan slower); a fused verify checks them instead.  Registers a sink
// that gathers records cannot spare, a storing one can: kEarlyRowOutput, plan_and_expand starts
// each thread's first per-request output before the expansion (live across it); kPairedLookups,
// expand_entries has an entry's slot lookup and its predecessor's in flight together.
struct StoreEntries {
  static constexpr int kChunks = 1;
  static constexpr bool kEarlyRowOutput = true;
  static constexpr bool kPairedLookups = true;
  const PlanOutputs& out;

  __device__ __forceinline__ void operator()(const PlannedEntry (&chunks)[kChunks]) const {
    const PlannedEntry& e = chunks[0];
    if (!e.live) return;
    out.verify_slot_indices[e.t] = e.slot;
    out.verify_prev_slot_indices[e.t] = e.prev;
    out.verify_expected_positions[e.t] = e.position;
    out.verify_expected_tokens[e.t] = e.token;
  }
};

// A request's row as expand_entries walks it.
template <int kTable>
struct ExpandRow {
  i64 pool_row;  // its row of the expected-token pool: its pool row (its batch row with a CSR table)
  TableRow<kTable> table;
  i64 start;  // its window start: the position of its first verify entry
};

// Where expand_entries finds the row of the warp's first entry and takes a request's ExpandRow
// (fetch: every lane calls it, converged; lanes with `need` take row r).  ReloadRows (any batch
// size) searches the offsets and loads the row from global memory.
template <int kTable>
struct ReloadRows {
  // The request of entry `begin` (the largest r < bs with offsets[r] <= begin), searched by the
  // whole warp: each step probes 32 rows at once, so a batch of 20,000 requests takes three
  // dependent loads.
  __device__ __forceinline__ i64 first_row(const PlanInputs& in, const i64* offsets, i64 begin) const {
    const int lane = threadIdx.x & 31;
    i64 lo = 0, hi = in.bs;  // offsets[lo] <= begin < offsets[hi]
    while (hi - lo > 1) {
      const i64 stride = (hi - lo + 31) >> 5;
      const i64 probe = lo + lane * stride;
      const unsigned below = __ballot_sync(kFullMask, probe < hi && offsets[probe] <= begin);
      lo += (31 - __clz(below)) * stride;  // lane 0 probes lo itself, so `below` is never empty
      hi = min(hi, lo + stride);
    }
    return lo;
  }

  // A request with entries has a valid table row: its pool row is its table row.
  __device__ __forceinline__ void fetch(const PlanInputs& in, i64 r, bool need, ExpandRow<kTable>& row) const {
    if (!need) return;
    row.pool_row = table_kind(kTable) == kTablePagedKv ? r : in.req_pool_indices[r];
    row.table = table_row<kTable>(in, r, row.pool_row);
    row.start = window_start(in.prefix_lens[r], in.window);
  }
};

// LaneRows (plan_small, a batch of at most 32 rows): lane i holds row i from its scan, so the
// first row is a ballot over the lanes' offsets and a row comes from its lane by shuffle: no
// global load between the scan and the table lookups.
template <int kTable>
struct LaneRows {
  ExpandRow<kTable> own;  // this lane's row (anything past the batch: never taken)
  i64 offset;  // its verify offset (the batch's total past the batch)

  __device__ __forceinline__ i64 first_row(const PlanInputs&, const i64*, i64 begin) const {
    // Lanes past the batch hold the total, above begin; lane 0 holds 0 <= begin.
    return 31 - __clz(__ballot_sync(kFullMask, offset <= begin));
  }

  // Only what the expansion reads: not the table row's len or ok (a row with entries lies in the
  // table), nor a page table's pool row (its batch row r).  A narrow layout's row with entries
  // starts in [0, len), 32 bits.
  __device__ __forceinline__ void fetch(const PlanInputs&, i64 r, bool need, ExpandRow<kTable>& row) const {
    if (!__any_sync(kFullMask, need)) return;  // the usual case past the first row: no shuffle to wait for
    const int src = static_cast<int>(r);
    ExpandRow<kTable> got = row;
    got.pool_row = table_kind(kTable) == kTablePagedKv ? r : __shfl_sync(kFullMask, own.pool_row, src);
    if constexpr (is_narrow(kTable)) {
      got.table.ids = __shfl_sync(kFullMask, own.table.ids, src);
      got.start = __shfl_sync(kFullMask, static_cast<unsigned>(own.start), src);
    } else {
      got.table.base = __shfl_sync(kFullMask, own.table.base, src);
      got.table.narrow = __shfl_sync(kFullMask, static_cast<int>(own.table.narrow), src);
      got.start = __shfl_sync(kFullMask, own.start, src);
    }
    if (need) row = got;
  }
};

// Expands verify entries [0, total) over the whole grid into `sink`.  Each warp takes a
// contiguous range, Sink::kChunks chunks of 32 entries at a time: it first looks up every chunk's
// slots (their loads all in flight together), then takes each entry's predecessor from the left
// lane.  The warp finds the request of its first entry together (through `rows`, a ReloadRows or
// LaneRows), then each lane walks forward over the offsets with its request's row cached in
// registers, so consecutive entries cost no search.
template <int kTable, bool kHasLut, bool kHasPool, class Sink, class Rows>
__device__ void expand_entries(const PlanInputs& in, const PlanOutputs& out, const i64* verify_offsets, i64 total,
                               const Sink& sink, const Rows& rows) {
  constexpr int kChunks = Sink::kChunks;
  const int lane = threadIdx.x & 31;
  const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const i64 num_warps = (static_cast<i64>(gridDim.x) * blockDim.x) >> 5;
  // A one-launch grid has a warp per 32 entries of verify capacity (when it is not capped at one
  // block per SM): then every warp takes 32 entries, no division needed.
  const i64 per_warp = total <= 32 * num_warps ? 32 : ((total + num_warps - 1) / num_warps + 31) & ~static_cast<i64>(31);
  const i64 begin = warp * per_warp;
  if (begin >= total) return;
  const i64 end = begin + per_warp < total ? begin + per_warp : total;

  i64 r = rows.first_row(in, verify_offsets, begin);
  i64 row_begin = verify_offsets[r], row_next = verify_offsets[r + 1];
  ExpandRow<kTable> row;
  rows.fetch(in, r, true, row);
  i64 clamped = 0;
  // The slot of a lookup started at the current row, its out-of-range values counted into `errors`.
  const auto slot_of = [&](const SlotLookup<kTable>& lookup, i64& errors) {
    return swa_translate<kHasLut>(lookup.slot(in, errors), in.lut, in.lut_len, errors);
  };
  for (i64 first = begin; first < end; first += 32 * kChunks) {
    PlannedEntry e[kChunks];
    i64 slot_errors[kChunks];
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const i64 t = first + 32 * k + lane;
      e[k] = PlannedEntry{t, 0, -1, 0, -1, t < end, false};
      slot_errors[k] = 0;
      const bool moves = e[k].live && t >= row_next;
      if (moves) {  // verify_offsets[bs] == total > t ends the walk
        do row_next = verify_offsets[++r + 1]; while (t >= row_next);
        row_begin = verify_offsets[r];
      }
      rows.fetch(in, r, moves, row);  // after the walk, converged
      if (!e[k].live) continue;
      const i64 p = row.start + (t - row_begin);
      e[k].position = p;
      e[k].prev_is_left_lane = lane > 0 && t > row_begin;  // entry t - 1 is position p - 1 of this row
      // A predecessor no lane holds (first entry of the chunk or of the row) is looked up while the
      // walk is at this row.  With a sink that can spare the registers (Sink::kPairedLookups: the
      // store-only plans) its load goes out with the entry's own: after the entry's slot, it would
      // wait for the entry's load (a second dependent load on a small plan's path).  A fused
      // verify is short of registers (two lookups in flight spill): after the entry's slot.
      const bool look_back = !e[k].prev_is_left_lane && p > 0;
      SlotLookup<kTable> own, back;
      own.start(in, row.table, p);
      if (Sink::kPairedLookups && look_back) back.start(in, row.table, p - 1);
      e[k].slot = slot_of(own, slot_errors[k]);
      if (look_back) {
        if (!Sink::kPairedLookups) back.start(in, row.table, p - 1);
        e[k].prev = slot_of(back, clamped);
      }
      if (kHasPool) {
        const i64 q = p + in.token_offset;
        const i64 limit = in.valid_lens[r] < in.pool_cols ? in.valid_lens[r] : in.pool_cols;
        if (q >= 0 && q < limit) e[k].token = in.pool[row.pool_row * in.pool_stride + q];
      }
    }
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      // The predecessor of entry t is usually entry t - 1, looked up by the lane to the left: take
      // its slot (and the out-of-range counts of that lookup, so the count is the same as looking
      // it up again) instead of reading the table a second time.
      const i64 left_slot = __shfl_up_sync(kFullMask, e[k].slot, 1);
      const i64 left_errors = kLookupCounts<kTable, kHasLut> ? __shfl_up_sync(kFullMask, slot_errors[k], 1) : 0;
      if (!e[k].live) continue;
      clamped += slot_errors[k];
      if (e[k].prev_is_left_lane) {
        e[k].prev = left_slot;
        clamped += left_errors;
      }
    }
    sink(e);
  }
  warp_add(out.out_of_range_count, clamped);
}

// `v`, as a value the compiler cannot relate to any other: what is computed from it is computed
// afresh, not carried in registers from an earlier computation of the same.
__device__ __forceinline__ i64 opaque(i64 v) {
  asm volatile("" : "+l"(v));
  return v;
}

// Rows [lo, hi) of the batch: block b's share of the per-request outputs of a one-launch plan.
__device__ __forceinline__ void block_row_share(i64 bs, i64& lo, i64& hi) {
  const i64 share = (bs + gridDim.x - 1) / gridDim.x;
  lo = min(bs, blockIdx.x * share);
  hi = min(bs, lo + share);
}

// The body of a one-launch plan (the whole batch fits the shared arrays; launched with
// plan_fused's config): every block scans the batch on its own, expands its share of the entries
// into `sink` from the offsets in its shared memory (unless they exceed the verify capacity),
// then writes the per-request outputs of its share of the rows.  Returns the number of entries
// expanded (over the whole grid; 0 when none are).  What only the work after the expansion uses
// (the earlier batch size, the totals, the shared arrays' addresses, the row share) is kept out of
// registers across it: the expansion and a verifying sink need every register they can get.
template <int kTable, bool kHasLut, bool kHasPool, int kScanRows, class Sink>
__device__ __forceinline__ i64 plan_and_expand(const PlanInputs& in, const PlanOutputs& out, const Sink& sink) {
  extern __shared__ i64 smem[];  // the verify offsets [bs + 1], then the write offsets [bs + 1]
  __shared__ int previous;  // the batch size the earlier plan wrote (block 0, thread 0)
  // Read first (block 0 overwrites it), kept in shared memory once the scan is done.
  const int earlier = blockIdx.x == 0 && threadIdx.x == 0 ? *out.write_num_valid_reqs : 0;
  i64 total_v = 0, total_w = 0;
  scan_rows<kTable, kScanRows>(in, 0, in.bs, smem, smem + in.bs + 1, total_v, total_w);
  if (threadIdx.x == 0) previous = earlier;
  // With a sink that asks for it (StoreEntries), the first row of each thread's share starts now,
  // so its seed gather overlaps the expansion; a verifying sink needs those registers for its own
  // gathers.
  constexpr bool kEarlyRow = Sink::kEarlyRowOutput;
  RowOutput<kTable, kHasLut, kHasPool> own;
  i64 lo, hi;
  if (kEarlyRow) {
    block_row_share(in.bs, lo, hi);
    own.begin(in, lo + threadIdx.x, hi);
  }
  if (total_v > 0 && total_v <= out.verify_capacity)
    expand_entries<kTable, kHasLut, kHasPool>(in, out, smem, total_v, sink, ReloadRows<kTable>{});
  const i64 bs = opaque(in.bs);
  const i64 *voff = smem, *woff = smem + bs + 1, total = voff[bs];
  if (!kEarlyRow) block_row_share(bs, lo, hi);
  i64 errors = kEarlyRow ? own.finish(in, out, voff, woff, 0) : 0;
  errors += write_row_outputs<kTable, kHasLut, kHasPool>(in, out, voff, woff, 0, kEarlyRow ? lo + blockDim.x : lo, hi);
  if (blockIdx.x == 0) finish_plan(out, bs, total, woff[bs], previous);
  warp_add(out.out_of_range_count, errors);
  return total > 0 && total <= out.verify_capacity ? total : 0;
}

// kScanRows: the most rows a lane sums in a pass of the scan (scan_rows), 1 or kScanRowsPerLane;
// the host takes 1 (the strided passes alone, a smaller kernel) for batches whose warps scan at
// most 64 rows each.
template <int kTable, bool kHasLut, bool kHasPool, int kScanRows>
__global__ void __launch_bounds__(kPlanThreads, 1) plan_fused(PlanInputs in, PlanOutputs out) {
  wait_for_prior_grids();
  plan_and_expand<kTable, kHasLut, kHasPool, kScanRows>(in, out, StoreEntries{out});
}

// A batch of at most kPlanSmallRows requests (a row per lane) in one launch, without the block-wide
// scan: every warp scans the batch with shuffles into shared arrays of its own (only __syncwarp
// orders them), then expands its share of the entries; warp 0 of the last block writes the
// per-request outputs and that block finishes the plan.  The host gives the grid a block past
// those the expansion needs (unless it is capped at one per SM), so that this work runs beside
// the expansion.  A small batch's plan is latency-bound: it pays for as few dependent steps as
// possible.
template <int kTable, bool kHasLut, bool kHasPool>
__global__ void __launch_bounds__(kPlanThreads, 1) plan_small(PlanInputs in, PlanOutputs out) {
  wait_for_prior_grids();
  __shared__ i64 warp_offsets[kPlanThreads / 32][2][kPlanSmallRows + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  i64* voff = warp_offsets[warp][0];
  i64* woff = warp_offsets[warp][1];
  const i64 bs = in.bs;
  const bool finisher = blockIdx.x == gridDim.x - 1;
  // Read first, used last: the batch size the earlier plan wrote (the finisher overwrites it).
  const i64 previous = finisher && threadIdx.x == 0 ? *out.write_num_valid_reqs : 0;
  RowGroup<1> g;
  g.load(in, lane, 32, bs);
  const bool in_batch = lane < bs;
  LaneRows<kTable> rows;
  rows.own.pool_row = table_kind(kTable) == kTablePagedKv ? lane : g.rp[0];
  rows.own.table = in_batch && row_active<kTable>(g.rp[0]) ? table_row<kTable>(in, lane, g.rp[0]) : TableRow<kTable>{};
  rows.own.start = window_start(g.prefix[0], in.window);
  i64 v = 0, w = 0;
  if (in_batch) row_lengths<kTable>(in, rows.own.table, g.rp[0], g.prefix[0], g.extend[0], v, w);
  i64 inc_v = v, inc_w = w;
  warp_inclusive_scan(inc_v, inc_w);
  // Lanes past the batch add nothing, so lane bs (bs < 32) holds the totals, as offsets[bs] must.
  rows.offset = inc_v - v;
  voff[lane] = rows.offset;
  woff[lane] = inc_w - w;
  const i64 total_v = __shfl_sync(kFullMask, inc_v, 31), total_w = __shfl_sync(kFullMask, inc_w, 31);
  if (lane == 0) {
    voff[kPlanSmallRows] = total_v;
    woff[kPlanSmallRows] = total_w;
  }
  __syncwarp();
  const bool writes_rows = finisher && warp == 0;
  RowOutput<kTable, kHasLut, kHasPool> own;
  // Its seed gather overlaps the expansion.
  if (writes_rows) own.start(in, lane, in_batch, g.rp[0], g.prefix[0], g.extend[0], rows.own.table);
  if (total_v > 0 && total_v <= out.verify_capacity)
    expand_entries<kTable, kHasLut, kHasPool>(in, out, voff, total_v, StoreEntries{out}, rows);
  const i64 errors = writes_rows ? own.finish(in, out, voff, woff, 0) : 0;
  if (finisher) finish_plan(out, bs, total_v, total_w, previous);
  warp_add(out.out_of_range_count, errors);
}

// ---- the cross-block scan of plan_offsets ------------------------------------------------------

// A WritePlan's scan state (int64 [3 * kScanStateTiles], zeroed when allocated; mirrored by
// kvcanary_cupy.plans.SCAN_STATE_TILES): block b of plan_offsets publishes its share's totals in
// totals[b] under flag[b] = the number of plans that used the state so far, this one included.
// Every block publishes in every such plan (an empty share publishes zeros) and each flag has one
// writer, so a block learns that number from its own flag (+ 1): no atomics, nothing to reset,
// and an earlier plan's flag never matches.  Waiting on an earlier share is bounded: a block whose
// predecessor has not run yet (the GPU shared with other work) sums the rows before its share
// itself, so no order of running blocks can deadlock it.
constexpr int kScanStateTiles = 1024;
constexpr int kScanStatePolls = 1 << 14;  // about 2 ms of polls, 100 ns apart, before summing alone
struct ScanState {
  unsigned long long flag[kScanStateTiles];
  i64 totals[kScanStateTiles][2];
};
static_assert(sizeof(ScanState) == 3 * kScanStateTiles * sizeof(i64), "ScanState: int64 [3 * tiles]");

__device__ __forceinline__ void store_release(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// The sums of the totals the blocks before `tile` published under `flag` (every thread gets them),
// or false when one of them did not publish in time: a thread per earlier share polls its flag,
// pausing between polls (every block of the grid waits at about the same time), then the block
// adds the totals up.
__device__ bool wait_earlier_totals(ScanState* state, i64 tile, unsigned long long flag, i64& before_v, i64& before_w) {
  i64 v = 0, w = 0;
  bool ok = true;
  for (i64 t = threadIdx.x; ok && t < tile; t += blockDim.x) {
    for (int polls = 0; load_acquire(&state->flag[t]) != flag; ++polls) {
      if (polls == kScanStatePolls) {
        ok = false;
        break;
      }
      __nanosleep(100);
    }
    if (ok) {
      v += __ldcg(&state->totals[t][0]);
      w += __ldcg(&state->totals[t][1]);
    }
  }
  const bool published = __syncthreads_and(ok);
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(kFullMask, v, o);
    w += __shfl_xor_sync(kFullMask, w, o);
  }
  i64 earlier_warps_v, earlier_warps_w;
  scan_warp_totals(v, w, earlier_warps_v, earlier_warps_w, before_v, before_w);
  return published;
}

// This plan's flag for block `tile`: its own flag (written by it alone) + 1.
__device__ __forceinline__ unsigned long long own_flag(const ScanState* state, i64 tile) {
  return __ldcg(&state->flag[tile]) + 1;
}

// Block `tile` publishes its share's totals under `flag` (thread 0; an empty share publishes zeros).
__device__ __forceinline__ void publish_totals(ScanState* state, i64 tile, unsigned long long flag, i64 v, i64 w) {
  if (threadIdx.x != 0) return;
  state->totals[tile][0] = v;
  state->totals[tile][1] = w;
  store_release(&state->flag[tile], flag);
}

// The verify and write lengths of rows [0, lo), the rows before block `tile`'s share: from the
// earlier shares' published totals when there is a state and they come in time, else summed by
// the block itself.
template <int kTable>
__device__ __forceinline__ void lengths_before(const PlanInputs& in, ScanState* state, i64 tile, unsigned long long flag, i64 lo,
                                               i64& before_v, i64& before_w) {
  before_v = before_w = 0;
  if (!(state && wait_earlier_totals(state, tile, flag, before_v, before_w))) sum_rows<kTable>(in, 0, lo, before_v, before_w);
}

// plan_offsets for a share of at most a row per thread, in one pass: each thread loads its row
// once, the block scans the rows, publishes its totals (with a scan state) and issues its row's
// seed gather before it waits for the earlier shares (or sums the rows before them), so the
// gather's latency overlaps the wait.
template <int kTable, bool kHasLut, bool kHasPool>
__device__ __forceinline__ void plan_offsets_one_pass(const PlanInputs& in, const PlanOutputs& out, ScanState* state, i64* voff,
                                                      i64* woff, i64 lo, i64 hi, bool finisher, i64 previous) {
  if (lo >= hi && !finisher && !state) return;
  const unsigned long long flag = state ? own_flag(state, blockIdx.x) : 0;
  const i64 r = lo + threadIdx.x;
  RowGroup<1> g;
  g.load(in, r, 0, hi);
  const bool in_share = r < hi;
  const TableRow<kTable> table = in_share && row_active<kTable>(g.rp[0]) ? table_row<kTable>(in, r, g.rp[0]) : TableRow<kTable>{};
  i64 v = 0, w = 0;
  if (in_share) row_lengths<kTable>(in, table, g.rp[0], g.prefix[0], g.extend[0], v, w);
  i64 inc_v = v, inc_w = w;
  warp_inclusive_scan(inc_v, inc_w);
  i64 before_v, before_w, total_v, total_w;
  scan_warp_totals(inc_v, inc_w, before_v, before_w, total_v, total_w);
  if (state) publish_totals(state, blockIdx.x, flag, total_v, total_w);
  if (lo >= hi && !finisher) return;
  RowOutput<kTable, kHasLut, kHasPool> own;
  own.start(in, r, in_share, g.rp[0], g.prefix[0], g.extend[0], table);
  i64 carry_v, carry_w;
  lengths_before<kTable>(in, state, blockIdx.x, flag, lo, carry_v, carry_w);
  if (in_share) {  // the shared arrays hold the share's rows: read back by this thread alone
    voff[threadIdx.x] = carry_v + before_v + inc_v - v;
    woff[threadIdx.x] = carry_w + before_w + inc_w - w;
  }
  const i64 errors = own.finish(in, out, voff, woff, lo);
  if (finisher) finish_plan(out, in.bs, carry_v + total_v, carry_w + total_w, previous);
  warp_add(out.out_of_range_count, errors);
}

// A batch larger than the shared arrays (then plan_entries expands the entries): block b takes
// the rows [b * share, (b + 1) * share), learns the verify and write lengths of all rows before
// them, then scans its own rows in tiles and writes their outputs.  The block of the last row
// finishes the plan.  With a scan state (batches of at least scan_state_min_rows) the lengths
// before a share come from the earlier shares' published totals; without one, or when they do not
// come in time, the block sums every row before its share itself.
template <int kTable, bool kHasLut, bool kHasPool>
__global__ void __launch_bounds__(kPlanThreads, 1) plan_offsets(PlanInputs in, PlanOutputs out) {
  wait_for_prior_grids();
  extern __shared__ i64 smem[];
  const i64 bs = in.bs, tile_rows = scan_tile_rows();
  ScanState* state = bs >= out.scan_state_min_rows ? reinterpret_cast<ScanState*>(out.scan_state) : nullptr;
  i64* voff = smem;
  i64* woff = smem + tile_rows + 1;
  const i64 share = (bs + gridDim.x - 1) / gridDim.x, lo = min(bs, blockIdx.x * share), hi = min(bs, lo + share);
  const bool finisher = bs > 0 ? lo <= bs - 1 && bs - 1 < hi : blockIdx.x == 0;
  const i64 previous = finisher && threadIdx.x == 0 ? *out.write_num_valid_reqs : 0;
  if (hi - lo <= blockDim.x && hi - lo <= tile_rows) {  // a row per thread: one pass
    plan_offsets_one_pass<kTable, kHasLut, kHasPool>(in, out, state, voff, woff, lo, hi, finisher, previous);
    return;
  }
  const unsigned long long flag = state ? own_flag(state, blockIdx.x) : 0;
  if (state) {
    i64 own_v, own_w;
    sum_rows<kTable>(in, lo, hi, own_v, own_w);
    publish_totals(state, blockIdx.x, flag, own_v, own_w);
  }
  i64 errors = 0;
  if (lo < hi || finisher) {
    i64 carry_v, carry_w;
    lengths_before<kTable>(in, state, blockIdx.x, flag, lo, carry_v, carry_w);
    for (i64 tile = lo; tile < hi; tile += tile_rows) {
      const i64 n = min(tile_rows, hi - tile);
      scan_rows<kTable, kScanRowsPerLane>(in, tile, n, voff, woff, carry_v, carry_w);
      errors += write_row_outputs<kTable, kHasLut, kHasPool>(in, out, voff, woff, tile, tile, tile + n);
      __syncthreads();  // the next tile reuses the shared arrays
    }
    if (finisher) finish_plan(out, bs, carry_v, carry_w, previous);
  }
  warp_add(out.out_of_range_count, errors);
}

template <int kTable, bool kHasLut, bool kHasPool>
__global__ void plan_entries(PlanInputs in, PlanOutputs out) {
  wait_for_prior_grids();
  const i64 total = out.verify_offsets[in.bs];
  if (total > 0 && *out.enable != 0) expand_entries<kTable, kHasLut, kHasPool>(in, out, out.verify_offsets, total, StoreEntries{out},
                                                                                     ReloadRows<kTable>{});
}

}  // namespace kvcanary
