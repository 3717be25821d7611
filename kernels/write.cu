// Write kernel (docs/format.md §4 with the project's out-of-range rules).
//
// Each warp writes one canary buffer: with several buffers (kBuffers > 1, one plan for e.g. the K
// and V halves) warps b, b + kBuffers, ... write buffer b, so the buffers' serial hash chains run
// on different warp schedulers at once.  (One thread interleaving two chains gains nothing: a
// chain is bound by the integer pipes' issue rate as much as by latency.)
//
// The warps of one buffer share the requests: a pass gives each lane one request, consecutive
// requests to the lanes of a warp when the grid has at most one warp per 16 requests (coalesced
// loads), else requests w, w + W, w + 2W, ... to warp w (W warps), so a batch of fewer requests
// than warps spreads one request per warp.  A request that writes at most one token (a decode
// step) is written by its own lane.  Its loads do not wait on one another: the offsets, the seed
// and token r (request r's token in a decode step, used when its range is [r, r + 1)) are loaded
// before the batch size arrives, and the seed's record as soon as the seed does.
//
// A longer request is then written by the whole warp: the lanes load 32 tokens at a time and
// fingerprint their real KV in parallel; the hash chain, serial by nature, is computed by every
// lane in lock-step from the chunk's tokens staged in shared memory (one broadcast load per
// token), and the chain value before each token is left there for that token's lane.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kWriteThreads = 128;
constexpr int kWriteWarps = kWriteThreads / 32;

// Element i of an int64 (is_int64) or int32 array, read through the read-only data cache.
__device__ __forceinline__ i64 ldg_index(const void* p, int is_int64, i64 i) {
  return is_int64 ? __ldg(static_cast<const i64*>(p) + i) : static_cast<i64>(__ldg(static_cast<const int*>(p) + i));
}

// One lane's token: slot -1 past the request's range.
template <bool kInputAssert>
struct TokenInputs {
  i64 slot, token, pos, expected_token, expected_pos;

  __device__ __forceinline__ void load(i64 i, i64 end, const void* input_ids, const void* positions,
                                       const void* out_cache_loc, int wide, const i64* expected_tokens,
                                       const i64* expected_positions) {
    const bool in_range = i < end;
    // the inputs are read-only for the whole launch; bit k of `wide`: input k is int64 (else int32)
    slot = in_range ? ldg_index(out_cache_loc, wide & 4, i) : -1;
    token = in_range ? ldg_index(input_ids, wide & 1, i) : 0;
    pos = in_range ? ldg_index(positions, wide & 2, i) : 0;
    expected_token = kInputAssert && in_range ? __ldg(expected_tokens + i) : 0;
    expected_pos = kInputAssert && in_range ? __ldg(expected_positions + i) : 0;
  }
};

// Everything a write reads besides the canary buffers (mirrored by WRITE_INPUTS in cupy_backend.py).
struct WriteInputs {
  const i64* write_offsets;  // [write_req_capacity + 1]
  const i64* seeds;  // [write_req_capacity]
  const int* write_num_valid_reqs;
  const void* input_ids;  // [num_tokens], int64 or int32 (input_widths says which)
  const void* positions;
  const void* out_cache_loc;
  const i64* expected_tokens;  // null without the write-input assert
  const i64* expected_positions;
  const int* pos_assert_flag;  // null: pos_assert_value decides
  const int* write_waves;  // [write_req_capacity]: each request's write wave; null: every request is in this one
  i64 write_req_capacity, num_tokens;
  int pos_assert_value;
  int input_widths;  // bit 0: input_ids int64, bit 1: positions, bit 2: out_cache_loc (else int32)
  int wave;  // this launch's wave: a request of another wave (write_waves) is not written by it

  template <bool kInputAssert>
  __device__ __forceinline__ void load_token(TokenInputs<kInputAssert>& tok, i64 i, i64 end) const {
    tok.load(i, end, input_ids, positions, out_cache_loc, input_widths, expected_tokens, expected_positions);
  }
};

