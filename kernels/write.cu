// Write kernel (docs/format.md §4 with the project's out-of-range rules).
//
// Warp w takes requests w, w + W, w + 2W, ... (W warps in the grid), one per lane, so a batch of
// fewer requests than warps spreads one request per warp.  A request that writes at most one
// token (a decode step) is written by its own lane: the lanes of a warp run 32 such requests at
// once.  A longer request is then written by the whole warp: the lanes load 32 tokens at a time
// and fingerprint their real KV in parallel; the hash chain, serial by nature, is computed by
// every lane in lock-step from shuffled values, so each lane knows the prev_hash of its own token.
// With several canary buffers (kBuffers > 1, one plan for e.g. the K and V halves) the token
// inputs are loaded once and the buffers' independent chains are interleaved in one thread: the
// chain is latency-bound, so a second chain fills the first one's stalls.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kWriteThreads = 128;

// One lane's token: slot -1 past the request's range.
template <bool kInputAssert>
struct TokenInputs {
  i64 slot, token, pos, expected_token, expected_pos;

  __device__ __forceinline__ void load(i64 i, i64 end, const i64* input_ids, const i64* positions,
                                       const i64* out_cache_loc, const i64* expected_tokens,
                                       const i64* expected_positions) {
    const bool in_range = i < end;
    slot = in_range ? __ldg(out_cache_loc + i) : -1;  // the inputs are read-only for the whole launch
    token = in_range ? __ldg(input_ids + i) : 0;
    pos = in_range ? __ldg(positions + i) : 0;
    expected_token = kInputAssert && in_range ? __ldg(expected_tokens + i) : 0;
    expected_pos = kInputAssert && in_range ? __ldg(expected_positions + i) : 0;
  }
};

// Everything a write reads besides the canary buffers (mirrored by WRITE_INPUTS in cupy_backend.py).
struct WriteInputs {
  const i64* write_offsets;  // [write_req_capacity + 1]
  const i64* seeds;  // [write_req_capacity]
  const int* write_num_valid_reqs;
  const i64* input_ids;  // [num_tokens]
  const i64* positions;
  const i64* out_cache_loc;
  const i64* expected_tokens;  // null without the write-input assert
  const i64* expected_positions;
  const int* pos_assert_flag;  // null: pos_assert_value decides
  i64 write_req_capacity, num_tokens;
  int pos_assert_value;
};

// The chain state of one request in one buffer, continued from its seed record.
struct ChainState {
  u64 chain;
  i64 running_pos;
};

template <int kBuffers>
__device__ __forceinline__ void seed_chains(const CanaryTargets& t, bool seed_ok, i64 seed, ChainState (&s)[kBuffers]) {
  CanaryRecord rec[kBuffers];
#pragma unroll
  for (int b = 0; b < kBuffers; ++b) rec[b] = seed_ok ? load_record(t.canary[b], seed) : CanaryRecord{0, 0, 0, 0};
#pragma unroll
  for (int b = 0; b < kBuffers; ++b) s[b] = seed_ok ? ChainState{slot_hash(rec[b]), rec[b].position} : ChainState{kAnchorHash, 0};
}

// The real-KV fingerprint of a token's slot in every buffer (0 when not stored), loaded before
// the chain runs so its memory latency overlaps the chain.
template <int kBuffers, bool kHasRealKv>
__device__ __forceinline__ void fingerprints(const CanaryTargets& t, bool store, i64 slot, u64 (&real_kv)[kBuffers]) {
#pragma unroll
  for (int b = 0; b < kBuffers; ++b) real_kv[b] = kHasRealKv && store ? real_kv_fold(t.sources[b], slot) : 0;
}

