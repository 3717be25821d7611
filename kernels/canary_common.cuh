// kv-canary device primitives shared by every kernel family.
//
// Constants mirror kvcanary_cupy/constants.py (tests/test_kernels_compile.py keeps them equal).
// Everything here is plain CUDA C++17 that NVRTC compiles without any standard header.
#pragma once

namespace kvcanary {

typedef long long i64;
typedef unsigned long long u64;

constexpr u64 kCanaryChainAnchor = 0xC0FFEE1234567890ULL;
constexpr u64 kSplitmix64Mul1 = 0xBF58476D1CE4E5B9ULL;
constexpr u64 kSplitmix64Mul2 = 0x94D049BB133111EBULL;
constexpr int kCanaryFieldsPerSlot = 4;
constexpr int kViolationFields = 8;
constexpr int kMaxRealKvSources = 8;
constexpr int kMaxPieceLevels = 2;
constexpr int kRealKvPartialBytes = 16;

constexpr i64 kVerifyChainHashMismatch = 1 << 0;
constexpr i64 kVerifyPositionMismatch = 1 << 1;
constexpr i64 kVerifyRealKvHashMismatch = 1 << 2;
constexpr i64 kWriteTokenMismatch = 1 << 3;
constexpr i64 kWritePositionMismatch = 1 << 4;
constexpr i64 kVerifyTokenMismatch = 1 << 5;
// This project's coverage bits (kernels/coverage.cu); SGLang's six above are unchanged.
constexpr i64 kWriteKvNotStored = 1 << 11;
constexpr i64 kVerifyDeepKvMismatch = 1 << 12;
constexpr i64 kVerifyTableHole = 1 << 16;  // this project's own bit: a read position addressing the padding slot

__host__ __device__ constexpr u64 splitmix64(u64 x) {
  x ^= x >> 30;
  x *= kSplitmix64Mul1;
  x ^= x >> 27;
  x *= kSplitmix64Mul2;
  x ^= x >> 31;
  return x;
}

__host__ __device__ constexpr u64 mix3(u64 a, u64 b, u64 c) {
  return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c);
}

constexpr u64 kAnchorHash = splitmix64(kCanaryChainAnchor);
static_assert(kAnchorHash == 0xDE7FAE23A9A1B716ULL, "anchor hash");

constexpr int kMaxCanaryBuffers = 4;
constexpr unsigned kFullMask = 0xffffffffu;

// The real-KV sources of one canary buffer, passed by value (mirrored by a NumPy structured
// dtype in kvcanary_cupy/backends/cupy_backend.py).  num_sources is 0 when the mode is NONE;
// nbytes[i] is already resolved from the mode (16 for PARTIAL, read_bytes for ALL).
//
// A slot's bytes are a stream that starts byte_offset + (slot % page) * token_stride bytes into
// row slot / page: pieces of piece_bytes bytes, piece (i0, i1) at i0 * piece_stride[0] +
// i1 * piece_stride[1] (piece_count[1] pieces per outer step).  unit 16: one contiguous piece,
// 16-byte aligned, read 16 bytes at a time; else the stream is read `unit` (1, 2, 4 or 8) bytes
// at a time, every address a multiple of it (RealKvSource checks both).
struct RealKvSources {
  u64 data[kMaxRealKvSources];  // device addresses, aligned to unit
  i64 row_stride[kMaxRealKvSources];  // bytes between dim-0 rows, a multiple of unit
  i64 slot_offset[kMaxRealKvSources];  // canary slot s holds the KV of pool slot s - slot_offset
  i64 token_stride[kMaxRealKvSources];
  i64 byte_offset[kMaxRealKvSources];
  i64 piece_stride[kMaxRealKvSources][kMaxPieceLevels];
  int piece_count[kMaxRealKvSources][kMaxPieceLevels];
  int page_size[kMaxRealKvSources];
  int nbytes[kMaxRealKvSources];
  int piece_bytes[kMaxRealKvSources];
  int unit[kMaxRealKvSources];
  int num_sources;
};

// The layout of one source's stream within a row (the fields of RealKvSources for one source,
// or a row of a coverage source table, kernels/coverage.cu).
struct StreamLayout {
  i64 stride0, stride1;  // bytes between outer / inner pieces
  int inner, piece_bytes, unit, nbytes;  // inner pieces per outer step; nbytes: how many bytes are folded
};

