// Verify kernel (docs/format.md §4 with the project's out-of-range rules): one thread per entry over a
// fixed grid; the number of active entries is read on the device.
#include "canary_common.cuh"

namespace kvcanary {

template <bool kCheckToken, bool kHasRealKv>
__global__ void canary_verify(CanaryBuffer canary, const i64* __restrict__ slots,
                              const i64* __restrict__ expected_tokens, const i64* __restrict__ expected_positions,
                              const i64* __restrict__ prev_slots, const int* __restrict__ verify_num_valid,
                              const int* __restrict__ enable, i64 verify_capacity, RealKvSources sources,
                              LaunchLog log) {
  const i64 tid = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tid == 0) atomicAdd(log.kernel_run_counters + log.kind, 1ULL);
  if (*enable == 0) return;
  i64 active = *verify_num_valid;
  active = active < 0 ? 0 : (active > verify_capacity ? verify_capacity : active);
  if (tid == 0 && active > 0) atomicAdd(log.slot_run_counters + log.kind, static_cast<unsigned long long>(active));

  i64 errors = 0;
  for (i64 e = tid; e < active; e += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 slot = slots[e];
    if (slot == 0) continue;  // the padding slot
    if (slot < 0 || slot >= canary.num_slots) { ++errors; continue; }
    const i64 prev = prev_slots[e];
    const CanaryRecord rec = load_record(canary, slot);
    u64 expected_chain = static_cast<u64>(rec.prev_hash);  // prev 0: predecessor unknown, no check
    if (prev < 0) {
      expected_chain = kAnchorHash;
    } else if (prev >= canary.num_slots) {
      ++errors;
    } else if (prev > 0) {
      expected_chain = slot_hash(load_record(canary, prev));
    }
    const i64 expected_token = kCheckToken ? expected_tokens[e] : -1;
    i64 bits = 0;
    if (static_cast<u64>(rec.prev_hash) != expected_chain) bits |= kVerifyChainHashMismatch;
    if (rec.position != expected_positions[e]) bits |= kVerifyPositionMismatch;
    const u64 real_kv = kHasRealKv ? real_kv_fold(sources, slot) : 0;
    if (static_cast<u64>(rec.real_kv_hash) != real_kv) bits |= kVerifyRealKvHashMismatch;
    if (kCheckToken && expected_token != -1 && rec.token != expected_token) bits |= kVerifyTokenMismatch;
    if (bits)
      log.record(slot, rec.position, rec.token, expected_token, rec.prev_hash, static_cast<i64>(expected_chain), bits);
  }
  warp_add(log.out_of_range_counters + log.kind, errors);
}

}  // namespace kvcanary