// The rows and the record of one token in buffer b: `token_chain` is its prev_hash and
// `expected_pos` what the chain-position assert wants.  Every lane calls it (converged).
template <bool kInputAssert>
__device__ __forceinline__ void finish_token(const CanaryTargets& t, int b, const LaunchLog& log, bool valid,
                                             bool check_pos, bool store, const TokenInputs<kInputAssert>& in,
                                             u64 token_chain, i64 expected_pos, u64 real_kv, i64& violations) {
  const int kind = t.kind[b];
  if (kInputAssert) {
    const i64 bits = (in.token != in.expected_token ? kWriteTokenMismatch : 0) |
                     (in.pos != in.expected_pos ? kWritePositionMismatch : 0);
    const bool hit = valid && bits != 0;
    violations += hit;
    log.append_rows(hit, kind, in.slot, in.pos, in.token, in.expected_token, static_cast<i64>(token_chain),
                    in.expected_pos, bits);
  }
  const bool hit = valid && check_pos && in.pos != expected_pos;
  violations += hit;
  log.append_rows(hit, kind, in.slot, in.pos, in.token, in.token, static_cast<i64>(token_chain), expected_pos,
                  kWritePositionMismatch);
  if (store)
    store_record(t.canary[b], in.slot, CanaryRecord{in.token, in.pos, static_cast<i64>(token_chain), static_cast<i64>(real_kv)});
}