// Word `b / 8` (b a multiple of 8) of a strided stream starting at `token`: eight bytes of
// consecutive stream positions, `unit` bytes per load, little-endian like the contiguous path.
__device__ __forceinline__ u64 strided_word(const unsigned char* token, const StreamLayout& l, int b) {
  u64 w = 0;
  for (int u = 0; u < 8; u += l.unit) {
    const int c = b + u, piece = c / l.piece_bytes, within = c - piece * l.piece_bytes;
    const int i0 = piece / l.inner, i1 = piece - i0 * l.inner;
    const unsigned char* p = token + i0 * l.stride0 + i1 * l.stride1 + within;
    u64 v;
    if (l.unit == 8) v = *reinterpret_cast<const u64*>(p);
    else if (l.unit == 4) v = *reinterpret_cast<const unsigned*>(p);
    else if (l.unit == 2) v = *reinterpret_cast<const unsigned short*>(p);
    else v = *p;
    w |= v << (8 * u);
  }
  return w;
}

// The fold of one source's stream (docs/format.md §3): its first nbytes bytes as little-endian
// words; unit 16 reads a contiguous, 16-byte aligned stream 16 bytes at a time.
__device__ __forceinline__ u64 fold_stream(const unsigned char* token, const StreamLayout& l) {
  u64 h = 0;
  if (l.unit == 16) {
    for (int b = 0; b < l.nbytes; b += 16) {
      const ulonglong2 w = *reinterpret_cast<const ulonglong2*>(token + b);
      h = splitmix64(h ^ w.x);
      h = splitmix64(h ^ w.y);
    }
  } else {
    for (int b = 0; b < l.nbytes; b += 8) h = splitmix64(h ^ strided_word(token, l, b));
  }
  return h;
}

// The fold of source i of one slot: 0 for a slot below the source's slot_offset (no KV bytes there).
__device__ __forceinline__ u64 source_fold(const RealKvSources& s, int i, i64 slot) {
  const i64 page = s.page_size[i], pool_slot = slot - s.slot_offset[i];
  if (pool_slot < 0) return 0;
  const unsigned char* token = reinterpret_cast<const unsigned char*>(s.data[i]) + (pool_slot / page) * s.row_stride[i] +
                               s.byte_offset[i] + (pool_slot % page) * s.token_stride[i];
  const StreamLayout l{s.piece_stride[i][0], s.piece_stride[i][1], s.piece_count[i][1], s.piece_bytes[i], s.unit[i], s.nbytes[i]};
  return fold_stream(token, l);
}

// Fingerprint of one slot's real KV bytes (docs/format.md §3).  The host checked that every source
// covers every canary slot from its slot_offset on, so `slot` in [0, num_slots) never reads out of
// bounds; a slot below a source's slot_offset has no KV bytes there and folds a zero strip.  The kernels
// take the sources as a __grid_constant__ parameter, so the runtime index reads them in place
// (no copy to local memory).
__device__ __forceinline__ u64 real_kv_fold(const RealKvSources& s, i64 slot) {
  u64 acc = 0;
  for (int i = 0; i < s.num_sources; ++i) acc = splitmix64(acc ^ source_fold(s, i, slot));
  return acc;
}

// The violation log of one launch: its fill-once ring and its per-kind counters.  Mirrored by a
// NumPy structured dtype in kvcanary_cupy/backends/cupy_backend.py.
//
// Rows are appended a warp at a time (append_rows): one ballot, one ticket range drawn with one
// atomicAdd, and no ticket at all once the ring is full.  Tickets are drawn only while
// write_index < capacity; a draw that overshoots clamps write_index back to capacity with
// atomicMin.  Adds only raise it and clamps only bring it down to capacity, so it ends at
// min(before + violations, capacity) whatever the thread timing (the NumPy backend's rule).
// Violations are counted in registers and added to violation_counters once per warp and launch.
//
// No fence follows the row stores: the host reads the ring with a copy ordered after the kernel
// on its stream (or after a synchronize), and the end of a kernel makes all its global stores
// visible to later work on the stream and to the host.  Nothing reads the ring while the kernel
// runs, so a __threadfence_system per row would only cost time.
struct LaunchLog {
  i64* ring;  // [capacity, 8]
  int* write_index;  // [1], tickets drawn: saturates at capacity, never wraps
  unsigned long long* violation_counters;  // [num_kinds], every violation (exact)
  unsigned long long* slot_run_counters;  // [num_kinds]
  unsigned long long* kernel_run_counters;  // [num_kinds]
  unsigned long long* out_of_range_counters;  // [num_kinds]
  int capacity;

