"""The digest kernels of ``kernels/digest.cu`` run on the CPU: their byte check without a GPU.

``digest.cu`` (its headers inlined, as NVRTC gets it) is compiled with g++ under a small shim: the
CUDA qualifiers become plain C++, a block is its threads as host threads (``std::thread``), and
``__syncthreads`` and the warp intrinsics (``__shfl_sync``, ``__shfl_down_sync``, ``__ballot_sync``,
``__any_sync``) are barriers over the block's or the warp's threads, so every lane computes what it
would on the device and the kernels' integer sums come out as the GPU's.  The launches it runs are
the ones the fake device (:mod:`kvcanary_cupy.devtools.fake_cupy`) recorded, argument bytes and
grid as the library built them; the fake device's arrays are host memory, so the addresses in the
parameter records are real.  It tests the kernels' logic (index maths, keys, lane split, sums, the
verdicts), not what only a GPU shows (memory ordering, timing); only warp-uniform intrinsics are
emulated, as the digest kernels use them.  Needs g++ with C++20 (``std::barrier``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile

SHIM = r"""
#include <atomic>
#include <barrier>
#include <cstring>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __shared__ static
#define __launch_bounds__(...)
struct dim3_ { unsigned x = 0, y = 0, z = 0; };
static thread_local dim3_ threadIdx, blockIdx;
static dim3_ blockDim, gridDim;
struct ulonglong2 { unsigned long long x, y; };
static inline ulonglong2 make_ulonglong2(unsigned long long x, unsigned long long y) { return ulonglong2{x, y}; }
struct longlong2 { long long x, y; };
static inline longlong2 make_longlong2(long long x, long long y) { return longlong2{x, y}; }
struct EmuBlock {
  std::barrier<>* block;
  std::barrier<>* warp[32];
  unsigned long long slot[1024];
};
static EmuBlock emu;
static inline void __syncthreads() { emu.block->arrive_and_wait(); }
template <class T> static inline T emu_exchange(T v, int src) {
  const int me = threadIdx.x, base = me & ~31;
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  emu.slot[me] = bits;
  emu.warp[me >> 5]->arrive_and_wait();
  const unsigned long long got = emu.slot[base + (src & 31)];
  emu.warp[me >> 5]->arrive_and_wait();
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}
template <class T> static inline T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, src); }
template <class T> static inline T __shfl_down_sync(unsigned, T v, int delta) {
  const int lane = threadIdx.x & 31;
  const T got = emu_exchange(v, lane + delta < 32 ? lane + delta : lane);
  return got;
}
static inline unsigned __ballot_sync(unsigned, bool p) {
  const int me = threadIdx.x, base = me & ~31;
  emu.slot[me] = p ? 1 : 0;
  emu.warp[me >> 5]->arrive_and_wait();
  unsigned mask = 0;
  for (int i = 0; i < 32; ++i) mask |= static_cast<unsigned>(emu.slot[base + i]) << i;
  emu.warp[me >> 5]->arrive_and_wait();
  return mask;
}
static inline bool __any_sync(unsigned m, bool p) { return __ballot_sync(m, p) != 0; }
static inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
template <class T, class V> static inline T atomicAdd(T* p, V v) { return __atomic_fetch_add(p, static_cast<T>(v), __ATOMIC_SEQ_CST); }
template <class T, class V> static inline T atomicMin(T* p, V value) {
  const T v = static_cast<T>(value);
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
  return old;
}
"""

#: The kernels of the family taking (DigestTable, DigestPool, DigestRequests), by launch name.
RECORD_KERNELS = ("digest_init", "digest_accumulate", "digest_units<4>", "digest_units<0>")

LAUNCHER = r"""
using EmuKernel = void (*)(kvcanary::DigestTable, kvcanary::DigestPool, kvcanary::DigestRequests);
static const EmuKernel emu_kernels[] = {KERNEL_LIST};
template <class Body> static int emu_run(unsigned gx, unsigned gy, unsigned threads, Body body) {
  if (threads % 32 || threads > 1024) return 1;
  std::barrier<> block(threads);
  std::vector<std::barrier<>*> warps;
  for (unsigned w = 0; w < threads / 32; ++w) warps.push_back(new std::barrier<>(32));
  emu.block = &block;
  for (unsigned w = 0; w < threads / 32; ++w) emu.warp[w] = warps[w];
  blockDim = dim3_{threads, 1, 1};
  gridDim = dim3_{gx, gy, 1};
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < threads; ++i)
    pool.emplace_back([&, i] {
      threadIdx = dim3_{i, 0, 0};
      for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
          blockIdx = dim3_{bx, by, 0};
          body();
          block.arrive_and_wait();  // the next block starts once this one is done
        }
    });
  for (auto& th : pool) th.join();
  for (auto* w : warps) delete w;
  return 0;
}
extern "C" int kv_emulate(int id, unsigned gx, unsigned gy, unsigned threads, const void* t, const void* p, const void* q) {
  kvcanary::DigestTable tt; kvcanary::DigestPool pp; kvcanary::DigestRequests qq;
  std::memcpy(&tt, t, sizeof tt); std::memcpy(&pp, p, sizeof pp); std::memcpy(&qq, q, sizeof qq);
  return emu_run(gx, gy, threads, [&] { emu_kernels[id](tt, pp, qq); });
}
extern "C" int kv_emulate_verify(unsigned gx, unsigned threads, const void* expected, const void* actual, const void* n,
                                 const void* out, const void* log, const void* kind) {
  const long long *e, *a; long long count; int* o; kvcanary::LaunchLog lg; int k;
  std::memcpy(&e, expected, sizeof e); std::memcpy(&a, actual, sizeof a); std::memcpy(&count, n, sizeof count);
  std::memcpy(&o, out, sizeof o); std::memcpy(&lg, log, sizeof lg); std::memcpy(&k, kind, sizeof k);
  return emu_run(gx, 1, threads, [&] { kvcanary::digest_verify(e, a, count, o, lg, k); });
}
"""


_BUILD_DIR = None


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """digest.cu built for the CPU once a process (g++ -O2); a RuntimeError naming what failed."""
    from ..backends.cuda import compile as cuda_compile

    if shutil.which("g++") is None:
        raise RuntimeError("the digest emulator needs g++ (C++20), which is not on PATH")
    kernels = ", ".join(f"kvcanary::{k}" for k in RECORD_KERNELS)
    source = SHIM + cuda_compile.family_source("digest") + LAUNCHER.replace("KERNEL_LIST", kernels)
    global _BUILD_DIR
    _BUILD_DIR = tempfile.TemporaryDirectory(prefix="kvcanary-digest-emu-")  # removed at exit, the library loaded till then
    src, lib = os.path.join(_BUILD_DIR.name, "digest_emu.cpp"), os.path.join(_BUILD_DIR.name, "digest_emu.so")
    with open(src, "w", encoding="utf-8") as f:
        f.write(source)
    built = subprocess.run(["g++", "-O2", "-std=c++20", "-pthread", "-shared", "-fPIC", "-w", "-o", lib, src],
                           capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"the digest emulator did not build: {built.stderr.strip().splitlines()[-1:]}")
    library = ctypes.CDLL(lib)
    library.kv_emulate.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint] + [ctypes.c_char_p] * 3
    library.kv_emulate_verify.argtypes = [ctypes.c_uint, ctypes.c_uint] + [ctypes.c_char_p] * 6
    return library


class Emulator:
    """Runs a fake device's recorded digest launches on the CPU, in order (:meth:`run_pending`).

    ``caps``: the accumulating kernels stride over their requests' positions and requests by the
    grid, so they give the same bytes on any grid; each of their launches runs on x blocks capped
    at the next of ``caps`` in turn (None: the launch's own), which keeps blocks of barrier-bound
    host threads affordable on a small host and tries each kernel on several grids (and so, for
    digest_units, on several chunk lengths).  digest_init and digest_verify run their own grids."""

    def __init__(self, device, caps=(1, 3, 16, None)):
        self._device, self._caps, self._turn = device, tuple(caps), 0
        self._lib = _library()

    def run_pending(self) -> None:
        """Run, then forget, every launch the fake device recorded since the last call."""
        launches = list(self._device.launches)
        self._device.launches.clear()
        for launch in launches:
            self.run(launch)

    def run(self, launch) -> None:
        """Run one recorded launch (one of the digest family's kernels)."""
        name = launch.name.removeprefix("kvcanary::")
        gx, gy = (tuple(launch.grid) + (1, 1))[:2]
        if name == "digest_verify":
            status = self._lib.kv_emulate_verify(gx, launch.block[0], *launch.args)
        elif name in RECORD_KERNELS:
            if name != "digest_init" and self._caps:
                cap = self._caps[self._turn % len(self._caps)]
                self._turn += 1
                gx = gx if cap is None else min(gx, cap)
            status = self._lib.kv_emulate(RECORD_KERNELS.index(name), gx, gy, launch.block[0], *launch.args)
        else:
            raise ValueError(f"launch {launch.name!r}: the emulator runs digest_verify and {', '.join(RECORD_KERNELS)}")
        if status:
            raise ValueError(f"launch {launch.name!r}: a block of {launch.block[0]} threads is not emulated")
