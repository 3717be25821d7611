// Write kernel (docs/format.md §4 with the project's out-of-range rules).
//
// One warp per request (warp-stride over the requests counted on the device).  The lanes load 32
// tokens at a time and fingerprint their real KV in parallel; the hash chain, serial by nature,
// is then computed by every lane in lock-step from shuffled values, so each lane knows the
// prev_hash of its own token.  The grid is bounded by the SM count, not by the capacity.
#include "canary_common.cuh"

namespace kvcanary {

// One lane's token of a chunk: slot -1 past the request's range.
template <bool kInputAssert>
struct TokenInputs {
  i64 slot, token, pos, expected_token, expected_pos;

  __device__ __forceinline__ void load(i64 i, i64 end, const i64* input_ids, const i64* positions,
                                       const i64* out_cache_loc, const i64* expected_tokens,
                                       const i64* expected_positions) {
    const bool in_range = i < end;
    slot = in_range ? out_cache_loc[i] : -1;
    token = in_range ? input_ids[i] : 0;
    pos = in_range ? positions[i] : 0;
    expected_token = kInputAssert && in_range ? expected_tokens[i] : 0;
    expected_pos = kInputAssert && in_range ? expected_positions[i] : 0;
  }
};

template <bool kInputAssert, bool kHasRealKv>
__global__ void canary_write(CanaryBuffer canary, const i64* __restrict__ write_offsets,
                             const i64* __restrict__ seeds, const int* __restrict__ write_num_valid_reqs,
                             i64 write_req_capacity, const i64* __restrict__ input_ids,
                             const i64* __restrict__ positions, const i64* __restrict__ out_cache_loc,
                             i64 num_tokens, const i64* __restrict__ expected_tokens,
                             const i64* __restrict__ expected_positions, const int* __restrict__ pos_assert_flag,
                             int pos_assert_value, RealKvSources sources, LaunchLog log) {
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(log.kernel_run_counters + log.kind, 1ULL);
  i64 num_reqs = *write_num_valid_reqs;
  num_reqs = num_reqs < 0 ? 0 : (num_reqs > write_req_capacity ? write_req_capacity : num_reqs);
  const bool pos_assert_on = pos_assert_flag ? *pos_assert_flag != 0 : pos_assert_value != 0;
  const int lane = threadIdx.x & 31;
  const unsigned full = 0xffffffffu;
  i64 written = 0, errors = 0;

  for (i64 r = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < num_reqs;
       r += (static_cast<i64>(gridDim.x) * blockDim.x) >> 5) {
    const i64 start_raw = write_offsets[r], end_raw = write_offsets[r + 1];
    const i64 start = start_raw < 0 ? 0 : (start_raw > num_tokens ? num_tokens : start_raw);
    const i64 end = end_raw < start ? start : (end_raw > num_tokens ? num_tokens : end_raw);
    const i64 seed = seeds[r];
    if (lane == 0) {
      errors += start_raw < 0 || start_raw > num_tokens || end_raw < start_raw || end_raw > num_tokens;
      errors += seed >= canary.num_slots;
    }
    if (start == end) continue;
    const bool seed_ok = seed > 0 && seed < canary.num_slots;  // seed 0 (padding slot) = no predecessor
    u64 chain = kAnchorHash;
    i64 running_pos = 0;
    if (seed_ok) {
      const CanaryRecord rec = load_record(canary, seed);
      chain = slot_hash(rec);
      running_pos = rec.position;
    }
    const bool check_pos = seed_ok && pos_assert_on;

    // Token and position are loaded with the slot, not after it, and each chunk's loads are issued
    // before the previous chunk's hash chain runs: a prefill waits on memory once, not per chunk.
    TokenInputs<kInputAssert> next;
    next.load(start + lane, end, input_ids, positions, out_cache_loc, expected_tokens, expected_positions);
    for (i64 chunk = start; chunk < end; chunk += 32) {
      const i64 i = chunk + lane;
      const TokenInputs<kInputAssert> cur = next;
      next.load(i + 32, end, input_ids, positions, out_cache_loc, expected_tokens, expected_positions);
      const i64 slot = cur.slot, token = cur.token, pos = cur.pos;
      errors += slot >= canary.num_slots;
      const bool valid = slot >= 0 && slot < canary.num_slots;
      u64 real_kv = 0;
      if (kHasRealKv && valid && slot != 0) real_kv = real_kv_fold(sources, slot);
      // The chain, in token order, computed identically by every lane.
      const unsigned valid_mask = __ballot_sync(full, valid);
      u64 my_chain = 0;
      i64 my_expected_pos = 0;
      if (valid_mask == full) {  // a full chunk: unrolled, the shuffles run ahead of the hash chain
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const i64 tj = __shfl_sync(full, token, j), pj = __shfl_sync(full, pos, j);
          if (lane == j) { my_chain = chain; my_expected_pos = running_pos + 1; }
          chain = mix3(chain, static_cast<u64>(tj), static_cast<u64>(pj));
          if (check_pos) running_pos = pj;
        }
      } else {
        for (unsigned m = valid_mask; m; m &= m - 1) {
          const int j = __ffs(m) - 1;
          const i64 tj = __shfl_sync(full, token, j), pj = __shfl_sync(full, pos, j);
          if (lane == j) { my_chain = chain; my_expected_pos = running_pos + 1; }
          chain = mix3(chain, static_cast<u64>(tj), static_cast<u64>(pj));
          if (check_pos) running_pos = pj;
        }
      }
      if (valid) {
        if (kInputAssert) {
          const i64 want_token = cur.expected_token, want_pos = cur.expected_pos;
          const i64 bits = (token != want_token ? kWriteTokenMismatch : 0) | (pos != want_pos ? kWritePositionMismatch : 0);
          if (bits) log.record(slot, pos, token, want_token, static_cast<i64>(my_chain), want_pos, bits);
        }
        if (check_pos && pos != my_expected_pos)
          log.record(slot, pos, token, token, static_cast<i64>(my_chain), my_expected_pos, kWritePositionMismatch);
        // A slot written twice in one chunk keeps its last token's record, as a serial walk would;
        // the padding slot 0 keeps its bytes (padded tokens of many requests land there at once).
        const unsigned peers = __match_any_sync(valid_mask, slot);
        if (slot != 0 && lane == 31 - __clz(peers))
          store_record(canary, slot, CanaryRecord{token, pos, static_cast<i64>(my_chain), static_cast<i64>(real_kv)});
        ++written;
      }
      __syncwarp();  // orders this chunk's stores before the next chunk's
    }
  }
  warp_add(log.slot_run_counters + log.kind, written);
  warp_add(log.out_of_range_counters + log.kind, errors);
}

}  // namespace kvcanary
