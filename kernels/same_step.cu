// Same-step reads (kvcanary_cupy/same_step.py, whose NumPy code is the reference): entries that
// read a slot this step writes are verified as written, and requests whose seed this step writes
// are deferred to a later write wave (write_waves: each request's wave, which the write launch of
// that wave alone writes; the seeds are never changed).  Four launches in stream order:
// same_step_begin (the stamp), same_step_mark (per request, its tokens' slots), same_step_entries
// (per verify entry) and same_step_seeds (per request row: its wave).
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kStampShift = 32;
constexpr i64 kTokenMask = (i64{1} << kStampShift) - 1;

struct SameStepArgs {
  unsigned long long* written_at;  // [num_slots]
  int* write_waves;                // [cap]: each request's write wave, -1 past the batch
  unsigned long long* counters;    // [3]: stamp, verified as written, deeper than the waves
  i64* verify_slots;
  const i64* verify_tokens;
  const i64* verify_positions;
  const i64* verify_prev;
  const int* verify_num_valid;
  const int* enable;
  const i64* write_offsets;
  const i64* seeds;
  const int* write_num_valid_reqs;
  const i64* input_ids;
  const i64* positions;
  const i64* out_cache_loc;
  i64 num_slots, waves, cap, verify_capacity, num_tokens;
};

// Every kernel takes the same arguments, in SameStepArgs' order (backends/cuda/same_step.py passes them).
#define KVCANARY_SAME_STEP_PARAMS                                                                                 \
  unsigned long long *written_at, int *write_waves, unsigned long long *counters, i64 *verify_slots,               \
      const i64 *verify_tokens, const i64 *verify_positions, const i64 *verify_prev, const int *verify_num_valid, \
      const int *enable, const i64 *write_offsets, const i64 *seeds, const int *write_num_valid_reqs,            \
      const i64 *input_ids, const i64 *positions, const i64 *out_cache_loc, i64 num_slots, i64 waves, i64 cap,   \
      i64 verify_capacity, i64 num_tokens
#define KVCANARY_SAME_STEP_ARGS                                                                                   \
  SameStepArgs a{written_at,   write_waves, counters,             verify_slots,  verify_tokens, verify_positions, \
                 verify_prev,   verify_num_valid, enable,         write_offsets, seeds,         write_num_valid_reqs, \
                 input_ids,     positions,  out_cache_loc,        num_slots,     waves,         cap,            \
                 verify_capacity, num_tokens}

__device__ __forceinline__ i64 batch_size(const SameStepArgs& a) {
  const i64 n = *a.write_num_valid_reqs;
  return n < 0 ? 0 : (n > a.cap ? a.cap : n);
}

// Request r's token range, clamped into [0, num_tokens] (write_range_checks in the NumPy backend).
__device__ __forceinline__ void token_range(const SameStepArgs& a, i64 r, i64& start, i64& end) {
  const i64 s = a.write_offsets[r], e = a.write_offsets[r + 1];
  start = s < 0 ? 0 : (s > a.num_tokens ? a.num_tokens : s);
  end = e < start ? start : (e > a.num_tokens ? a.num_tokens : e);
}

// The largest request whose range holds token i, or -1.
__device__ i64 owner_of(const SameStepArgs& a, i64 bs, i64 i, i64& start) {
  for (i64 r = bs - 1; r >= 0; --r) {
    i64 s, e;
    token_range(a, r, s, e);
    if (s <= i && i < e) {
      start = s;
      return r;
    }
  }
  return -1;
}

// The token of this step that wrote slot s, or -1.
__device__ __forceinline__ i64 writer_token(const SameStepArgs& a, i64 stamp, i64 s) {
  if (s <= 0 || s >= a.num_slots) return -1;
  const i64 mark = static_cast<i64>(a.written_at[s]);
  return (mark >> kStampShift) == stamp ? (mark & kTokenMask) : -1;
}

__global__ void same_step_begin(KVCANARY_SAME_STEP_PARAMS) {
  wait_for_prior_grids();
  KVCANARY_SAME_STEP_ARGS;
  if (blockIdx.x == 0 && threadIdx.x == 0) a.counters[0] += 1;
}

// Block r (grid-stride over the capacity) marks request r's tokens.
__global__ void same_step_mark(KVCANARY_SAME_STEP_PARAMS) {
  wait_for_prior_grids();
  KVCANARY_SAME_STEP_ARGS;
  const i64 bs = batch_size(a);
  const unsigned long long stamp = a.counters[0];
  for (i64 r = blockIdx.x; r < bs; r += gridDim.x) {
    i64 start, end;
    token_range(a, r, start, end);
    for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
      const i64 slot = a.out_cache_loc[i];
      if (slot > 0 && slot < a.num_slots)
        atomicMax(a.written_at + slot, (stamp << kStampShift) | static_cast<unsigned long long>(i));
    }
  }
}

__global__ void same_step_entries(KVCANARY_SAME_STEP_PARAMS) {
  wait_for_prior_grids();
  KVCANARY_SAME_STEP_ARGS;
  if (*a.enable == 0) return;
  const i64 bs = batch_size(a);
  const i64 stamp = static_cast<i64>(a.counters[0]);
  const i64 raw = *a.verify_num_valid;
  const i64 n = raw < 0 ? 0 : (raw > a.verify_capacity ? a.verify_capacity : raw);
  unsigned long long matched = 0;
  for (i64 e = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 i = writer_token(a, stamp, a.verify_slots[e]);
    if (i < 0) continue;
    i64 start = 0;
    const i64 w = owner_of(a, bs, i, start);
    if (w < 0) continue;
    i64 pred;
    if (i == start) {
      const i64 seed = a.seeds[w];
      pred = seed > 0 ? seed : -1;
    } else {
      const i64 before = a.out_cache_loc[i - 1];
      pred = before > 0 ? before : -3;
    }
    const i64 want_tok = a.verify_tokens[e];
    if (a.positions[i] == a.verify_positions[e] && (want_tok == -1 || a.input_ids[i] == want_tok) && a.verify_prev[e] == pred) {
      a.verify_slots[e] = 0;
      ++matched;
    }
  }
  if (matched) atomicAdd(a.counters + 1, matched);
}

// The request that writes request r's seed this step, or -1.
__device__ __forceinline__ i64 seed_writer(const SameStepArgs& a, i64 bs, i64 stamp, i64 r) {
  const i64 i = writer_token(a, stamp, a.seeds[r]);
  if (i < 0) return -1;
  i64 start = 0;
  const i64 w = owner_of(a, bs, i, start);
  return w != r ? w : -1;
}

__global__ void same_step_seeds(KVCANARY_SAME_STEP_PARAMS) {
  wait_for_prior_grids();
  KVCANARY_SAME_STEP_ARGS;
  const i64 bs = batch_size(a);
  const i64 stamp = static_cast<i64>(a.counters[0]);
  for (i64 r = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; r < a.cap; r += static_cast<i64>(gridDim.x) * blockDim.x) {
    if (r >= bs) {
      a.write_waves[r] = -1;
      continue;
    }
    i64 depth = 0, cur = r;
    for (i64 hop = 0; hop < a.waves; ++hop) {
      const i64 next = seed_writer(a, bs, stamp, cur);
      if (next < 0) break;
      ++depth;
      cur = next;
    }
    if (depth >= a.waves) {
      atomicAdd(a.counters + 2, 1ULL);
      depth = a.waves - 1;
    }
    a.write_waves[r] = static_cast<int>(depth);
  }
}

}  // namespace kvcanary
