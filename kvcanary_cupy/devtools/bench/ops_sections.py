"""The ``ops`` and ``detail`` sections: plan, verify and write against vectorised CuPy and their floors."""

from __future__ import annotations

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.hashing import ANCHOR_HASH
from .workloads import LEGACY_BLOCKS_PER_SM, PLAN_TARGET_US, PLAN_TARGET_X_FLOOR, SGLANG_US, WORKLOADS, build, op_bytes
from .timing import copy_bandwidth, time_eager, time_graph


def baseline_plan(cupy, d):
    """The plan as vectorised CuPy ops: cumsum, a host read of the total, searchsorted, gathers."""
    rp, prefix, rtt = d["rp"], d["prefix"], d["rtt"]
    vlen = cupy.where(rp != 0, prefix, 0)
    incl = cupy.cumsum(vlen)
    total = int(incl[-1])
    t = cupy.arange(total)
    owner = cupy.searchsorted(incl, t, side="right")
    pos = t - (incl[owner] - vlen[owner])
    row = rp[owner]
    slot = rtt[row, pos].astype(cupy.int64)
    prev = cupy.where(pos > 0, rtt[row, cupy.maximum(pos - 1, 0)], -1).astype(cupy.int64)
    woff = cupy.concatenate([cupy.zeros(1, cupy.int64), cupy.cumsum(d["extend"])])
    seed = rtt[rp, cupy.maximum(prefix - 1, 0)]
    return slot, prev, pos, woff, seed


def baseline_verify(cupy, canary, slot, prev, pos):
    """The verify as vectorised CuPy ops (uint64 SplitMix64 elementwise), rows via nonzero."""
    def sm(x):
        x = x ^ (x >> 30); x = x * cupy.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> 27); x = x * cupy.uint64(0x94D049BB133111EB)
        return x ^ (x >> 31)
    u = canary.view(cupy.uint64)
    rec, pr = u[slot], u[cupy.maximum(prev, 0)]
    expected = cupy.where(prev < 0, cupy.uint64(ANCHOR_HASH), sm(sm(sm(pr[:, 2]) ^ pr[:, 0]) ^ pr[:, 1]))
    bits = (rec[:, 2] != expected).astype(cupy.int64) | ((canary[slot, 1] != pos).astype(cupy.int64) << 1)
    return cupy.nonzero(bits)[0]


def gpu_ops(cupy, d):
    """The timed calls of one workload, on fixed buffers (plan[offsets]: the batch scan alone,
    as a plan into a zero-capacity VerifyPlan expands no entry)."""
    vcap = d["total_verify"]
    vp = kc.VerifyPlan.allocate(vcap, like=d["rp"])
    vp_empty = kc.VerifyPlan.allocate(0, like=d["rp"])
    wp = kc.WritePlan.allocate(d["bs"], like=d["rp"])
    log = kc.ViolationLog.allocate(1024, like=d["rp"])
    inputs = (d["rp"], d["prefix"], d["extend"], d["rtt"])
    ops = {
        "plan": lambda: kc.plan(*inputs, verify_capacity=vcap, out=(vp, wp)),
        "plan[offsets]": lambda: kc.plan(*inputs, verify_capacity=0, out=(vp_empty, wp)),
        "verify": lambda: kc.verify(d["canary"], vp, log=log),
        "write": lambda: kc.write(d["canary"], wp, d["ids"], d["pos"], d["loc"], log=log),
    }
    ops["plan"]()
    ops["verify"]()
    if int(log.write_index[0]) != 0:
        raise RuntimeError("the benchmark's canary must verify clean")
    return ops


def cell(value, fmt):
    """``format(value, fmt)``, or a dash of the same width for a missing value."""
    return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0]))