  // Every lane of a converged warp calls this; lanes with `hit` hold a violation row (and count it
  // themselves for violation_counters).
  __device__ __forceinline__ void append_rows(bool hit, int kind, i64 slot, i64 position, i64 stored_token,
                                             i64 expected_token, i64 stored_chain, i64 expected_aux, i64 bits) const {
    const unsigned mask = __ballot_sync(kFullMask, hit);
    if (mask == 0) return;
    const int lane = threadIdx.x & 31, leader = __ffs(mask) - 1, rows = __popc(mask);
    int base = capacity;  // a full ring draws no ticket
    if (lane == leader && *reinterpret_cast<volatile int*>(write_index) < capacity) {
      base = atomicAdd(write_index, rows);
      if (static_cast<i64>(base) + rows > capacity) atomicMin(write_index, capacity);
    }
    base = __shfl_sync(kFullMask, base, leader);
    const i64 ticket = static_cast<i64>(base) + __popc(mask & ((1u << lane) - 1u));
    if (hit && ticket >= 0 && ticket < capacity) {
      i64* row = ring + ticket * kViolationFields;
      row[0] = kind;
      row[1] = slot;
      row[2] = position;
      row[3] = stored_token;
      row[4] = expected_token;
      row[5] = stored_chain;
      row[6] = expected_aux;
      row[7] = bits;
    }
  }
};

// Every kernel's first statement.  On sm_90 and later the host launches the kernels with
// programmatic stream serialization (README "Launch overlap"), so a kernel's blocks may start
// while the work before it on the stream is still finishing; this waits until that work has
// completed and its writes are visible, before the kernel reads or writes any memory.  For a
// launch without that attribute, or before sm_90, it does nothing.  No kernel signals its
// dependents early (griddepcontrol.launch_dependents): on the H200 that made the W1 decode step
// 1 us slower, the next kernel's blocks taking room on the SMs of a full grid.
__device__ __forceinline__ void wait_for_prior_grids() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A canary slot's record: the first four int64 of the slot's row.
struct CanaryRecord {
  i64 token, position, prev_hash, real_kv_hash;
};

// The canary buffer as int64 [num_slots, fields]; vec: every row is 16-byte aligned.
struct CanaryBuffer {
  i64* data;
  i64 num_slots;
  int fields;
  int vec;
};

// The canary buffers one launch writes or verifies with one plan (e.g. the K and V halves), each
// with its real-KV sources and the launch kind its rows and counters go to.  Only the first
// kBuffers entries (a template parameter of the kernels) are read; all have the same num_slots.
struct CanaryTargets {
  CanaryBuffer canary[kMaxCanaryBuffers];
  RealKvSources sources[kMaxCanaryBuffers];
  int kind[kMaxCanaryBuffers];
};

__device__ __forceinline__ CanaryRecord load_record(const CanaryBuffer& c, i64 slot) {
  const i64* row = c.data + slot * c.fields;
  CanaryRecord r;
  if (c.vec) {  // two 16-byte loads
    const longlong2 a = *reinterpret_cast<const longlong2*>(row);
    const longlong2 b = *reinterpret_cast<const longlong2*>(row + 2);
    r.token = a.x; r.position = a.y; r.prev_hash = b.x; r.real_kv_hash = b.y;
  } else {
    r.token = row[0]; r.position = row[1]; r.prev_hash = row[2]; r.real_kv_hash = row[3];
  }
  return r;
}

// The fields of slot `slot`'s record that slot_hash reads (real_kv_hash left 0): a predecessor's
// record needs no more, and a verify that gathers many at once saves the registers.
__device__ __forceinline__ CanaryRecord load_hashed_fields(const CanaryBuffer& c, i64 slot) {
  const i64* row = c.data + slot * c.fields;
  CanaryRecord r;
  if (c.vec) {
    const longlong2 a = *reinterpret_cast<const longlong2*>(row);
    r.token = a.x; r.position = a.y;
  } else {
    r.token = row[0]; r.position = row[1];
  }
  r.prev_hash = row[2];
  r.real_kv_hash = 0;
  return r;
}

__device__ __forceinline__ void store_record(const CanaryBuffer& c, i64 slot, const CanaryRecord& r) {
  i64* row = c.data + slot * c.fields;
  if (c.vec) {
    *reinterpret_cast<longlong2*>(row) = make_longlong2(r.token, r.position);
    *reinterpret_cast<longlong2*>(row + 2) = make_longlong2(r.prev_hash, r.real_kv_hash);
  } else {
    row[0] = r.token; row[1] = r.position; row[2] = r.prev_hash; row[3] = r.real_kv_hash;
  }
}

// The hash a successor of `r` must carry as its prev_hash.
__device__ __forceinline__ u64 slot_hash(const CanaryRecord& r) {
  return mix3(static_cast<u64>(r.prev_hash), static_cast<u64>(r.token), static_cast<u64>(r.position));
}

// ---- one verify entry (verify.cu, and step.cu's fused plan + verify) --------------------------

// Out-of-range values of a verify entry: a slot outside the canary, or an in-range slot whose
// predecessor lies past it (a predecessor of 0 or below is no lookup).
__device__ __forceinline__ i64 verify_entry_errors(i64 slot, i64 prev, i64 num_slots) {
  const bool ok = slot > 0 && slot < num_slots;
  return (slot < 0 || slot >= num_slots) + (ok && prev >= num_slots);
}

