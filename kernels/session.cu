// Session staging (CanarySession.end_step, outside CUDA graphs, on the step's stream).
//
// session_stage snapshots the violation log into one int64 record (header, counters, the ring
// rows of the step), marks the slots named by verify rows with the record's stamp and resets
// write_index, all in one block so the reset follows every read.  session_attribute then lists the
// verify entries of the step's plan that read a marked slot, so the host can name the batch rows
// of a violation after the plan has been overwritten.  With no violation it exits at once.
// The ring may be split into num_rings equal shares, each with its own ticket counter
// (write_index[g]), so one launch group's flood cannot starve another's rows; the record holds
// the rows of share 0, then of share 1, and so on.
// The record layout is StageLayout in kvcanary_cupy/backends/__init__.py; the NumPy reference
// is session_stage in kvcanary_cupy/backends/numpy_backend.py.
#include "canary_common.cuh"

namespace kvcanary {

constexpr int kStageHeaderFields = 8;
constexpr int kStageRows = 0;
constexpr int kStageStamp = 1;
constexpr int kStageMatches = 2;
constexpr int kStageEnable = 3;
constexpr int kStageVerifyNumValid = 4;
constexpr int kStageBatchSize = 5;
constexpr int kStagePlanOutOfRange = 6;
constexpr int kAttributionFields = 6;  // slot, batch row, entry, expected position, prev slot, expected token
constexpr int kMaxStageRings = 8;  // MAX_STAGE_RINGS in kvcanary_cupy/backends/__init__.py

// Mirrored by a NumPy structured dtype (SESSION_STAGE) in kvcanary_cupy/backends/cupy_backend.py.
struct SessionStage {
  i64* ring;  // [ring_capacity, 8]: num_rings shares of ring_capacity / num_rings rows
  int* write_index;  // [num_rings]
  const i64* violation_counters;
  const i64* slot_run_counters;
  const i64* kernel_run_counters;
  const i64* out_of_range_counters;
  const i64* slots;
  const i64* expected_tokens;
  const i64* expected_positions;
  const i64* prev_slots;
  const int* verify_num_valid;
  const int* enable;
  const i64* plan_out_of_range;
  const i64* verify_offsets;  // [write_req_capacity + 1]
  const int* write_num_valid_reqs;
  i64* marks;  // [num_slots]
  i64* staging;
  i64 num_slots;
  i64 ring_capacity;
  i64 verify_capacity;
  i64 write_req_capacity;
  i64 attribution_capacity;
  i64 num_kinds;
  i64 num_rings;  // in [1, kMaxStageRings], dividing ring_capacity (checked on the host)
};
static_assert(sizeof(SessionStage) == 192, "mirrored in cupy_backend.py");

__device__ __forceinline__ i64 clamp_count(i64 v, i64 hi) { return v < 0 ? 0 : (v > hi ? hi : v); }

// One block: everything it reads is read before thread 0 resets write_index.
__global__ void session_stage(SessionStage s, i64 stamp) {
  wait_for_prior_grids();
  __shared__ i64 rows;
  __shared__ i64 counts[kMaxStageRings], starts[kMaxStageRings];  // rows of share g, their first row in the record
  const int tid = threadIdx.x;
  const i64 share = s.ring_capacity / s.num_rings;
  if (tid == 0) {
    i64 total = 0;
    for (i64 g = 0; g < s.num_rings; ++g) {
      counts[g] = clamp_count(s.write_index[g], share);
      starts[g] = total;
      total += counts[g];
    }
    rows = total;
    s.staging[kStageRows] = rows;
    s.staging[kStageStamp] = stamp;
    s.staging[kStageMatches] = 0;
    s.staging[kStageEnable] = *s.enable;
    s.staging[kStageVerifyNumValid] = *s.verify_num_valid;
    s.staging[kStageBatchSize] = *s.write_num_valid_reqs;
    s.staging[kStagePlanOutOfRange] = *s.plan_out_of_range;
    s.staging[7] = 0;
  }
  __syncthreads();
  i64* counters = s.staging + kStageHeaderFields;
  for (i64 k = tid; k < s.num_kinds; k += blockDim.x) {
    counters[k] = s.violation_counters[k];
    counters[s.num_kinds + k] = s.slot_run_counters[k];
    counters[2 * s.num_kinds + k] = s.kernel_run_counters[k];
    counters[3 * s.num_kinds + k] = s.out_of_range_counters[k];
  }
  i64* ring_out = counters + 4 * s.num_kinds;
  for (i64 g = 0; g < s.num_rings; ++g) {
    const i64 n = counts[g];
    const i64* ring = s.ring + g * share * kViolationFields;
    i64* out = ring_out + starts[g] * kViolationFields;
    for (i64 i = tid; i < n * kViolationFields; i += blockDim.x) out[i] = ring[i];
    for (i64 r = tid; r < n; r += blockDim.x) {
      const i64* row = ring + r * kViolationFields;
      const i64 slot = row[1];
      // the padding slot only by a hole row: its readers are the hole's
      const bool named = slot > 0 || (slot == 0 && (row[7] & kVerifyTableHole) != 0);
      if ((row[7] & (kWriteTokenMismatch | kWritePositionMismatch)) == 0 && named && slot < s.num_slots)
        s.marks[slot] = stamp;
    }
  }
  __syncthreads();
  if (tid == 0)
    for (i64 g = 0; g < s.num_rings; ++g) s.write_index[g] = 0;
}

// The batch row owning verify entry e: the number of r in [1, bs] with verify_offsets[r] <= e,
// or -1 when e is past the last request (offsets are non-decreasing, as plan writes them).
__device__ __forceinline__ i64 batch_row_of(const i64* offsets, i64 bs, i64 e) {
  i64 lo = 1, hi = bs + 1;  // first r in [1, bs] with offsets[r] > e
  while (lo < hi) {
    const i64 mid = lo + (hi - lo) / 2;
    if (offsets[mid] <= e) lo = mid + 1; else hi = mid;
  }
  return lo - 1 < bs ? lo - 1 : -1;
}

// A fixed grid over the plan's verify entries; returns at once when the step logged nothing.
__global__ void session_attribute(SessionStage s) {
  wait_for_prior_grids();
  const i64* header = s.staging;
  if (header[kStageRows] == 0 || header[kStageEnable] == 0) return;
  const i64 stamp = header[kStageStamp];
  const i64 active = clamp_count(header[kStageVerifyNumValid], s.verify_capacity);
  const i64 bs = clamp_count(header[kStageBatchSize], s.write_req_capacity);
  i64* out = s.staging + kStageHeaderFields + 4 * s.num_kinds + s.ring_capacity * kViolationFields;
  for (i64 e = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; e < active;
       e += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 slot = s.slots[e];
    if (slot < 0 || slot >= s.num_slots || s.marks[slot] != stamp) continue;
    const i64 t = static_cast<i64>(atomicAdd(reinterpret_cast<unsigned long long*>(s.staging + kStageMatches), 1ULL));
    if (t >= s.attribution_capacity) continue;  // counted in matches, not kept
    i64* rec = out + t * kAttributionFields;
    rec[0] = slot;
    rec[1] = bs > 0 ? batch_row_of(s.verify_offsets, bs, e) : -1;
    rec[2] = e;
    rec[3] = s.expected_positions[e];
    rec[4] = s.prev_slots[e];
    rec[5] = s.expected_tokens[e];
  }
}

}  // namespace kvcanary