def run_gpu(names, rows: list):
    import cupy

    kc.warmup()
    bw = copy_bandwidth(cupy)
    tiny = cupy.zeros(1, cupy.int32)
    one_launch = time_graph(cupy, lambda: tiny.fill(0))
    rows.append({"copy_bandwidth_tb_s": round(bw / 1e12, 3), "one_launch_us": round(one_launch, 3)})
    lines = [
        f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write); one tiny kernel in a graph {one_launch:.2f} us",
        f"{'workload':<16} {'op':<13} {'device us':>10} {'us-1launch':>10} {'MB moved':>9} {'floor us':>9} "
        f"{'x(floor+launch)':>15} {'GB/s':>7} {'baseline us':>12} {'x faster':>9} {'SGLang us':>10}",
    ]
    for key in names:
        d = build(WORKLOADS[key], cupy)
        bytes_ = op_bytes(d)
        baselines = {"plan": time_eager(cupy, lambda: baseline_plan(cupy, d))}
        slot, prev, pos, _, _ = baseline_plan(cupy, d)
        baselines["verify"] = time_eager(cupy, lambda: baseline_verify(cupy, d["canary"], slot, prev, pos))
        for op, fn in gpu_ops(cupy, d).items():
            us = time_graph(cupy, fn)
            floor = bytes_[op] / bw * 1e6
            base = baselines.get(op)
            sglang = SGLANG_US.get((key, op))
            rows.append({"workload": key, "op": op, "device_us": round(us, 3), "bytes": bytes_[op],
                         "floor_us": round(floor, 3), "x_floor_plus_launch": round(us / (floor + one_launch), 3),
                         "baseline_us": base and round(base, 1), "sglang_us": sglang})
            lines.append(
                f"{WORKLOADS[key].name:<16} {op:<13} {us:>10.2f} {us - one_launch:>10.2f} {bytes_[op] / 1e6:>9.2f} "
                f"{floor:>9.2f} {us / (floor + one_launch):>15.2f} {bytes_[op] / (us * 1e-6) / 1e9:>7.0f} "
                f"{cell(base, '12.1f')} {cell(base and base / us, '9.1f')} {cell(sglang, '10.1f')}"
            )
    lines.append("plan against its target (issue #10): " + ", ".join(
        f"{key} {r['device_us']:.2f} / {target:.2f} us = {r['device_us'] / target:.2f}x"
        for key in names for r in rows if r.get("workload") == key and r.get("op") == "plan"
        for target in [PLAN_TARGET_US.get(key) or PLAN_TARGET_X_FLOOR * (r["floor_us"] + one_launch)]))
    return lines

REFERENCE_KERNELS = r"""
extern "C" __global__ void gather_floor(const long long* canary, const long long* slots, const long long* pos,
                                        const long long* prev, long long n, long long* out) {
  long long acc = 0;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
    const longlong2* r = reinterpret_cast<const longlong2*>(canary + 4 * slots[e]);
    const longlong2 a = r[0], b = r[1];
    acc ^= a.x ^ a.y ^ b.x ^ b.y ^ pos[e] ^ prev[e];
  }
  if (acc == 0x123456789abcdefLL) out[0] = acc;  // keeps the loads
}

extern "C" __global__ void chain_floor(long long n, unsigned long long* out) {
  unsigned long long h = kvcanary::kAnchorHash;
  for (long long i = 0; i < n; ++i) h = kvcanary::mix3(h, i, i);
  out[0] = h;
}

// As chain_floor, but its start value comes from memory, so the chain runs on the per-lane pipes
// as a warp's chain over loaded tokens must (chain_floor's inputs are all constants: the compiler
// runs it once per warp on the uniform datapath, whose 64-bit multiplies are faster).
extern "C" __global__ void lane_chain_floor(long long n, unsigned long long* out) {
  unsigned long long h = kvcanary::kAnchorHash ^ out[1];
  for (long long i = 0; i < n; ++i) h = kvcanary::mix3(h, i, i);
  out[0] = h;
}

extern "C" __global__ void two_chain_floor(long long n, unsigned long long* out) {
  unsigned long long h = kvcanary::kAnchorHash, g = ~h;
  for (long long i = 0; i < n; ++i) {
    h = kvcanary::mix3(h, i, i);
    g = kvcanary::mix3(g, i, i);
  }
  out[0] = h ^ g;
}
"""


def _legacy_grids():
    """The persistent grids back at 8 blocks per SM (the launches read the policy at call time)."""
    from ...backends.cuda import configs

    return configs.overridden(resident_blocks=LEGACY_BLOCKS_PER_SM)


def reference_module(cupy):
    """The floors' kernels (REFERENCE_KERNELS) beside the canary's common header."""
    from ...backends.cuda import compile as cuda_compile

    return cupy.RawModule(code=cuda_compile._read("canary_common.cuh") + REFERENCE_KERNELS, options=cuda_compile.NVRTC_OPTIONS)


def gather_floor_call(cupy, module, d, vp, out):
    """The verify's loads alone over the stored plan ``vp`` of workload ``d`` (its records, predecessors
    and positions read, nothing hashed or compared)."""
    gather = module.get_function("gather_floor")
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return lambda: gather((sms * 8,), (256,), (d["canary"], vp.verify_slot_indices, vp.verify_expected_positions,
                                               vp.verify_prev_slot_indices, np.int64(d["total_verify"]), out))


