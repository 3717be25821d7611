// Transfer digests (docs/transfer.md): a keyed splitmix64 sum over logical KV coordinates plus
// a provenance sum, per request; kvcanary_cupy/digest/reference.py computes the same bytes.
//
// digest_init writes each request's record header and zero sums (plus its seam term), then
// digest_accumulate adds the KV and per-position provenance terms with integer atomics: a sum
// modulo 2**64 is exact in any order, so the result is the reference's bit for bit.  Every table
// entry, page id and record slot is range-checked before it is dereferenced; an out-of-range
// request or position is skipped and counted once.  digest_verify compares two record arrays.
#include "canary_common.cuh"

namespace kvcanary {

constexpr u64 kDigestSeed = 0x4B56444947455354ULL;
constexpr u64 kDigestWordStride = 0x9E3779B97F4A7C15ULL;
constexpr u64 kDigestLayerRotation = 0x5A5AULL;
constexpr u64 kDigestRecLayer = 0xFFFFULL;
constexpr i64 kDigestMaxPosition = 1LL << 32;
constexpr i64 kSlotLimit = 1LL << 62;
constexpr u64 kDigestMagic = 0x4744564BULL;
constexpr u64 kDigestVersion = 1;
constexpr u64 kFlagPresent = 1;
constexpr i64 kDigestMismatchKv = 1 << 6, kDigestMismatchRec = 1 << 7, kDigestMissing = 1 << 8,
              kDigestIncomparable = 1 << 9, kDigestRange = 1 << 10;
constexpr int kDigestThreads = 256;
constexpr int kRecNone = 0, kRecSender = 1, kRecReceiver = 2;
constexpr int kTableReqToToken = 0, kTableVirtualPages = 1, kTableBlock = 2, kTablePagedKv = 3;

// The engine table (kvcanary_cupy/tables.py), mirrored by DIGEST_TABLE in digest/cuda.py.
struct DigestTable {
  u64 entries, indptr, v2p;  // device addresses (indptr: PAGED_KV; v2p: VIRTUAL_PAGES)
  i64 rows, cols, row_stride, nnz, v2p_len, page_size, null_block;
  int kind, entries_i64, indptr_i64, pad;
};

// The pool (KvLayout), mirrored by DIGEST_POOL.
struct DigestPool {
  u64 pointers;  // u64 [num_layers * halves]: the base address of each (local layer, half)
  i64 page_stride, token_stride, head_stride, num_pages, page_size;
  int strip_words, num_heads, num_layers, halves, layer_offset, head_offset;
};

// One call's requests, spec and outputs, mirrored by DIGEST_REQUESTS.
struct DigestRequests {
  u64 req_pool_indices, starts, ends, sample_keys, records, expected, valid_lens, seam, out, out_of_range;
  i64 bs, rec_num_slots, exp_rows, exp_cols, exp_row_stride, token_offset;
  u64 header, signature;
  int rec_fields, exp_i64, mode, num_layers_total, sample_layers, window_words;
};

__device__ __forceinline__ u64 digest_key(u64 layer, u64 half, u64 head, u64 pos) {
  return splitmix64(kDigestSeed ^ splitmix64(layer << 48 | half << 47 | head << 32 | pos));
}

__device__ __forceinline__ i64 page_slot_of(i64 id, i64 page_size, i64 pos) {
  return (id >= 0 && id < kSlotLimit / page_size) ? id * page_size + pos % page_size : -1;
}

// The page of slot (slot >= 0): a 32-bit division where both fit, the same
// quotient as the 64-bit one, which is a long subroutine call on the GPU.
__device__ __forceinline__ i64 page_of(i64 slot, i64 page_size) {
  if (((static_cast<u64>(slot) | static_cast<u64>(page_size)) >> 32) == 0)
    return static_cast<i64>(static_cast<unsigned>(slot) / static_cast<unsigned>(page_size));
  return slot / page_size;
}

struct RowInfo {
  bool ok;
  i64 base, length, pool_row;
};

__device__ __forceinline__ RowInfo row_info(const DigestTable& t, const DigestRequests& q, i64 b) {
  RowInfo r;
  if (t.kind == kTablePagedKv) {
    const i64 lo = load_index(reinterpret_cast<const void*>(t.indptr), t.indptr_i64, b);
    const i64 hi = load_index(reinterpret_cast<const void*>(t.indptr), t.indptr_i64, b + 1);
    r.ok = lo >= 0 && lo <= hi && hi <= t.nnz;
    r.base = lo;
    r.length = r.ok ? (hi - lo) * t.page_size : 0;
    r.pool_row = b;
  } else {
    const i64 rp = reinterpret_cast<const i64*>(q.req_pool_indices)[b];
    r.ok = rp >= 0 && rp < t.rows;
    r.base = rp;
    r.length = t.cols * (t.kind == kTableBlock ? t.page_size : 1);
    r.pool_row = rp;
  }
  return r;
}

// The slot of position pos (0 <= pos < the row's length) of a valid row, or -1 (reference.resolve_slots).
__device__ __forceinline__ i64 table_slot_of(const DigestTable& t, i64 base, i64 pos) {
  const void* e = reinterpret_cast<const void*>(t.entries);
  if (t.kind == kTableReqToToken) return load_index(e, t.entries_i64, base * t.row_stride + pos);
  if (t.kind == kTableVirtualPages) {
    const i64 v = load_index(e, t.entries_i64, base * t.row_stride + pos);
    if (v < 0) return -1;
    const i64 page = v / t.page_size;
    if (page >= t.v2p_len) return -1;
    return page_slot_of(reinterpret_cast<const i64*>(t.v2p)[page], t.page_size, v);
  }
  if (t.kind == kTableBlock) {
    const i64 id = load_index(e, t.entries_i64, base * t.row_stride + pos / t.page_size);
    return id == t.null_block ? -1 : page_slot_of(id, t.page_size, pos);
  }
  return page_slot_of(load_index(e, t.entries_i64, base + pos / t.page_size), t.page_size, pos);
}

__device__ __forceinline__ bool slot_ok(const DigestPool& pool, const DigestRequests& q, i64 slot) {
  return slot >= 0 && slot / pool.page_size < pool.num_pages && (q.records == 0 || slot < q.rec_num_slots);
}

__device__ __forceinline__ const i64* record_row(const DigestRequests& q, i64 slot) {
  return reinterpret_cast<const i64*>(q.records) + slot * q.rec_fields;
}

// Request b of a digest: its table row, its positions [start, end), its sampling key, and whether
// the row and range are valid (a request that is not is skipped by every kernel, counted by digest_init).
struct DigestRun {
  RowInfo row;
  i64 start, end;
  u64 key;
  bool ok;
};

__device__ __forceinline__ DigestRun digest_run(const DigestTable& t, const DigestRequests& q, i64 b) {
  DigestRun r;
  r.row = row_info(t, q, b);
  r.start = reinterpret_cast<const i64*>(q.starts)[b];
  r.end = reinterpret_cast<const i64*>(q.ends)[b];
  r.key = static_cast<u64>(reinterpret_cast<const i64*>(q.sample_keys)[b]);
  const i64 limit = r.row.length < kDigestMaxPosition ? r.row.length : kDigestMaxPosition;
  r.ok = r.row.ok && r.start >= 0 && r.start <= r.end && r.end <= limit;
  return r;
}

// The chain hash at start the provenance sum carries, and whether its lookup was out of range.
__device__ u64 seam_hash(const DigestTable& t, const DigestPool& pool, const DigestRequests& q, i64 b, const RowInfo& row,
                         i64 start, i64* skipped) {
  if (q.mode == kRecSender) {
    const i64 slot = table_slot_of(t, row.base, start);
    return slot_ok(pool, q, slot) ? static_cast<u64>(record_row(q, slot)[2]) : 0;
  }
  i64 seam;
  if (q.seam) {
    seam = reinterpret_cast<const i64*>(q.seam)[b];
  } else if (start == 0) {
    seam = -1;
  } else {
    seam = table_slot_of(t, row.base, start - 1);
    if (seam < 0) { *skipped += 1; return 0; }
  }
  if (seam == -1) return kAnchorHash;
  if (seam < 0 || seam >= q.rec_num_slots) { *skipped += 1; return 0; }
  const i64* r = record_row(q, seam);
  return mix3(static_cast<u64>(r[2]), static_cast<u64>(r[0]), static_cast<u64>(r[1]));
}

__global__ void digest_init(const __grid_constant__ DigestTable t, const __grid_constant__ DigestPool pool,
                            const __grid_constant__ DigestRequests q) {
  wait_for_prior_grids();
  const i64 b = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  i64 skipped = 0;
  if (b < q.bs) {
    const auto [row, start, end, key, ok] = digest_run(t, q, b);
    u64 rec = 0;
    if (!ok) {
      skipped = 1;
    } else if (start < end && q.mode != kRecNone) {
      const u64 prev = seam_hash(t, pool, q, b, row, start, &skipped);
      rec = splitmix64(prev ^ digest_key(kDigestRecLayer, 0, 1, static_cast<u64>(start)));
    }
    i64* out = reinterpret_cast<i64*>(q.out) + b * 8;
    out[0] = static_cast<i64>(q.header);
    out[1] = static_cast<i64>(q.signature);
    out[2] = static_cast<i64>(key);
    out[3] = start;
    out[4] = end;
    out[5] = 0;
    out[6] = static_cast<i64>(rec);
    out[7] = 0;
  }
  warp_add(reinterpret_cast<unsigned long long*>(q.out_of_range), skipped);
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(kFullMask, v, o);
  return v;
}

// How a warp's lanes share one half of one layer at one position: `per_pass` heads at a time,
// `group` lanes a head, lane (head h, sublane s) taking words s, s + group, ... of its head.  A
// lane then derives one key per head (two splitmix64) for all its words, and each load instruction
// reads `group` consecutive words of every head in the pass (32-byte sectors whole from group 4).
struct LaneShare {
  int head, sub, group, per_pass;
};

__device__ __forceinline__ LaneShare lane_share(int lane, int num_heads, int words) {
  int group = 4;  // aim at about 8 words a lane, sectors whole
  while (group < 32 && group * 8 < words) group *= 2;
  int per_pass = 32 / group;
  while (per_pass > 1 && per_pass > num_heads) {  // few heads: more lanes on each
    per_pass /= 2;
    group *= 2;
  }
  return LaneShare{lane / group, lane % group, group, per_pass};
}

// Blocks an SM holds of digest_accumulate: the word-pair path needs 80 registers on sm_90 (3
// blocks); sm_80's compiler spills at that bound, so it gets 2.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kDigestMinBlocks = 2;
#else
constexpr int kDigestMinBlocks = 3;
#endif

// Loads in flight per lane and half before their words are hashed.
constexpr int kDigestUnroll = 4;
// Candidate layers whose (layer, first window word) a block derives once per request, in shared
// memory; a spec sampling more derives them at each position.
constexpr int kDigestTableLayers = 128;

// What a spec samples of this pool, read once by either sampling kernel: the candidate layers (all
// of the pool's or sample_layers of the model's L) and the words of a head read (a window or the strip).
struct Sampling {
  unsigned L;
  bool all_layers, windowed;
  int candidates, nw;
};

__device__ __forceinline__ Sampling sampling(const DigestPool& pool, const DigestRequests& q) {
  Sampling s;
  s.L = static_cast<unsigned>(q.num_layers_total);
  s.all_layers = q.sample_layers == 0 || static_cast<unsigned>(q.sample_layers) >= s.L;
  s.candidates = s.all_layers ? pool.num_layers : q.sample_layers;
  s.windowed = q.window_words > 0 && q.window_words < pool.strip_words;
  s.nw = s.windowed ? q.window_words : pool.strip_words;
  return s;
}

// The request's first candidate layer (the sampled layers rotate with its key).
__device__ __forceinline__ unsigned first_layer(const Sampling& s, u64 key) {
  return s.all_layers ? 0u : static_cast<unsigned>(splitmix64(key ^ kDigestLayerRotation) % s.L);
}

// Candidate ci's global layer and first window word (w0: 0 unwindowed).
__device__ __forceinline__ void candidate(const DigestPool& pool, const DigestRequests& q, const Sampling& s,
                                          unsigned first, u64 key, unsigned ci, int* layer, int* w0) {
  *layer = static_cast<int>(s.all_layers ? pool.layer_offset + ci : (first + ci * s.L / q.sample_layers) % s.L);
  *w0 = 0;
  if (s.windowed) {
    const u64 pick = splitmix64(key ^ (static_cast<u64>(*layer + 1) * kDigestWordStride)) %
                     static_cast<u64>(pool.strip_words / q.window_words);
    *w0 = static_cast<int>(pick) * q.window_words;
  }
}

// The sum of this lane's words of one head in both halves (base[c]: the head's first word of the
// lane's first unit): units of V words, the lane's units sub, sub + group, ... below `units`;
// k[c]: its first word's key.  V = 2 reads a unit with one 16-byte load.
template <int V>
__device__ __forceinline__ u64 lane_head_sum(const unsigned char* const* base, int halves, int units,
                                             const LaneShare& share, u64 k0, u64 k1) {
  constexpr int U = kDigestUnroll / V;  // the same bytes in flight either way
  u64 sum = 0, k[2] = {k0, k1};
  const u64 step = static_cast<u64>(share.group) * V * kDigestWordStride;
  for (int j = share.sub; j < units; j += U * share.group) {
    u64 word[2][U][V];
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        const int ju = j + u * share.group;
        const bool valid = c < halves && ju < units;
        const unsigned char* at = base[c] + static_cast<i64>(ju - share.sub) * (8 * V);
        if (V == 2) {
          const ulonglong2 pair = valid ? *reinterpret_cast<const ulonglong2*>(at) : make_ulonglong2(0, 0);
          word[c][u][0] = pair.x;
          word[c][u][V - 1] = pair.y;
        } else {
          word[c][u][0] = valid ? *reinterpret_cast<const u64*>(at) : 0;
        }
      }
    }
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        if (c < halves && j + u * share.group < units) {
          #pragma unroll
          for (int v = 0; v < V; ++v) sum += splitmix64(word[c][u][v] ^ (k[c] + static_cast<u64>(v) * kDigestWordStride));
        }
        k[c] += step;
      }
    }
  }
  return sum;
}