template <int kBuffers, bool kInputAssert, bool kHasRealKv>
__global__ void canary_write(const __grid_constant__ CanaryTargets t, WriteInputs in, LaunchLog log) {
  const bool first_thread = blockIdx.x == 0 && threadIdx.x == 0;
#pragma unroll
  for (int b = 0; b < kBuffers; ++b)
    if (first_thread) atomicAdd(log.kernel_run_counters + t.kind[b], 1ULL);
  i64 num_reqs = *in.write_num_valid_reqs;
  num_reqs = num_reqs < 0 ? 0 : (num_reqs > in.write_req_capacity ? in.write_req_capacity : num_reqs);
  const bool pos_assert_on = in.pos_assert_flag ? *in.pos_assert_flag != 0 : in.pos_assert_value != 0;
  const i64 num_slots = t.canary[0].num_slots, num_tokens = in.num_tokens;
  const int lane = threadIdx.x & 31;
  const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const i64 num_warps = (static_cast<i64>(gridDim.x) * blockDim.x) >> 5;
  i64 written = 0, errors = 0, violations[kBuffers] = {};

  for (i64 first = warp; first < num_reqs; first += 32 * num_warps) {
    // This lane's request: its clamped token range and seed (each out-of-range value counts once).
    const i64 r = first + lane * num_warps;
    const bool have = r < num_reqs;
    const i64 start_raw = have ? in.write_offsets[r] : 0, end_raw = have ? in.write_offsets[r + 1] : 0;
    const i64 seed = have ? in.seeds[r] : -1;
    const i64 start = start_raw < 0 ? 0 : (start_raw > num_tokens ? num_tokens : start_raw);
    const i64 end = end_raw < start ? start : (end_raw > num_tokens ? num_tokens : end_raw);
    errors += start_raw < 0 || start_raw > num_tokens || end_raw < start_raw || end_raw > num_tokens;
    errors += seed >= num_slots;
    const bool seed_ok = seed > 0 && seed < num_slots;  // seed 0 (padding slot) = no predecessor
    const bool check_pos = seed_ok && pos_assert_on;

    // Requests of one token: a lane each.
    {
      const bool single = end - start == 1;
      TokenInputs<kInputAssert> tok;
      tok.load(single ? start : 0, single ? end : 0, in.input_ids, in.positions, in.out_cache_loc,
               in.expected_tokens, in.expected_positions);
      ChainState s[kBuffers];
      seed_chains<kBuffers>(t, seed_ok && single, seed, s);
      errors += tok.slot >= num_slots;
      const bool valid = tok.slot >= 0 && tok.slot < num_slots, store = valid && tok.slot != 0;
      u64 real_kv[kBuffers];
      fingerprints<kBuffers, kHasRealKv>(t, store, tok.slot, real_kv);
#pragma unroll
      for (int b = 0; b < kBuffers; ++b)
        finish_token<kInputAssert>(t, b, log, valid, check_pos, store, tok, s[b].chain, s[b].running_pos + 1,
                                   real_kv[b], violations[b]);
      written += valid;
    }

    // Longer requests: the whole warp, one request after the other.
    for (unsigned long_reqs = __ballot_sync(kFullMask, end - start > 1); long_reqs; long_reqs &= long_reqs - 1) {
      const int owner = __ffs(long_reqs) - 1;
      const i64 req_start = __shfl_sync(kFullMask, start, owner), req_end = __shfl_sync(kFullMask, end, owner);
      const i64 req_seed = __shfl_sync(kFullMask, seed, owner);
      const bool req_seed_ok = req_seed > 0 && req_seed < num_slots;
      const bool req_check_pos = req_seed_ok && pos_assert_on;
      ChainState s[kBuffers];
      seed_chains<kBuffers>(t, req_seed_ok, req_seed, s);

      // Token and position are loaded with the slot, and each chunk's loads are issued before
      // the previous chunk's hash chain runs: a prefill waits on memory once, not per chunk.
      TokenInputs<kInputAssert> next;
      next.load(req_start + lane, req_end, in.input_ids, in.positions, in.out_cache_loc, in.expected_tokens,
                in.expected_positions);
      for (i64 chunk = req_start; chunk < req_end; chunk += 32) {
        const TokenInputs<kInputAssert> cur = next;
        next.load(chunk + 32 + lane, req_end, in.input_ids, in.positions, in.out_cache_loc, in.expected_tokens,
                  in.expected_positions);
        errors += cur.slot >= num_slots;
        const bool valid = cur.slot >= 0 && cur.slot < num_slots;
        u64 real_kv[kBuffers];
        fingerprints<kBuffers, kHasRealKv>(t, valid && cur.slot != 0, cur.slot, real_kv);
        // The chains, in token order, computed identically by every lane.
        const unsigned valid_mask = __ballot_sync(kFullMask, valid);
        ChainState mine[kBuffers];  // the state before this lane's token
        if (valid_mask == kFullMask) {  // a full chunk: unrolled, the shuffles run ahead of the chains
#pragma unroll 8
          for (int j = 0; j < 32; ++j) {
            const i64 tj = __shfl_sync(kFullMask, cur.token, j), pj = __shfl_sync(kFullMask, cur.pos, j);
#pragma unroll
            for (int b = 0; b < kBuffers; ++b) {
              if (lane == j) mine[b] = s[b];
              s[b].chain = mix3(s[b].chain, static_cast<u64>(tj), static_cast<u64>(pj));
              if (req_check_pos) s[b].running_pos = pj;
            }
          }
        } else {
          for (unsigned m = valid_mask; m; m &= m - 1) {
            const int j = __ffs(m) - 1;
            const i64 tj = __shfl_sync(kFullMask, cur.token, j), pj = __shfl_sync(kFullMask, cur.pos, j);
#pragma unroll
            for (int b = 0; b < kBuffers; ++b) {
              if (lane == j) mine[b] = s[b];
              s[b].chain = mix3(s[b].chain, static_cast<u64>(tj), static_cast<u64>(pj));
              if (req_check_pos) s[b].running_pos = pj;
            }
          }
        }
        // A slot written twice in one chunk keeps its last token's record, as a serial walk would;
        // the padding slot 0 keeps its bytes (padded tokens of many requests land there at once).
        bool store = false;
        if (valid) {
          const unsigned peers = __match_any_sync(valid_mask, cur.slot);
          store = cur.slot != 0 && lane == 31 - __clz(peers);
        }
#pragma unroll
        for (int b = 0; b < kBuffers; ++b)
          finish_token<kInputAssert>(t, b, log, valid, req_check_pos, store, cur, mine[b].chain,
                                     mine[b].running_pos + 1, real_kv[b], violations[b]);
        written += valid;
        __syncwarp();  // orders this chunk's stores before the next chunk's
      }
    }
  }
#pragma unroll
  for (int b = 0; b < kBuffers; ++b) {
    warp_add(log.slot_run_counters + t.kind[b], written);
    warp_add(log.out_of_range_counters + t.kind[b], errors);
    warp_add(log.violation_counters + t.kind[b], violations[b]);
  }
}

}  // namespace kvcanary
