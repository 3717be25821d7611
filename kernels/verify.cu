// Verify kernel (docs/format.md §4 with the project's out-of-range rules) over a persistent grid; the
// number of active entries is read on the device.
//
// Each warp takes 32 * kItems consecutive entries at a time (item k of lane l is entry
// base + 32 k + l, so every entry-array load is coalesced) and issues all their loads before
// using any.  Consecutive entries of one sequence have prev == the previous entry's slot, whose
// record the neighbouring lane has just loaded: its hash comes by shuffle, and only the first
// entry of a warp step or of a sequence (or an entry whose prev is some other slot) gathers the
// predecessor's record itself.  Several canary buffers verified with one plan (kBuffers > 1)
// share the entry loads; each buffer's records are loaded before any of them is checked.
// check_holes (non-zero): an entry whose slot is the padding slot logs a hole row
// (kVerifyTableHole) instead of being skipped.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kVerifyThreads = 256;

// minBlocks 1: without it ptxas (NVRTC 12.8, sm_80) caps one variant at 64 registers and spills;
// the grid is sized from each variant's occupancy anyway.
template <int kBuffers, bool kCheckToken, bool kHasRealKv>
__global__ void __launch_bounds__(kVerifyThreads, 1)
    canary_verify(const __grid_constant__ CanaryTargets targets, const i64* __restrict__ slots, const i64* __restrict__ expected_tokens,
                  const i64* __restrict__ expected_positions, const i64* __restrict__ prev_slots,
                  const int* __restrict__ verify_num_valid, const int* __restrict__ enable, i64 verify_capacity,
                  LaunchLog log, int check_holes) {
  wait_for_prior_grids();
  constexpr int kItems = kBuffers == 1 ? 2 : 1;  // entries per lane and step: bounds the registers
  const int lane = threadIdx.x & 31;
  const bool first_thread = blockIdx.x == 0 && threadIdx.x == 0;
#pragma unroll
  for (int b = 0; b < kBuffers; ++b)
    if (first_thread) atomicAdd(log.kernel_run_counters + targets.kind[b], 1ULL);
  if (*enable == 0) return;
  i64 active = *verify_num_valid;
  active = active < 0 ? 0 : (active > verify_capacity ? verify_capacity : active);
#pragma unroll
  for (int b = 0; b < kBuffers; ++b)
    if (first_thread && active > 0) atomicAdd(log.slot_run_counters + targets.kind[b], static_cast<unsigned long long>(active));

  const i64 num_slots = targets.canary[0].num_slots;
  const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const i64 step = ((static_cast<i64>(gridDim.x) * blockDim.x) >> 5) * 32 * kItems;
  i64 errors = 0, violations[kBuffers] = {};
  for (i64 base = warp * 32 * kItems; base < active; base += step) {
    i64 slot[kItems], prev[kItems], pos[kItems], token[kItems];
    bool ok[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const i64 e = base + 32 * k + lane;
      const bool in = e < active;
      slot[k] = in ? slots[e] : 0;  // slot 0, the padding slot, is never checked
      prev[k] = in ? prev_slots[e] : 0;
      pos[k] = in ? expected_positions[e] : 0;
      token[k] = kCheckToken && in ? expected_tokens[e] : -1;
      ok[k] = slot[k] > 0 && slot[k] < num_slots;
      errors += verify_entry_errors(slot[k], prev[k], num_slots);
    }
    CanaryRecord rec[kBuffers][kItems];
#pragma unroll
    for (int b = 0; b < kBuffers; ++b)
#pragma unroll
      for (int k = 0; k < kItems; ++k)
        rec[b][k] = ok[k] ? load_record(targets.canary[b], slot[k]) : CanaryRecord{0, 0, 0, 0};
#pragma unroll
    for (int b = 0; b < kBuffers; ++b) {
      // The hash of the previous entry's record: lane l - 1 of the same item, or lane 31 of the
      // previous item for lane 0 (none for lane 0 of item 0).
      u64 from_left[kItems];
      i64 left_slot[kItems];
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        from_left[k] = __shfl_sync(kFullMask, slot_hash(rec[b][k]), (lane + 31) & 31);
        left_slot[k] = __shfl_sync(kFullMask, slot[k], (lane + 31) & 31);
      }
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        const int before = k > 0 ? k - 1 : 0;  // lane 0 of item 0 has no left entry (slot 0 never matches)
        const i64 left = lane > 0 ? left_slot[k] : (k > 0 ? left_slot[before] : 0);
        const u64 left_hash = lane > 0 ? from_left[k] : from_left[before];
        const i64 e = base + 32 * k + lane;
        const bool hole = check_holes && e < active && is_padding_slot(slot[k]);
        violations[b] += check_verify_entry<kCheckToken, kHasRealKv>(targets.canary[b], targets.sources[b], targets.kind[b], log,
                                                                     ok[k], slot[k], rec[b][k], prev[k], prev[k] == left,
                                                                     left_hash, pos[k], token[k], hole, e);
      }
    }
  }
#pragma unroll
  for (int b = 0; b < kBuffers; ++b) {
    warp_add(log.out_of_range_counters + targets.kind[b], errors);
    warp_add(log.violation_counters + targets.kind[b], violations[b]);
  }
}

}  // namespace kvcanary