// Grid (x: warps sharing a request, y: requests).  The warps stride over the request's positions;
// each position's slot is looked up once, its provenance terms added (and an out-of-range slot
// counted) once, then for each candidate layer (the local layers when every layer is sampled,
// else the spec's rotated layers, of which those outside this pool's layers add no KV) the lanes
// hash their words of both halves (LaneShare), the loads of a batch issued before its hashes.
// The word-pair LaneShare is derived once, not at every layer of every position, the two halves'
// bases stay in registers (an index by `halves` put them in local memory), and the slot's page is
// divided in 32 bits where it fits.
__global__ void __launch_bounds__(kDigestThreads, kDigestMinBlocks) digest_accumulate(const __grid_constant__ DigestTable t,
                                                                    const __grid_constant__ DigestPool pool,
                                                                    const __grid_constant__ DigestRequests q) {
  wait_for_prior_grids();
  __shared__ int table_layer[kDigestTableLayers], table_w0[kDigestTableLayers];
  const int lane = threadIdx.x & 31;
  const i64 warps = static_cast<i64>(gridDim.x) * (kDigestThreads / 32);
  const i64 warp = static_cast<i64>(blockIdx.x) * (kDigestThreads / 32) + (threadIdx.x >> 5);
  const u64* pointers = reinterpret_cast<const u64*>(pool.pointers);
  const Sampling smp = sampling(pool, q);
  const unsigned candidates = static_cast<unsigned>(smp.candidates);
  const bool tabled = candidates <= kDigestTableLayers;
  const int nw = smp.nw;
  const LaneShare share = lane_share(lane, pool.num_heads, nw);
  const int halves = pool.halves;
  // this lane's words of a head (sub, sub + group, ... below nw) and the key step between two of them
  const u64 lane_words = share.sub < nw ? static_cast<u64>((nw - share.sub + share.group - 1) / share.group) : 0;
  // heads of 16 words or more whose strides keep 16-byte alignment may be read a word pair a load
  const bool wide = nw % 2 == 0 && nw >= 16 && ((pool.head_stride | pool.page_stride | pool.token_stride) & 15) == 0;
  const LaneShare pair_share = lane_share(lane, pool.num_heads, nw / 2);
  const u64 pair_words = pair_share.sub < nw / 2 ? 2 * static_cast<u64>((nw / 2 - pair_share.sub + pair_share.group - 1) / pair_share.group) : 0;
  for (i64 b = blockIdx.y; b < q.bs; b += gridDim.y) {
    const auto [row, start, end, key, ok] = digest_run(t, q, b);
    if (!ok) continue;  // uniform across the block
    const unsigned first = first_layer(smp, key);
    if (tabled) {
      __syncthreads();  // the previous request's table is read no more
      for (unsigned ci = threadIdx.x; ci < candidates; ci += kDigestThreads)
        candidate(pool, q, smp, first, key, ci, &table_layer[ci], &table_w0[ci]);
      __syncthreads();
    }
    u64 kv = 0, words = 0, rec = 0;
    i64 skipped = 0;
    for (i64 p = start + warp; p < end; p += warps) {
      const i64 slot = table_slot_of(t, row.base, p);
      const i64 page = slot >= 0 ? page_of(slot, pool.page_size) : 0;
      if (!(slot >= 0 && page < pool.num_pages && (q.records == 0 || slot < q.rec_num_slots))) {  // slot_ok
        skipped += lane == 0;
        continue;
      }
      if (lane < 2 && q.mode != kRecNone) {  // lane 0 the token's term, lane 1 the position's
        i64 value = p;
        if (q.mode == kRecSender) {
          value = record_row(q, slot)[lane];
        } else if (lane == 0) {
          const i64 idx = p + q.token_offset;
          i64 limit = q.exp_cols;
          if (q.valid_lens) {
            const i64 v = reinterpret_cast<const i64*>(q.valid_lens)[b];
            limit = v < 0 ? 0 : (v < limit ? v : limit);
          }
          const bool known = idx >= 0 && idx < limit && row.pool_row >= 0 && row.pool_row < q.exp_rows;
          value = known ? load_index(reinterpret_cast<const void*>(q.expected), q.exp_i64, row.pool_row * q.exp_row_stride + idx) : -1;
        }
        rec += splitmix64(static_cast<u64>(value) ^ digest_key(kDigestRecLayer, static_cast<u64>(lane), 0, static_cast<u64>(p)));
      }
      const i64 tok = slot - page * pool.page_size;
      const i64 at = page * pool.page_stride + tok * pool.token_stride;
      for (unsigned ci = 0; ci < candidates; ++ci) {
        int layer, w0;
        if (tabled) {
          layer = table_layer[ci];
          w0 = table_w0[ci];
        } else {
          candidate(pool, q, smp, first, key, ci, &layer, &w0);
        }
        const int local = layer - pool.layer_offset;
        if (local < 0 || local >= pool.num_layers) continue;
        const unsigned char* layer_base[2];
        #pragma unroll
        for (int c = 0; c < 2; ++c)
          layer_base[c] = reinterpret_cast<const unsigned char*>(pointers[local * halves + (c < halves ? c : 0)]) + at + w0 * 8;
        // 16-byte loads where every word pair of the lane's heads is 16-byte aligned (uniform across the warp)
        const unsigned char* last_base = halves > 1 ? layer_base[1] : layer_base[0];
        const bool pairs = wide && ((reinterpret_cast<unsigned long long>(layer_base[0]) |
                                     reinterpret_cast<unsigned long long>(last_base)) & 15) == 0;
        const LaneShare s = pairs ? pair_share : share;
        const u64 counted = pairs ? pair_words : lane_words;
        for (int h = s.head; h < pool.num_heads; h += s.per_pass) {
          const int first_word = (pairs ? 2 : 1) * s.sub;
          const unsigned char* base[2];
          u64 k[2];  // the key of this lane's first word of head h in each half
          #pragma unroll
          for (int c = 0; c < 2; ++c) {
            base[c] = layer_base[c] + h * pool.head_stride + first_word * 8;
            k[c] = digest_key(static_cast<u64>(layer), static_cast<u64>(c), static_cast<u64>(pool.head_offset + h),
                              static_cast<u64>(p)) + static_cast<u64>(w0 + first_word) * kDigestWordStride;
          }
          kv += pairs ? lane_head_sum<2>(base, halves, nw / 2, s, k[0], k[1]) : lane_head_sum<1>(base, halves, nw, s, k[0], k[1]);
          words += counted * static_cast<u64>(halves);
        }
      }
    }
    kv = warp_sum(kv);
    words = warp_sum(words);
    rec = warp_sum(rec);
    unsigned long long* out = reinterpret_cast<unsigned long long*>(q.out) + b * 8;
    if (lane == 0) {
      if (kv) atomicAdd(out + 5, kv);
      if (rec) atomicAdd(out + 6, rec);
      if (words) atomicAdd(out + 7, words);
    }
    warp_add(reinterpret_cast<unsigned long long*>(q.out_of_range), skipped);
  }
}