// Whether an entry's chain is checked against its predecessor's record: the entry is checked
// (`ok`) and its predecessor `prev` is a slot of the canary past the padding slot (-1 checks
// against the anchor instead; 0 or out of range: no chain check).
__device__ __forceinline__ bool chain_checked(bool ok, i64 prev, i64 num_slots) { return ok && prev > 0 && prev < num_slots; }

// Whether a verify entry's slot is the padding slot (never checked; with check_holes, a hole).
__device__ __forceinline__ bool is_padding_slot(i64 slot) { return slot == 0; }

// check_verify_entry with the fold of the entry's real KV done by the caller: `real_kv` is
// real_kv_fold of the slot (0 without real-KV sources or for an entry not `ok`), so the caller
// picks when the fold's registers are live.  `hole`: the entry (index `entry` of the plan) is a
// live one whose slot is the padding slot and holes are checked; it logs a hole row instead
// (docs/format.md: slot, expected position, stored token -1, stored chain 0, the entry index in
// expected_aux, kVerifyTableHole).
template <bool kCheckToken>
__device__ __forceinline__ bool check_folded_entry(const CanaryBuffer& canary, int kind, const LaunchLog& log, bool ok, i64 slot,
                                                   const CanaryRecord& r, i64 prev, bool prev_hash_known, u64 prev_hash,
                                                   i64 position, i64 token, u64 real_kv, bool hole, i64 entry) {
  u64 expected_chain = static_cast<u64>(r.prev_hash);
  if (prev < 0) {
    expected_chain = kAnchorHash;
  } else if (chain_checked(ok, prev, canary.num_slots)) {
    expected_chain = prev_hash_known ? prev_hash : slot_hash(load_record(canary, prev));
  }
  const i64 expected_token = kCheckToken ? token : -1;
  i64 bits = 0;
  if (static_cast<u64>(r.prev_hash) != expected_chain) bits |= kVerifyChainHashMismatch;
  if (r.position != position) bits |= kVerifyPositionMismatch;
  if (static_cast<u64>(r.real_kv_hash) != real_kv) bits |= kVerifyRealKvHashMismatch;
  if (kCheckToken && expected_token != -1 && r.token != expected_token) bits |= kVerifyTokenMismatch;
  const bool hit = (ok && bits != 0) || hole;
  log.append_rows(hit, kind, slot, hole ? position : r.position, hole ? -1 : r.token, expected_token, hole ? 0 : r.prev_hash,
                  hole ? entry : static_cast<i64>(expected_chain), hole ? kVerifyTableHole : bits);
  return hit;
}

// Checks the record `r` of entry `slot` (loaded when `ok`: 0 < slot < num_slots; slot 0, the
// padding slot, is never checked: with `hole`, see check_folded_entry) against its position, its expected token (-1: unchecked), its
// real KV and the hash of its predecessor `prev` (see chain_checked).  With `prev_hash_known`,
// `prev_hash` is the hash of slot prev's record, which the caller has (a neighbouring lane loaded
// the record, or the caller did ahead); else it is loaded here.  A violation goes to the ring;
// every lane of a converged warp calls this.  Returns whether the entry violates.
template <bool kCheckToken, bool kHasRealKv>
__device__ __forceinline__ bool check_verify_entry(const CanaryBuffer& canary, const RealKvSources& sources, int kind,
                                                   const LaunchLog& log, bool ok, i64 slot, const CanaryRecord& r,
                                                   i64 prev, bool prev_hash_known, u64 prev_hash, i64 position, i64 token,
                                                   bool hole, i64 entry) {
  const u64 real_kv = kHasRealKv && ok ? real_kv_fold(sources, slot) : 0;
  return check_folded_entry<kCheckToken>(canary, kind, log, ok, slot, r, prev, prev_hash_known, prev_hash, position, token,
                                         real_kv, hole, entry);
}

// Element i of an index array that is int32 or int64 (engine tables come in either).
__device__ __forceinline__ i64 load_index(const void* p, int is_int64, i64 i) {
  return is_int64 ? static_cast<const i64*>(p)[i] : static_cast<i64>(static_cast<const int*>(p)[i]);
}

// Adds the warp's sum of `value` to *counter with one atomic (all 32 lanes must call).
__device__ __forceinline__ void warp_add(unsigned long long* counter, i64 value) {
  if (!__any_sync(kFullMask, value != 0)) return;  // the usual case for error counts: skip the reduction
  for (int o = 16; o > 0; o >>= 1) value += __shfl_down_sync(kFullMask, value, o);
  if ((threadIdx.x & 31) == 0 && value != 0) atomicAdd(counter, static_cast<unsigned long long>(value));
}

}  // namespace kvcanary
