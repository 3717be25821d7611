// The fused decode step's first launch: plan + verify in one kernel (README "The fused decode
// step").  The plan's expansion hands each warp's 32-entry chunks of verify entries to a
// VerifySink, which checks them as canary_verify would: the entries never touch memory.
// The per-request outputs (the WritePlan) and the VerifyPlan's counters (verify_num_valid,
// enable, out_of_range_count) are written as plan_fused writes them; the entry arrays are not.
// Instantiated per table layout, like the plan kernels; a batch too large for plan_fused takes
// plan + verify (the host decides).
#include "plan.cu"

namespace kvcanary {

// plan_verify blocks an SM holds at once (mirrored by PLAN_VERIFY_BLOCKS_PER_SM in
// cupy_backend.py): the launch bounds cap a thread at 64 registers, so that a small batch's plan
// can run two blocks per SM (more warps in flight for the latency-bound check).
constexpr int kPlanVerifyBlocksPerSm = 2;

// The one variant whose thread does not fit 64 registers (the hole check, check_holes, took the
// last one: 8 bytes spilled): the wide block table with a LUT, a token pool, expected tokens and
// real-KV sources runs one block per SM (abi.plan_verify_one_block mirrors the rule).
template <int kTable, bool kHasLut, bool kHasPool, bool kCheckToken, bool kHasRealKv>
constexpr int kPlanVerifyBlocks =
    kTable == kTableBlock && kHasLut && kHasPool && kCheckToken && kHasRealKv ? 1 : kPlanVerifyBlocksPerSm;

// Checks the entries of kChunks chunks at once against one canary buffer (as canary_verify does)
// and adds the out-of-range values and the violations to the log's counters (a warp's atomic
// only when it found any: no counter held in registers across the expansion).  The check is
// latency-bound (table lookup, then record gather, per entry): every chunk's real-KV folds come
// first (their registers are free again before the records arrive), then every chunk's record
// loads are issued before any is checked, beside the loads of the predecessors that no lane of
// the chunk holds (the first entry of a chunk or of a request).  Any other entry's predecessor is
// the left lane's entry, whose record's hashed fields come by shuffle (with expected tokens, its
// hash: one more hash a lane, fewer registers).  kChunks = 1: a thread fits 64
// registers without spilling (kPlanVerifyBlocksPerSm), for every table kind and flag but the one
// kPlanVerifyBlocks names; more chunks per step spill there.
template <bool kCheckToken, bool kHasRealKv>
struct VerifySink {
  static constexpr int kChunks = 1;
  static constexpr bool kEarlyRowOutput = false;
  static constexpr bool kPairedLookups = false;  // the predecessor's lookup after the entry's: fewer registers, and as fast
  const CanaryBuffer& canary;
  const RealKvSources& sources;
  int kind;
  const LaunchLog& log;
  int check_holes;  // a live entry of the padding slot logs a hole row (canary_verify's check_holes)

  __device__ __forceinline__ void operator()(const PlannedEntry (&e)[kChunks]) const {
    const i64 num_slots = canary.num_slots;
    constexpr CanaryRecord kNone{0, 0, 0, 0};
    bool ok[kChunks];
    CanaryRecord rec[kChunks], loaded_prev[kChunks];
    u64 real_kv[kChunks];
    i64 errors = 0, violations = 0;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {  // a dead lane holds slot 0: never checked, no out-of-range value
      errors += verify_entry_errors(e[k].slot, e[k].prev, num_slots);
      ok[k] = e[k].slot > 0 && e[k].slot < num_slots;
      real_kv[k] = kHasRealKv && ok[k] ? real_kv_fold(sources, e[k].slot) : 0;
    }
#pragma unroll
    for (int k = 0; k < kChunks; ++k) rec[k] = ok[k] ? load_record(canary, e[k].slot) : kNone;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const bool own = !e[k].prev_is_left_lane && chain_checked(ok[k], e[k].prev, num_slots);
      loaded_prev[k] = own ? load_hashed_fields(canary, e[k].prev) : kNone;
    }
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      if (!__any_sync(kFullMask, e[k].live)) break;  // past the warp's range: so are the later chunks
      u64 before;
      if (kCheckToken) {  // the left lane's hash by shuffle: two hashes a lane, fewer registers live
        const u64 left_hash = __shfl_up_sync(kFullMask, slot_hash(rec[k]), 1);
        before = e[k].prev_is_left_lane ? left_hash : slot_hash(loaded_prev[k]);
      } else {  // one hash a lane, of the left lane's record (its hashed fields by shuffle) or of its own predecessor's
        const i64 left_token = __shfl_up_sync(kFullMask, rec[k].token, 1);
        const i64 left_position = __shfl_up_sync(kFullMask, rec[k].position, 1);
        const i64 left_prev_hash = __shfl_up_sync(kFullMask, rec[k].prev_hash, 1);
        before = slot_hash(e[k].prev_is_left_lane ? CanaryRecord{left_token, left_position, left_prev_hash, 0} : loaded_prev[k]);
      }
      const bool hole = check_holes && e[k].live && is_padding_slot(e[k].slot);
      violations += check_folded_entry<kCheckToken>(canary, kind, log, ok[k], e[k].slot, rec[k], e[k].prev, true, before,
                                                    e[k].position, e[k].token, real_kv[k], hole, e[k].t);
    }
    warp_add(log.out_of_range_counters + kind, errors);
    warp_add(log.violation_counters + kind, violations);
  }
};

// Plan (as plan_fused) and verify of canary buffer 0 of `targets` (as canary_verify with one
// buffer); launched like plan_fused, but with up to kPlanVerifyBlocksPerSm blocks per SM for a
// small batch (the host decides).  The verify's counters: one kernel run and the entries checked
// (none when the plan exceeds out.verify_capacity: enable is then 0), by one thread; the
// out-of-range entry values and the violations, by the sink.
template <int kTable, bool kHasLut, bool kHasPool, bool kCheckToken, bool kHasRealKv>
__global__ void __launch_bounds__(kPlanThreads, (kPlanVerifyBlocks<kTable, kHasLut, kHasPool, kCheckToken, kHasRealKv>))
    plan_verify(PlanInputs in, PlanOutputs out, const __grid_constant__ CanaryTargets targets, LaunchLog log, int check_holes) {
  wait_for_prior_grids();
  const int kind = targets.kind[0];
  // The strided scan passes alone: a blocked pass's registers spill at 64 a thread (and its batch
  // sizes gain little: plan_verify's W5 18.1 -> 18.0 us on the H200).
  const i64 entries = plan_and_expand<kTable, kHasLut, kHasPool, 1>(
      in, out, VerifySink<kCheckToken, kHasRealKv>{targets.canary[0], targets.sources[0], kind, log, check_holes});
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    atomicAdd(log.kernel_run_counters + kind, 1ULL);
    if (entries > 0) atomicAdd(log.slot_run_counters + kind, static_cast<unsigned long long>(entries));
  }
}

}  // namespace kvcanary