// ---- The unit kernel: the sampled specs it takes (digest/cuda.py unit_words) ----
//
// digest_accumulate gives each (position, layer) to a warp whose lanes share heads: for the default
// spec (2 layers, 32-byte windows, 8 heads) every lane derives two keys (four splitmix64) to hash two
// words, and every lane repeats the position's slot lookup (a 64-bit division) and the per-layer
// address work.  Here a *unit* is one (candidate layer, half, head) of a position: its window's words
// (at most kUnitMaxWords) are read and hashed by one lane, which derives the unit's key once: for the
// default 1.5 splitmix64 a word instead of 3.  A warp takes a chunk of up to 32 positions: lane j
// resolves position j's slot, address and provenance terms, then the lanes walk the chunk's
// (position, unit) items, each taking the position's address from lane j by a shuffle.  The units'
// addresses (less the position's) and key coordinates are derived once per request into shared
// memory; each block adds its sums with one atomic per field.
constexpr int kUnitMaxUnits = 512;  // candidate layers x halves x heads a block tables
constexpr int kUnitMaxWords = 8;    // window words a lane reads and hashes for one unit

// One unit's nw words at `at` into word[] (zeros where !valid); kWords: nw fixed at compile time
// (0: any nw up to kUnitMaxWords), V: words a load (2: 16-byte loads).
template <int kWords, int V>
__device__ __forceinline__ void unit_load(const unsigned char* at, int nw, bool valid, u64* word) {
  constexpr int W = kWords ? kWords : kUnitMaxWords;
  #pragma unroll
  for (int w = 0; w < W; w += V) {
    const bool load = valid && (kWords || w < nw);
    if (V == 2) {
      const ulonglong2 pair = load ? *reinterpret_cast<const ulonglong2*>(at + 8 * w) : make_ulonglong2(0, 0);
      word[w] = pair.x;
      word[w + V - 1] = pair.y;
    } else {
      word[w] = load ? *reinterpret_cast<const u64*>(at + 8 * w) : 0;
    }
  }
}

