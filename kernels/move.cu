// move_pages: the canary rows of KV pages move with the pages (compaction, defragmentation).
//
// The result equals rows = canary[src]; canary[src] = 0; canary[dst] = rows, whole pages at a
// time, also when the source and destination pages overlap (a permutation).  Three launches on
// one stream give the three steps their order without a grid-wide barrier: move_gather copies
// every moved page into a staging area, move_clear zeroes the source pages, move_scatter writes
// the staged pages to their destinations.  Within each launch every element is read or written
// by one thread only.  A pair with a page id outside [0, num_pages) is skipped (and counted once
// per bad id by move_gather).  Each kernel strides over element e of the staging area: pair
// e / page_elems, element e % page_elems of its page (a page is page_elems contiguous int64).
#include "canary_common.cuh"

namespace kvcanary {

struct MovePair {
  i64 src, dst;
  bool ok;
};

__device__ __forceinline__ MovePair move_pair(const void* src_pages, const void* dst_pages, int ids_are_int64, i64 pair,
                                              i64 num_pages) {
  const i64 src = load_index(src_pages, ids_are_int64, pair), dst = load_index(dst_pages, ids_are_int64, pair);
  return {src, dst, src >= 0 && src < num_pages && dst >= 0 && dst < num_pages};
}

__global__ void move_gather(const i64* __restrict__ canary, i64 num_pages, i64 page_elems, const void* src_pages,
                            const void* dst_pages, int ids_are_int64, i64 num_pairs, i64* __restrict__ staging,
                            unsigned long long* out_of_range_count) {
  wait_for_prior_grids();
  i64 errors = 0;
  for (i64 e = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; e < num_pairs * page_elems;
       e += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 pair = e / page_elems, w = e - pair * page_elems;
    const MovePair m = move_pair(src_pages, dst_pages, ids_are_int64, pair, num_pages);
    if (w == 0) errors += !(m.src >= 0 && m.src < num_pages) + !(m.dst >= 0 && m.dst < num_pages);
    if (m.ok) staging[e] = canary[m.src * page_elems + w];
  }
  if (out_of_range_count) warp_add(out_of_range_count, errors);
}

__global__ void move_clear(i64* __restrict__ canary, i64 num_pages, i64 page_elems, const void* src_pages,
                           const void* dst_pages, int ids_are_int64, i64 num_pairs) {
  wait_for_prior_grids();
  for (i64 e = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; e < num_pairs * page_elems;
       e += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 pair = e / page_elems, w = e - pair * page_elems;
    const MovePair m = move_pair(src_pages, dst_pages, ids_are_int64, pair, num_pages);
    if (m.ok) canary[m.src * page_elems + w] = 0;
  }
}

__global__ void move_scatter(i64* __restrict__ canary, i64 num_pages, i64 page_elems, const void* src_pages,
                             const void* dst_pages, int ids_are_int64, i64 num_pairs, const i64* __restrict__ staging) {
  wait_for_prior_grids();
  for (i64 e = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; e < num_pairs * page_elems;
       e += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 pair = e / page_elems, w = e - pair * page_elems;
    const MovePair m = move_pair(src_pages, dst_pages, ids_are_int64, pair, num_pages);
    if (m.ok) canary[m.dst * page_elems + w] = staging[e];
  }
}

}  // namespace kvcanary

// copy_pages: the canary rows of KV pages copied to other pages, of the same canary buffer or of
// another one (forks, copy-on-write, offload and reload).  The result equals rows = src[src_pages];
// dst[dst_pages] = rows, whole pages at a time: copy_gather stages every copied page, then
// copy_scatter writes them, so a destination that is also a source copies the rows from before
// the call.  Source ids are checked against the source buffer's whole pages, destination ids
// against the destination's; a pair with either out of range is skipped (each bad id counted once).
namespace kvcanary {

__device__ __forceinline__ MovePair copy_pair(const void* src_pages, const void* dst_pages, int ids_are_int64, i64 pair,
                                              i64 src_num_pages, i64 dst_num_pages) {
  const i64 src = load_index(src_pages, ids_are_int64, pair), dst = load_index(dst_pages, ids_are_int64, pair);
  return {src, dst, src >= 0 && src < src_num_pages && dst >= 0 && dst < dst_num_pages};
}

__global__ void copy_gather(const i64* __restrict__ src_canary, i64 src_num_pages, i64 dst_num_pages, i64 page_elems,
                            const void* src_pages, const void* dst_pages, int ids_are_int64, i64 num_pairs,
                            i64* __restrict__ staging, unsigned long long* out_of_range_count) {
  wait_for_prior_grids();
  i64 errors = 0;
  for (i64 e = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; e < num_pairs * page_elems;
       e += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 pair = e / page_elems, w = e - pair * page_elems;
    const MovePair m = copy_pair(src_pages, dst_pages, ids_are_int64, pair, src_num_pages, dst_num_pages);
    if (w == 0) errors += !(m.src >= 0 && m.src < src_num_pages) + !(m.dst >= 0 && m.dst < dst_num_pages);
    if (m.ok) staging[e] = src_canary[m.src * page_elems + w];
  }
  if (out_of_range_count) warp_add(out_of_range_count, errors);
}

__global__ void copy_scatter(i64* __restrict__ dst_canary, i64 src_num_pages, i64 dst_num_pages, i64 page_elems,
                             const void* src_pages, const void* dst_pages, int ids_are_int64, i64 num_pairs,
                             const i64* __restrict__ staging) {
  wait_for_prior_grids();
  for (i64 e = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; e < num_pairs * page_elems;
       e += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 pair = e / page_elems, w = e - pair * page_elems;
    const MovePair m = copy_pair(src_pages, dst_pages, ids_are_int64, pair, src_num_pages, dst_num_pages);
    if (m.ok) dst_canary[m.dst * page_elems + w] = staging[e];
  }
}

}  // namespace kvcanary
