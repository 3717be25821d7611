// The fused decode step's first launch: plan + verify in one kernel (README "The fused decode
// step").  The plan's expansion hands each warp's 32-entry chunks of verify entries, several at a
// time, to a VerifySink, which checks them at once as canary_verify would: the entries never
// touch memory.
// The per-request outputs (the WritePlan) and the VerifyPlan's counters (verify_num_valid,
// enable, out_of_range_count) are written as plan_fused writes them; the entry arrays are not.
// Instantiated per table kind, like the plan kernels; a batch too large for plan_fused takes
// plan + verify (the host decides).
#include "plan.cu"

namespace kvcanary {

// Checks the entries of kChunks chunks at once against one canary buffer (check_verify_entry, as
// canary_verify does) and counts, in the caller's registers, the out-of-range values and the
// violations.  The check is latency-bound (table lookup, then record gather, per entry), so the
// expansion issues every chunk's lookups before any chunk's gathers, and every chunk's record
// loads are issued here before any is checked, beside the loads of the predecessors that no lane
// of the chunk holds (the first entry of a chunk or of a request).  Any other entry's predecessor
// is the left lane's entry, whose record comes by shuffle within the chunk; each lane hashes its
// predecessor's record once.  kChunks: as many as fit 128 registers a thread without spilling
// (the real-KV fold and the expected tokens take theirs).
template <bool kCheckToken, bool kHasRealKv>
struct VerifySink {
  static constexpr int kChunks = kHasRealKv ? 2 : kCheckToken ? 3 : 4;
  const CanaryBuffer& canary;
  const RealKvSources& sources;
  int kind;
  const LaunchLog& log;
  i64& errors;
  i64& violations;

  __device__ __forceinline__ void operator()(const PlannedEntry (&e)[kChunks]) const {
    const i64 num_slots = canary.num_slots;
    constexpr CanaryRecord kNone{0, 0, 0, 0};
    bool ok[kChunks];
    CanaryRecord rec[kChunks], loaded_prev[kChunks];
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {  // a dead lane holds slot 0: never checked, no out-of-range value
      errors += verify_entry_errors(e[k].slot, e[k].prev, num_slots);
      ok[k] = e[k].slot > 0 && e[k].slot < num_slots;
      rec[k] = ok[k] ? load_record(canary, e[k].slot) : kNone;
    }
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const bool own = !e[k].prev_is_left_lane && chain_checked(ok[k], e[k].prev, num_slots);
      loaded_prev[k] = own ? load_record(canary, e[k].prev) : kNone;
    }
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      if (!__any_sync(kFullMask, e[k].live)) break;  // past the warp's range: so are the later chunks
      CanaryRecord before = loaded_prev[k];
      const i64 left_token = __shfl_up_sync(kFullMask, rec[k].token, 1);
      const i64 left_position = __shfl_up_sync(kFullMask, rec[k].position, 1);
      const i64 left_prev_hash = __shfl_up_sync(kFullMask, rec[k].prev_hash, 1);
      if (e[k].prev_is_left_lane) before = CanaryRecord{left_token, left_position, left_prev_hash, 0};
      violations += check_verify_entry<kCheckToken, kHasRealKv>(canary, sources, kind, log, ok[k], e[k].slot, rec[k], e[k].prev,
                                                                true, slot_hash(before), e[k].position, e[k].token);
    }
  }
};

// Plan (as plan_fused) and verify of canary buffer 0 of `targets` (as canary_verify with one
// buffer); launched with plan_fused's configuration.  The verify's counters: one kernel run and
// the entries checked (none when the plan exceeds out.verify_capacity: enable is then 0), by one
// thread; the out-of-range entry values and the violations, added once per warp.
template <int kTable, bool kHasLut, bool kHasPool, bool kCheckToken, bool kHasRealKv>
__global__ void __launch_bounds__(kPlanThreads, 1)
    plan_verify(PlanInputs in, PlanOutputs out, const __grid_constant__ CanaryTargets targets, LaunchLog log) {
  const int kind = targets.kind[0];
  i64 errors = 0, violations = 0;
  const i64 entries = plan_and_expand<kTable, kHasLut, kHasPool>(
      in, out, VerifySink<kCheckToken, kHasRealKv>{targets.canary[0], targets.sources[0], kind, log, errors, violations});
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    atomicAdd(log.kernel_run_counters + kind, 1ULL);
    if (entries > 0) atomicAdd(log.slot_run_counters + kind, static_cast<unsigned long long>(entries));
  }
  warp_add(log.out_of_range_counters + kind, errors);
  warp_add(log.violation_counters + kind, violations);
}

}  // namespace kvcanary
