// Coverage past the 32-byte record (docs/format.md section 9): the deep fingerprint of every
// layer's KV bytes, kept in field 4 of the TAIL buffer's rows, its rotating check, and the
// lost-store check (a slot the forward should have written whose bytes did not change).
//
// The sources come as an int64 table in device memory (kvcanary_cupy/coverage.py packs it once),
// so a canary may fingerprint any number of them.  One warp per slot: its lanes fold sources
// lane, lane + 32, ... (each source's fold is serial, docs/format.md section 3) and every lane
// then combines the per-source hashes in source order from shuffles, so all lanes hold the result.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kCoverageThreads = 256;
constexpr int kSourceFields = 12;  // SOURCE_FIELDS in kvcanary_cupy/coverage.py
constexpr int kDeepField = 4;  // the TAIL record's field holding the deep fingerprint

// A table row: data, row_stride, token_stride, byte_offset, stride0, stride1, inner, page_size,
// nbytes, piece_bytes, unit, slot_offset.  The host checked every source covers every canary slot
// from its slot_offset on; a slot below it has no KV bytes there and folds as 0 (source_fold's rule).
__device__ __forceinline__ u64 table_fold(const i64* table, int j, i64 slot) {
  const i64* r = table + static_cast<i64>(j) * kSourceFields;
  const i64 page = r[7], pool_slot = slot - r[11];
  if (pool_slot < 0) return 0;
  const unsigned char* token =
      reinterpret_cast<const unsigned char*>(r[0]) + (pool_slot / page) * r[1] + r[3] + (pool_slot % page) * r[2];
  const StreamLayout l{r[4], r[5], static_cast<int>(r[6]), static_cast<int>(r[9]), static_cast<int>(r[10]),
                       static_cast<int>(r[8])};
  return fold_stream(token, l);
}

// The per-source hashes of one slot, lane-strided: every lane of the warp calls it (converged)
// and gets the fold of all of them in source order.  0 is stored as 1: 0 marks a slot never
// fingerprinted.
__device__ __forceinline__ u64 warp_deep_fold(const i64* table, int num_sources, i64 slot, bool valid) {
  const int lane = threadIdx.x & 31;
  u64 acc = 0;
  for (int base = 0; base < num_sources; base += 32) {
    const int j = base + lane;
    const u64 h = valid && j < num_sources ? table_fold(table, j, slot) : 0;
    const int count = num_sources - base < 32 ? num_sources - base : 32;
    for (int t = 0; t < count; ++t) acc = splitmix64(acc ^ __shfl_sync(kFullMask, h, t));
  }
  return acc == 0 ? 1 : acc;
}

// The deep fingerprint of each written slot (0 < slot < num_slots; others are the write's to count).
__global__ void deep_write(const i64* __restrict__ table, int num_sources, const i64* __restrict__ slots, i64 num_tokens,
                           i64* canary, i64 num_slots, int fields) {
  wait_for_prior_grids();
  const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const i64 num_warps = (static_cast<i64>(gridDim.x) * blockDim.x) >> 5;
  for (i64 i = warp; i < num_tokens; i += num_warps) {
    const i64 slot = slots[i];
    const bool valid = slot > 0 && slot < num_slots;
    if (!valid) continue;  // uniform across the warp
    const u64 deep = warp_deep_fold(table, num_sources, slot, true);
    if ((threadIdx.x & 31) == 0) canary[slot * fields + kDeepField] = static_cast<i64>(deep);
  }
}