def detail_rows(cupy, names, rows: list):
    """verify and write in detail: grids sized by occupancy against 8 blocks per SM, a verify in
    which every entry fails, two buffers in one launch, and the floors of the gather and the chain."""
    from ...backends.cuda import configs

    module = reference_module(cupy)
    chain = module.get_function("chain_floor")
    two_chains, lane_chain = module.get_function("two_chain_floor"), module.get_function("lane_chain_floor")
    out = cupy.zeros(2, cupy.int64)
    lines = [
        "detail: ratio = device us / the 'against' row's device us (targets: all-fail verify <= 1.3x clean, "
        "two buffers <= 1.1x one at W2 write, decode write W4 <= 4 us, W2 write <= 400 us per buffer)",
        f"{'workload':<16} {'op':<26} {'device us':>10} {'against':<24} {'ratio':>6} {'SGLang us':>10}",
    ]
    for key in names:
        d = build(WORKLOADS[key], cupy)
        ops = gpu_ops(cupy, d)
        vp = kc.VerifyPlan.allocate(d["total_verify"], like=d["rp"])
        wp = kc.WritePlan.allocate(d["bs"], like=d["rp"])
        kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=vp.capacity, out=(vp, wp))
        log = kc.ViolationLog.allocate(1024, like=d["rp"])
        bad = d["canary"].copy()
        bad[:, 1] += 1  # every record's position is wrong: every entry fails
        second = d["canary"].copy()
        timed = {
            "verify": ops["verify"],
            "verify[grid 8/SM]": ("legacy", ops["verify"]),
            "verify[all entries fail]": lambda: kc.verify(bad, vp, log=log),
            "verify[2 buffers]": lambda: kc.verify([d["canary"], second], vp, log=log, kernel_kind=[0, 1]),
            "verify[gather floor]": gather_floor_call(cupy, module, d, vp, out),
            "write": ops["write"],
            "write[grid 8/SM]": ("legacy", ops["write"]),
            "write[2 buffers]": lambda: kc.write([d["canary"], second], wp, d["ids"], d["pos"], d["loc"], log=log,
                                                 kernel_kind=[0, 1]),
        }
        if d["tokens"] > d["bs"]:  # a prefill: the serial chain of one request bounds the write
            per_request = np.int64(d["tokens"] // d["bs"])
            timed["write[chain floor]"] = lambda: chain((1,), (1,), (per_request, out))
            timed["write[lane chain floor]"] = lambda: lane_chain((1,), (1,), (per_request, out))
            timed["write[2-chain floor]"] = lambda: two_chains((1,), (1,), (per_request, out))
        if d["bs"] > configs.policy().plan_fused_max_rows:
            timed["plan"] = ops["plan"]
            timed["plan[grid 8/SM]"] = ("legacy", ops["plan"])
        against = {"verify[grid 8/SM]": "verify", "verify[all entries fail]": "verify", "verify[2 buffers]": "verify",
                   "verify": "verify[gather floor]", "write[grid 8/SM]": "write", "write[2 buffers]": "write",
                   "write": "write[lane chain floor]", "write[lane chain floor]": "write[chain floor]",
                   "write[2-chain floor]": "write[chain floor]",
                   "plan[grid 8/SM]": "plan"}
        times = {}
        for op, fn in timed.items():
            if isinstance(fn, tuple):
                with _legacy_grids():
                    times[op] = time_graph(cupy, fn[1])
            else:
                times[op] = time_graph(cupy, fn)
        for op, us in times.items():
            ref = against.get(op)
            ratio = us / times[ref] if ref in times else None
            rows.append({"workload": key, "op": op, "device_us": round(us, 3), "against": ref,
                         "ratio": ratio and round(ratio, 3), "sglang_us": SGLANG_US.get((key, op))})
            lines.append(f"{WORKLOADS[key].name:<16} {op:<26} {us:>10.2f} {ref or '-':<24} {cell(ratio, '6.2f')} "
                         f"{cell(SGLANG_US.get((key, op)), '10.1f')}")
    lines.append("(chain floor: one thread hashing a request's tokens as a serial mix3 chain of registers, all constants "
                 "but the count, which the compiler runs on the uniform datapath; lane chain floor: the same chain from a "
                 "loaded start value, on the per-lane pipes as a warp hashing loaded tokens must; 2-chain floor: one "
                 "thread hashing two chains interleaved; gather floor: the verify's loads alone)")
    return lines


# The fused decode step (issue #10 target 5): a whole W1 step in <= 12 us of device time.
