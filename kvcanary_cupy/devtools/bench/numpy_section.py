"""``kvcanary bench --backend numpy``: the NumPy backend's plan, verify and write, each against a
memory floor measured in the same run (issue 31, target 4).

Every op is the free function (``kc.plan``, ``kc.verify``, ``kc.write``: the front door's checks
included), timed in CPU time of the calling thread (a neighbour that takes the core does not count;
one that shares the caches does) and in wall-clock time; the write (a serial chain along each
request) gets no floor.  The floors are what NumPy itself takes to touch the bytes the op
must touch, in the op's access pattern, timed in the same rounds as the op:

* plan: it must read each request's table run (4 bytes an entry) and write four int64 arrays
  an entry (slot, predecessor, position, expected token; the per-request arrays, a few KB, are not
  counted).  Floor = the table runs widened into one int64 array (``np.copyto`` int32 -> int64,
  the only stream that reads), then the other three arrays' bytes written (``fill`` of an int64
  array of three times the entries: NumPy's write-only bandwidth), in one timed call so that its
  bytes share the caches as the plan's do.  Beside it, the issue's plainer
  floor: ``np.copyto`` of an int64 array of half the plan's bytes (reads + writes = its bytes).
* verify: it must gather each entry's 32-byte record at a slot of a random permutation (the
  predecessor's record is the entry before's, read once) and read the predecessor and position
  of each entry (and its token, with check_expected_token); floor = the faster of ``np.take`` of
  the plan's own slots into one array of records and the same take in cache-sized chunks
  (mode="clip": mode="raise" buffers), plus a read of the two streamed arrays (``max``: NumPy's
  read-only bandwidth).  Beside it: the chain hash alone (mix3 of every gathered record, the
  backend's own 26 in-place passes), compute the verify cannot skip and no memory floor counts.

Rounds take the op and its floor's pieces in turn (the machine is shared: neighbours load the CPU
and its caches as much for one as for the other); each figure is the median over the rounds, in
two conditions: warm (each timed call follows an untimed call of itself, so its bytes are in the
caches as far as they fit) and cold (each timed call follows a 64 MiB sweep that evicts them, as a
model's forward pass does between two steps of a serving loop).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.backends import numpy_fast
from .workloads import WORKLOADS, build

ROUNDS = 21
WRITE_ROUNDS = 5
SWEEP_BYTES = 64 << 20  # twice the L3 of the 2-core development host


def numpy_ops(d):
    vcap = d["total_verify"]
    vp, wp = kc.VerifyPlan.allocate(vcap), kc.WritePlan.allocate(d["bs"])
    log = kc.ViolationLog.allocate(1024)
    ops = {
        "plan": lambda: kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=vcap, out=(vp, wp)),
        "verify": lambda: kc.verify(d["canary"], vp, log=log),
        "write": lambda: kc.write(d["canary"], wp, d["ids"], d["pos"], d["loc"], log=log),
    }
    return ops, vp, log


def plan_bytes(d) -> int:
    """The plan's bytes: rp, prefix and extend read, the table runs read, four int64 arrays an entry
    and three a request written."""
    v, bs = d["total_verify"], d["bs"]
    return bs * 3 * 8 + v * 4 + v * 4 * 8 + bs * 3 * 8


def _plan_floor(n: int):
    """The plan's floor as one call: ``n`` int32 widened into int64 (``np.copyto``: the table runs
    into the slots), then ``3 n`` int64 written (``fill``: nothing read), so that its bytes are in
    the caches together, as the plan's are."""
    src, dst, rest = np.ones(max(n, 1), np.int32), np.empty(max(n, 1), np.int64), np.empty(max(3 * n, 1), np.int64)

    def run():
        np.copyto(dst, src)
        rest.fill(-1)

    return run


def _reader(n: int):
    """``max`` of ``n`` int64: read bytes, nothing written."""
    src = np.ones(max(n, 1), np.int64)
    return lambda: src.max()