// The sum of the hashes of a unit's nw words, its first word's key k.
template <int kWords>
__device__ __forceinline__ u64 unit_hash(const u64* word, int nw, u64 k) {
  constexpr int W = kWords ? kWords : kUnitMaxWords;
  u64 sum = 0;
  #pragma unroll
  for (int w = 0; w < W; ++w)
    if (kWords || w < nw) sum += splitmix64(word[w] ^ (k + static_cast<u64>(w) * kDigestWordStride));
  return sum;
}

// Adds each of the block's three sums to out[5 + i] with one atomic (all threads call).
__device__ __forceinline__ void block_add(u64 kv, u64 rec, u64 words, unsigned long long* out, u64 (*scratch)[kDigestThreads / 32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  kv = warp_sum(kv);
  rec = warp_sum(rec);
  words = warp_sum(words);
  if (lane == 0) {
    scratch[0][warp] = kv;
    scratch[1][warp] = rec;
    scratch[2][warp] = words;
  }
  __syncthreads();
  if (threadIdx.x < 3) {
    u64 total = 0;
    #pragma unroll
    for (int w = 0; w < kDigestThreads / 32; ++w) total += scratch[threadIdx.x][w];
    if (total) atomicAdd(out + 5 + (threadIdx.x == 0 ? 0 : threadIdx.x == 1 ? 1 : 2), total);
  }
  __syncthreads();  // scratch is read before the next request writes it
}

// Grid (x: blocks sharing a request, y: requests), one wave (digest/cuda.py).  kWords: the units'
// word count when fixed (4: the default 32-byte window), else 0.  A warp takes as many positions at a
// time as spread the request over the grid's warps, at most 32.  The host launches it
// only where candidates x halves x heads <= kUnitMaxUnits and the window (or strip) has at most
// kUnitMaxWords words.
template <int kWords>
__global__ void __launch_bounds__(kDigestThreads) digest_units(const __grid_constant__ DigestTable t,
                                                               const __grid_constant__ DigestPool pool,
                                                               const __grid_constant__ DigestRequests q) {
  wait_for_prior_grids();
  __shared__ u64 unit_at[kUnitMaxUnits];     // the unit's first word's address less the position's offset; 0: outside this pool
  __shared__ u64 unit_coord[kUnitMaxUnits];  // layer << 48 | half << 47 | head << 32 | first window word
  __shared__ u64 scratch[3][kDigestThreads / 32];
  __shared__ int aligned;
  const int lane = threadIdx.x & 31;
  const i64 warps = static_cast<i64>(gridDim.x) * (kDigestThreads / 32);
  const i64 warp = static_cast<i64>(blockIdx.x) * (kDigestThreads / 32) + (threadIdx.x >> 5);
  const u64* pointers = reinterpret_cast<const u64*>(pool.pointers);
  const Sampling smp = sampling(pool, q);
  const int nw = kWords ? kWords : smp.nw;
  const int halves = pool.halves, per_layer = halves * pool.num_heads;
  const int units = smp.candidates * per_layer;
  // lane's first item (position j0, unit u0) of a chunk, and the step to its next (32 items on)
  const int dj = 32 / units, du = 32 % units;
  const int j0 = lane / units, u0 = lane % units;
  for (i64 b = blockIdx.y; b < q.bs; b += gridDim.y) {
    const auto [row, start, end, key, ok] = digest_run(t, q, b);
    if (!ok) continue;  // uniform across the block
    const unsigned first = first_layer(smp, key);
    if (threadIdx.x == 0) aligned = ((pool.page_stride | pool.token_stride) & 15) == 0 && nw % 2 == 0;
    __syncthreads();  // the previous request's table is read no more; `aligned` is set
    int misaligned = 0;
    for (int u = threadIdx.x; u < units; u += kDigestThreads) {
      const int ci = u / per_layer, c = (u % per_layer) / pool.num_heads, h = u % pool.num_heads;
      int layer, w0;
      candidate(pool, q, smp, first, key, static_cast<unsigned>(ci), &layer, &w0);
      const int local = layer - pool.layer_offset;
      u64 at = 0;
      if (local >= 0 && local < pool.num_layers)
        at = pointers[local * halves + c] + static_cast<u64>(h * pool.head_stride + w0 * 8);
      misaligned |= static_cast<int>(at & 15);
      unit_at[u] = at;
      unit_coord[u] = static_cast<u64>(layer) << 48 | static_cast<u64>(c) << 47 |
                      static_cast<u64>(pool.head_offset + h) << 32 | static_cast<u64>(w0);
    }
    if (misaligned) aligned = 0;
    __syncthreads();
    const bool pairs = aligned != 0;  // 16-byte loads: every unit's words and every position's offset 16-byte aligned
    const i64 n = end - start;
    const i64 per_chunk = (n + warps - 1) / warps < 32 ? (n + warps - 1) / warps : 32;
    const int P = static_cast<int>(per_chunk < 1 ? 1 : per_chunk);
    u64 kv = 0, words = 0, rec = 0;
    i64 skipped = 0;
    for (i64 c0 = start + warp * P; c0 < end; c0 += warps * P) {
      const int np = static_cast<int>(end - c0 < P ? end - c0 : P);
      // lane j < np: position c0 + j's slot, offset in the pool and provenance terms
      i64 off = 0;
      bool ok = false;
      if (lane < np) {
        const i64 p = c0 + lane;
        const i64 slot = table_slot_of(t, row.base, p);
        const i64 page = slot >= 0 ? page_of(slot, pool.page_size) : 0;
        ok = slot >= 0 && page < pool.num_pages && (q.records == 0 || slot < q.rec_num_slots);
        if (!ok) {
          skipped += 1;
        } else {
          off = page * pool.page_stride + (slot - page * pool.page_size) * pool.token_stride;
          if (q.mode != kRecNone) {
            i64 token = -1, position = p;
            if (q.mode == kRecSender) {
              token = record_row(q, slot)[0];
              position = record_row(q, slot)[1];
            } else {
              const i64 idx = p + q.token_offset;
              i64 limit = q.exp_cols;
              if (q.valid_lens) {
                const i64 v = reinterpret_cast<const i64*>(q.valid_lens)[b];
                limit = v < 0 ? 0 : (v < limit ? v : limit);
              }
              if (idx >= 0 && idx < limit && row.pool_row >= 0 && row.pool_row < q.exp_rows)
                token = load_index(reinterpret_cast<const void*>(q.expected), q.exp_i64, row.pool_row * q.exp_row_stride + idx);
            }
            rec += splitmix64(static_cast<u64>(token) ^ digest_key(kDigestRecLayer, 0, 0, static_cast<u64>(p)));
            rec += splitmix64(static_cast<u64>(position) ^ digest_key(kDigestRecLayer, 1, 0, static_cast<u64>(p)));
          }
        }
      }
      const unsigned ok_mask = __ballot_sync(kFullMask, ok);
      // the chunk's items (position j, unit u), 32 at a time, lane l taking item l of each 32; I
      // items a lane per pass, all loaded before any is hashed (one of up to kUnitMaxWords words:
      // two would spill on sm_80)
      constexpr int I = kWords ? 2 : 1;
      int j = j0, u = u0;
      while (__any_sync(kFullMask, j < np)) {
        int jj[I], uu[I];
        #pragma unroll
        for (int i = 0; i < I; ++i) {
          jj[i] = j;
          uu[i] = u;
          j += dj;
          u += du;
          if (u >= units) {
            u -= units;
            ++j;
          }
        }
        constexpr int W = kWords ? kWords : kUnitMaxWords;
        u64 word[I][W], coord[I];
        bool valid[I];
        #pragma unroll
        for (int i = 0; i < I; ++i) {
          const bool in = jj[i] < np;
          const i64 at_off = __shfl_sync(kFullMask, off, in ? jj[i] : 0);
          const u64 base = in ? unit_at[uu[i]] : 0;
          valid[i] = in && (ok_mask >> jj[i] & 1) && base != 0;
          coord[i] = valid[i] ? unit_coord[uu[i]] : 0;
          const unsigned char* at = reinterpret_cast<const unsigned char*>(base) + at_off;
          if (pairs) {
            unit_load<kWords, 2>(at, nw, valid[i], word[i]);
          } else {
            unit_load<kWords, 1>(at, nw, valid[i], word[i]);
          }
        }
        #pragma unroll
        for (int i = 0; i < I; ++i) {
          if (valid[i]) {
            const u64 pk = (coord[i] & ~0xFFFFFFFFULL) | static_cast<u64>(c0 + jj[i]);
            const u64 k = splitmix64(kDigestSeed ^ splitmix64(pk)) + (coord[i] & 0xFFFFFFFFULL) * kDigestWordStride;
            kv += unit_hash<kWords>(word[i], nw, k);
            words += static_cast<u64>(nw);
          }
        }
      }
    }
    block_add(kv, rec, words, reinterpret_cast<unsigned long long*>(q.out) + b * 8, scratch);
    warp_add(reinterpret_cast<unsigned long long*>(q.out_of_range), skipped);
  }
}

__device__ __forceinline__ bool record_present(i64 header) {
  const u64 h = static_cast<u64>(header);
  return (h & 0xFFFFFFFFULL) == kDigestMagic && ((h >> 48) & kFlagPresent) != 0;
}

// Row b of expected vs actual (int64 [n, 8] record rows): the verdict code into out[b] and, when
// it is not MATCH, a violation row (reference.verdicts / reference.verify).
__global__ void digest_verify(const i64* __restrict__ expected, const i64* __restrict__ actual, i64 n,
                              int* __restrict__ out, const __grid_constant__ LaunchLog log, int kind) {
  wait_for_prior_grids();
  const i64 b = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool valid = b < n;
  // both rows loaded before any test: the tests below short-circuit, and loads behind them would
  // each wait for the one before
  i64 e[8], x[8];
  #pragma unroll
  for (int i = 0; i < 8; ++i) {
    e[i] = valid ? expected[b * 8 + i] : 0;
    x[i] = valid ? actual[b * 8 + i] : 0;
  }
  int code = 0;
  i64 bits = 0;
  if (valid) {
    const u64 good = kDigestMagic | kDigestVersion << 32, mask = (1ULL << 48) - 1;
    const bool missing = !record_present(e[0]) || !record_present(x[0]) || e[7] == 0 || x[7] == 0;
    const bool version = (static_cast<u64>(e[0]) & mask) != good || (static_cast<u64>(x[0]) & mask) != good || e[1] != x[1];
    const bool range = e[2] != x[2] || e[3] != x[3] || e[4] != x[4];
    const bool kv = e[5] != x[5] || e[7] != x[7], rec = e[6] != x[6];
    if (missing) {
      code = 3; bits = kDigestMissing;
    } else if (version || range) {
      code = 4; bits = kDigestIncomparable | (range ? kDigestRange : 0);
    } else {
      bits = (kv ? kDigestMismatchKv : 0) | (rec ? kDigestMismatchRec : 0);
      code = kv ? 1 : rec ? 2 : 0;
    }
    out[b] = code;
  }
  const bool hit = valid && code != 0;
  log.append_rows(hit, kind, -1 - b, x[3], x[4], x[7], x[5], e[5], bits);
  warp_add(log.violation_counters + kind, hit);
  warp_add(log.slot_run_counters + kind, valid);
  if (b == 0) atomicAdd(log.kernel_run_counters + kind, 1ULL);
}

}  // namespace kvcanary