// The rows and the record of one token: `token_chain` is its prev_hash and `expected_pos` what
// the chain-position assert wants.  Every lane calls it (converged).
template <bool kInputAssert>
__device__ __forceinline__ void finish_token(const CanaryBuffer& canary, int kind, const LaunchLog& log, bool valid,
                                             bool check_pos, bool store, const TokenInputs<kInputAssert>& in,
                                             u64 token_chain, i64 expected_pos, u64 real_kv, i64& violations) {
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
    store_record(canary, in.slot, CanaryRecord{in.token, in.pos, static_cast<i64>(token_chain), static_cast<i64>(real_kv)});
}

template <int kBuffers, bool kInputAssert, bool kHasRealKv>
__global__ void canary_write(const __grid_constant__ CanaryTargets t, WriteInputs in, LaunchLog log) {
  wait_for_prior_grids();
  // Per warp: a chunk's {token, position} for the chain, and the chain value before each token.
  __shared__ longlong2 staged[kWriteWarps][32];
  __shared__ u64 chains[kWriteWarps][32];
  if (blockIdx.x == 0 && threadIdx.x == 0)
    for (int b = 0; b < kBuffers; ++b) atomicAdd(log.kernel_run_counters + t.kind[b], 1ULL);
  const int lane = threadIdx.x & 31, block_warp = threadIdx.x >> 5;
  const i64 grid_warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int buffer = static_cast<int>(grid_warp % kBuffers);
  const i64 warp = grid_warp / kBuffers, num_warps = ((static_cast<i64>(gridDim.x) * blockDim.x) >> 5) / kBuffers;
  if (warp >= num_warps) return;  // the grid's last few warps when kBuffers does not divide it
  const CanaryBuffer& canary = t.canary[buffer];
  const int kind = t.kind[buffer];
  const int num_valid = *in.write_num_valid_reqs;
  const bool pos_assert_on = in.pos_assert_flag ? *in.pos_assert_flag != 0 : in.pos_assert_value != 0;
  const i64 capacity = in.write_req_capacity, num_slots = canary.num_slots, num_tokens = in.num_tokens;
  const bool consecutive = 16 * num_warps <= capacity;  // at least 16 requests per warp
  const i64 lane_request = consecutive ? 32 * warp + lane : warp + lane * num_warps;
  i64 written = 0, errors = 0, violations = 0;

  for (i64 pass = 0; pass < capacity; pass += 32 * num_warps) {
    // Every index below the capacity is in bounds: load before the batch size is known.
    const i64 r = pass + lane_request;
    const bool in_capacity = r < capacity;
    i64 start_raw = in_capacity ? in.write_offsets[r] : 0, end_raw = in_capacity ? in.write_offsets[r + 1] : 0;
    i64 seed = in_capacity ? in.seeds[r] : -1;
    const bool other_wave = in_capacity && in.write_waves && in.write_waves[r] != in.wave;
    TokenInputs<kInputAssert> tok;
    in.load_token(tok, r, num_tokens);  // a decode step's token, if the range turns out [r, r + 1)
    const CanaryRecord seed_record = seed > 0 && seed < num_slots ? load_record(canary, seed) : CanaryRecord{0, 0, 0, 0};
    const i64 num_reqs = num_valid < 0 ? 0 : (num_valid > capacity ? capacity : num_valid);
    if (pass >= num_reqs) break;

    // This lane's request: its clamped token range and seed (each out-of-range value counts once);
    // a request of another wave is written by that wave's launch (every seed keeps SGLang's meaning).
    if (r >= num_reqs || other_wave) start_raw = end_raw = 0, seed = -1;
    const i64 start = start_raw < 0 ? 0 : (start_raw > num_tokens ? num_tokens : start_raw);
    const i64 end = end_raw < start ? start : (end_raw > num_tokens ? num_tokens : end_raw);
    errors += start_raw < 0 || start_raw > num_tokens || end_raw < start_raw || end_raw > num_tokens;
    errors += seed >= num_slots;
    const bool seed_ok = seed > 0 && seed < num_slots;  // seed 0 (padding slot) = no predecessor
    const bool check_pos = seed_ok && pos_assert_on;
    const u64 seed_chain = seed_ok ? slot_hash(seed_record) : kAnchorHash;
    const i64 seed_pos = seed_ok ? seed_record.position : 0;

    // Requests of one token: a lane each.
    {
      const bool single = end - start == 1;
      if (!single) tok.slot = -1;
      else if (start != r) in.load_token(tok, start, end);  // the speculative load missed
      errors += tok.slot >= num_slots;
      const bool valid = tok.slot >= 0 && tok.slot < num_slots, store = valid && tok.slot != 0;
      const u64 real_kv = kHasRealKv && store ? real_kv_fold(t.sources[buffer], tok.slot) : 0;
      finish_token<kInputAssert>(canary, kind, log, valid, check_pos, store, tok, seed_chain, seed_pos + 1, real_kv,
                                 violations);
      written += valid;
    }

    // Longer requests: the whole warp, one request after the other.
    for (unsigned long_reqs = __ballot_sync(kFullMask, end - start > 1); long_reqs; long_reqs &= long_reqs - 1) {
      const int owner = __ffs(long_reqs) - 1;
      const i64 req_start = __shfl_sync(kFullMask, start, owner), req_end = __shfl_sync(kFullMask, end, owner);
      const bool req_check_pos = __shfl_sync(kFullMask, static_cast<int>(check_pos), owner) != 0;
      u64 chain = __shfl_sync(kFullMask, seed_chain, owner);
      i64 running_pos = __shfl_sync(kFullMask, seed_pos, owner);  // the last chained token's position

      // Each chunk's loads are issued before the previous chunk's hash chain runs: a prefill
      // waits on memory once, not per chunk.
      TokenInputs<kInputAssert> next;
      in.load_token(next, req_start + lane, req_end);
      for (i64 chunk = req_start; chunk < req_end; chunk += 32) {
        const TokenInputs<kInputAssert> cur = next;
        in.load_token(next, chunk + 32 + lane, req_end);
        errors += cur.slot >= num_slots;
        const bool valid = cur.slot >= 0 && cur.slot < num_slots;
        const unsigned valid_mask = __ballot_sync(kFullMask, valid);
        // A slot written twice in one chunk keeps its last token's record, as a serial walk would;
        // the padding slot 0 keeps its bytes (padded tokens of many requests land there at once).
        // The match runs on the whole warp (an invalid lane matches no one: its key is negative
        // and its own) and is read after the chain, whose run hides its latency.
        const unsigned peers = __match_any_sync(kFullMask, valid ? cur.slot : -1 - lane);
        const u64 real_kv = kHasRealKv && valid && cur.slot != 0 ? real_kv_fold(t.sources[buffer], cur.slot) : 0;
        staged[block_warp][lane] = make_longlong2(cur.token, cur.pos);
        __syncwarp();
        // The chain over the chunk's valid tokens in order, computed identically by every lane.
        if (valid_mask == kFullMask) {
#pragma unroll 8
          for (int j = 0; j < 32; ++j) {
            const longlong2 tp = staged[block_warp][j];
            chains[block_warp][j] = chain;
            chain = mix3(chain, static_cast<u64>(tp.x), static_cast<u64>(tp.y));
          }
        } else {
          for (unsigned m = valid_mask; m; m &= m - 1) {
            const int j = __ffs(m) - 1;
            const longlong2 tp = staged[block_warp][j];
            chains[block_warp][j] = chain;
            chain = mix3(chain, static_cast<u64>(tp.x), static_cast<u64>(tp.y));
          }
        }
        __syncwarp();
        const unsigned earlier = valid_mask & ((1u << lane) - 1u);
        const i64 expected_pos = (earlier ? staged[block_warp][31 - __clz(earlier)].y : running_pos) + 1;
        if (valid_mask) running_pos = staged[block_warp][31 - __clz(valid_mask)].y;
        const bool store = valid && cur.slot != 0 && lane == 31 - __clz(peers);
        finish_token<kInputAssert>(canary, kind, log, valid, req_check_pos, store, cur, chains[block_warp][lane],
                                   expected_pos, real_kv, violations);
        written += valid;
        __syncwarp();  // orders this chunk's stores and shared reads before the next chunk's
      }
    }
  }
  warp_add(log.slot_run_counters + kind, written);
  warp_add(log.out_of_range_counters + kind, errors);
  warp_add(log.violation_counters + kind, violations);
}

}  // namespace kvcanary