def _copier(nbytes: int):
    """``np.copyto`` of an int64 array of ``nbytes / 2`` bytes: it reads and writes ``nbytes``."""
    src = np.ones(max(nbytes // 16, 1), np.int64)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def _gathers(canary, slots):
    """The gather floor's two forms: one take into an array of every record, and the same in
    chunks of numpy_fast.VERIFY_CHUNK into a cache-sized buffer."""
    whole = np.empty((slots.shape[0], canary.shape[1]), canary.dtype)
    chunk = numpy_fast.VERIFY_CHUNK
    part = np.empty((min(chunk, slots.shape[0]), canary.shape[1]), canary.dtype)

    def chunked():
        for lo in range(0, slots.shape[0], chunk):
            piece = slots[lo : lo + chunk]
            np.take(canary, piece, axis=0, out=part[: piece.shape[0]], mode="clip")

    return (lambda: np.take(canary, slots, axis=0, out=whole, mode="clip")), chunked


def _hasher(canary, slots):
    """The chain hash of every record, chunk by chunk, on records gathered beforehand."""
    chunk = numpy_fast.VERIFY_CHUNK
    records = canary[slots].view(np.uint64)
    hashes, scratch = np.empty(chunk, np.uint64), np.empty(chunk, np.uint64)

    def run():
        for lo in range(0, records.shape[0], chunk):
            part = records[lo : lo + chunk]
            numpy_fast.record_hashes(part, hashes[: part.shape[0]], scratch[: part.shape[0]])

    return run


def time_rounds(fns: dict, rounds: int = ROUNDS, cold: bool = False) -> tuple:
    """``(cpu, wall)``: median ms of each of ``fns`` (name -> fn) in CPU time of the calling thread
    and in wall-clock time, the calls taken in turn, round by round; warm: each timed call right
    after an untimed one, cold: right after a sweep of the caches."""
    sweep = np.zeros(SWEEP_BYTES // 8, np.int64) if cold else None
    cpu, wall = {name: [] for name in fns}, {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if cold:
                sweep += 1
            else:
                fn()
            c0, t0 = time.thread_time(), time.perf_counter()
            fn()
            wall[name].append((time.perf_counter() - t0) * 1e3)
            cpu[name].append((time.thread_time() - c0) * 1e3)
    return tuple({name: statistics.median(t) for name, t in times.items()} for times in (cpu, wall))


def legend(rounds: int) -> list:
    return [
        f"NumPy backend (CPU): ms of CPU time of the free function (wall ms beside it), median of {rounds} rounds, warm and",
        "cold caches; floor = NumPy touching the bytes the op must touch, timed in the same rounds (ratios of CPU times):",
        "  plan: the table runs widened into int64 (np.copyto int32 -> int64) + the other three int64 arrays an entry",
        "        written (fill); in brackets the plainer floor, np.copyto moving as many bytes as the plan touches",
        "  verify: np.take of the plan's slots (32-byte records in random order; the faster of one take and chunked takes)",
        "          + a read (max) of the predecessors and positions; 'hash': mix3 of every record alone (compute:",
        "          no memory floor counts it), and the verify against floor + hash",
        f"{'workload':<16} {'op':<7} {'caches':<6} {'cpu ms':>8} {'wall ms':>8} {'floor ms':>9} {'x floor':>8} "
        f"{'hash ms':>8} {'x fl+hash':>9} {'entries':>8}  floor counts",
    ]


def _floors(d, ms) -> dict:
    """op -> (floor ms, what it counts) from the rounds' medians ``ms``."""
    v = d["total_verify"]
    take = min(ms["take"], ms["take chunked"])
    how = "chunked" if ms["take chunked"] < ms["take"] else "one take"
    return {
        "plan": (ms["plan floor"], f"{v * 4 / 1e6:.1f} MB widened to {v * 8 / 1e6:.1f} + {v * 24 / 1e6:.1f} MB written "
                                   f"(np.copyto of {plan_bytes(d) / 1e6:.1f} MB: {ms['plan copy']:.2f} ms)"),
        "verify": (take + ms["streams"], f"take of {v:,} records {take:.2f} ms ({how}) + "
                                         f"{v * 16 / 1e6:.1f} MB read {ms['streams']:.2f} ms"),
    }


def run_numpy(names, rows: list, rounds: int = ROUNDS):
    lines = legend(rounds)
    for key in names:
        d = build(WORKLOADS[key], np)
        ops, vp, _ = numpy_ops(d)
        ops["plan"]()
        v = d["total_verify"]
        slots = np.array(vp.verify_slot_indices[: int(vp.verify_num_valid[0])])
        whole, chunked = _gathers(d["canary"], slots)
        fns = {"plan": ops["plan"], "plan floor": _plan_floor(v), "plan copy": _copier(plan_bytes(d)),
               "verify": ops["verify"], "take": whole, "take chunked": chunked, "streams": _reader(2 * v),
               "hash": _hasher(d["canary"], slots)}
        for caches in ("warm", "cold"):
            ms, wall = time_rounds(fns, rounds, cold=caches == "cold")
            floors = _floors(d, ms)
            for op in ("plan", "verify"):
                floor, counts = floors.get(op, (None, ""))
                row = {"workload": key, "op": op, "caches": caches, "cpu_ms": round(ms[op], 3),
                       "wall_ms": round(wall[op], 3), "verify_entries": v}
                cells = f"{'-':>9} {'-':>8}"
                if floor is not None:
                    row.update(floor_ms=round(floor, 3), x_floor=round(ms[op] / floor, 2), floor_counts=counts)
                    if op == "plan":
                        row.update(copy_floor_ms=round(ms["plan copy"], 3), x_copy_floor=round(ms[op] / ms["plan copy"], 2))
                    cells = f"{floor:>9.3f} {ms[op] / floor:>7.2f}x"
                extra = f"{'-':>8} {'-':>9}"
                if op == "verify":
                    row.update(hash_ms=round(ms["hash"], 3), x_floor_and_hash=round(ms[op] / (floor + ms["hash"]), 2))
                    extra = f"{ms['hash']:>8.3f} {ms[op] / (floor + ms['hash']):>8.2f}x"
                rows.append(row)
                lines.append(f"{WORKLOADS[key].name:<16} {op:<7} {caches:<6} {ms[op]:>8.3f} {wall[op]:>8.3f} {cells} {extra} "
                             f"{v:>8}  {counts}")
        # The write (a serial chain per request: W2's takes a quarter second) has no floor here.
        cpu, wall = (t["write"] for t in time_rounds({"write": ops["write"]}, WRITE_ROUNDS))
        rows.append({"workload": key, "op": "write", "caches": "warm", "cpu_ms": round(cpu, 3), "wall_ms": round(wall, 3),
                     "verify_entries": v})
        lines.append(f"{WORKLOADS[key].name:<16} {'write':<7} {'warm':<6} {cpu:>8.3f} {wall:>8.3f} {'-':>9} {'-':>8} {'-':>8} "
                     f"{'-':>9} {v:>8}")
    return lines