// Re-fingerprints slots 1 + (cursor + k) % (num_slots - 1), k < per_step, whose deep field is
// set, and logs a row for each that changed.  The last block to finish advances the cursor
// (state[0]) by per_step; state[1] counts finished blocks and is back at 0 after the launch.
__global__ void deep_check(const i64* __restrict__ table, int num_sources, const i64* canary, i64 num_slots, int fields,
                           i64 per_step, unsigned long long* state, LaunchLog log, int kind) {
  wait_for_prior_grids();
  const i64 ring = num_slots - 1;
  const i64 start = static_cast<i64>(state[0]);
  const int lane = threadIdx.x & 31;
  const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const i64 num_warps = (static_cast<i64>(gridDim.x) * blockDim.x) >> 5;
  i64 violations = 0;
  for (i64 k = warp; k < per_step; k += num_warps) {
    const i64 slot = 1 + (start + k) % ring;
    const i64* row = canary + slot * fields;
    const u64 stored = static_cast<u64>(row[kDeepField]);
    if (stored == 0) continue;  // never fingerprinted (uniform across the warp)
    const u64 now = warp_deep_fold(table, num_sources, slot, true);
    const bool hit = lane == 0 && now != stored;
    violations += hit;
    log.append_rows(hit, kind, slot, row[1], row[0], -1, static_cast<i64>(stored), static_cast<i64>(now),
                    kVerifyDeepKvMismatch);
  }
  warp_add(log.violation_counters + kind, violations);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(state + 1, 1ULL) == gridDim.x - 1) {
      state[0] = static_cast<unsigned long long>((start + per_step) % ring);
      state[1] = 0;
      __threadfence();
    }
  }
}

// Before the forward: the per-source hashes of each token's slot, pre[i * num_sources + j]
// (0 for a token whose slot is outside (0, num_slots)).
__global__ void lost_snapshot(const i64* __restrict__ table, int num_sources, const i64* __restrict__ slots,
                              i64 num_tokens, i64 num_slots, i64* pre) {
  wait_for_prior_grids();
  const i64 total = num_tokens * num_sources;
  const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
  for (i64 e = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const i64 i = e / num_sources;
    const int j = static_cast<int>(e - i * num_sources);
    const i64 slot = slots[i];
    pre[e] = slot > 0 && slot < num_slots ? static_cast<i64>(table_fold(table, j, slot)) : 0;
  }
}

// After the forward, before the TAIL write: a token whose slot's bytes are unchanged in some
// source, while the TAIL record there (the slot's previous owner) differs from the HEAD record
// this step wrote (same token, position and chain would make identical bytes legitimate), is a
// store that did not happen.  Its row names the first unchanged source in column 6.  The
// `unchecked` tokens past the snapshot's capacity are counted as out of range.
__global__ void lost_check(const i64* __restrict__ table, int num_sources, const i64* __restrict__ slots, i64 num_tokens,
                           i64 unchecked, const i64* __restrict__ pre, const i64* head, int head_fields, const i64* tail,
                           int tail_fields, i64 num_slots, LaunchLog log, int kind) {
  wait_for_prior_grids();
  if (blockIdx.x == 0 && threadIdx.x == 0 && unchecked > 0)
    atomicAdd(log.out_of_range_counters + kind, static_cast<unsigned long long>(unchecked));
  const int lane = threadIdx.x & 31;
  const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const i64 num_warps = (static_cast<i64>(gridDim.x) * blockDim.x) >> 5;
  i64 violations = 0;
  for (i64 i = warp; i < num_tokens; i += num_warps) {
    const i64 slot = slots[i];
    if (!(slot > 0 && slot < num_slots)) continue;  // uniform across the warp
    const i64* h = head + slot * head_fields;
    const i64* t = tail + slot * tail_fields;
    const bool same_record = h[0] == t[0] && h[1] == t[1] && h[2] == t[2];
    int first = num_sources;  // every source is folded even for a same record: the check's cost does not depend on the data
    for (int base = 0; base < num_sources; base += 32) {
      const int j = base + lane;
      const bool unchanged = j < num_sources && static_cast<i64>(table_fold(table, j, slot)) == pre[i * num_sources + j];
      const unsigned mask = __ballot_sync(kFullMask, unchanged);
      if (mask) {
        first = base + __ffs(mask) - 1;
        break;
      }
    }
    const bool hit = lane == 0 && first < num_sources && !same_record;
    violations += hit;
    log.append_rows(hit, kind, slot, h[1], t[0], h[0], t[2], first, kWriteKvNotStored);
  }
  warp_add(log.violation_counters + kind, violations);
}

}  // namespace kvcanary
