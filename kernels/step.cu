// The fused decode step's first launch: plan + verify in one kernel (README "The fused decode
// step").  The plan's expansion hands each warp's 32-entry chunks of verify entries to a
// VerifySink, which checks them at once as canary_verify would: the entries never touch memory.
// The per-request outputs (the WritePlan) and the VerifyPlan's counters (verify_num_valid,
// enable, out_of_range_count) are written as plan_fused writes them; the entry arrays are not.
// Instantiated per table kind, like the plan kernels; a batch too large for plan_fused takes
// plan + verify (the host decides).
#include "plan.cu"

namespace kvcanary {

// Checks each live entry of a chunk against one canary buffer (check_verify_entry, as
// canary_verify does) and counts, in the caller's registers, the entries, the out-of-range values
// and the violations.  The predecessor of an entry whose prev is the left lane's slot has just
// been loaded by that lane: its hash comes by shuffle.
template <bool kCheckToken, bool kHasRealKv>
struct VerifySink {
  const CanaryBuffer& canary;
  const RealKvSources& sources;
  int kind;
  const LaunchLog& log;
  i64& entries;
  i64& errors;
  i64& violations;

  __device__ __forceinline__ void operator()(bool live, i64 /*t*/, i64 slot, i64 prev, bool prev_is_left_lane, i64 position,
                                             i64 token) const {
    // A dead lane holds slot 0 (never checked) and no out-of-range value.
    if (!live) slot = 0;
    entries += live;
    errors += verify_entry_errors(slot, prev, canary.num_slots);
    const bool ok = slot > 0 && slot < canary.num_slots;
    const CanaryRecord r = ok ? load_record(canary, slot) : CanaryRecord{0, 0, 0, 0};
    const u64 left_hash = __shfl_up_sync(kFullMask, slot_hash(r), 1);
    violations += check_verify_entry<kCheckToken, kHasRealKv>(canary, sources, kind, log, ok, slot, r, prev,
                                                              prev_is_left_lane, left_hash, position, token);
  }
};

// Plan (as plan_fused) and verify of canary buffer 0 of `targets` (as canary_verify with one
// buffer); launched with plan_fused's configuration.  The verify's counters: one kernel run, the
// entries checked (none when the plan exceeds out.verify_capacity: enable is then 0), the
// out-of-range entry values and the violations, each added once per warp.
template <int kTable, bool kHasLut, bool kHasPool, bool kCheckToken, bool kHasRealKv>
__global__ void __launch_bounds__(kPlanThreads, 1)
    plan_verify(PlanInputs in, PlanOutputs out, const __grid_constant__ CanaryTargets targets, LaunchLog log) {
  const int kind = targets.kind[0];
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(log.kernel_run_counters + kind, 1ULL);
  i64 entries = 0, errors = 0, violations = 0;
  plan_and_expand<kTable, kHasLut, kHasPool>(
      in, out, VerifySink<kCheckToken, kHasRealKv>{targets.canary[0], targets.sources[0], kind, log, entries, errors, violations});
  warp_add(log.slot_run_counters + kind, entries);
  warp_add(log.out_of_range_counters + kind, errors);
  warp_add(log.violation_counters + kind, violations);
}

}  // namespace kvcanary
