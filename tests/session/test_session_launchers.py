"""CanarySession launches through launchers bound in its constructor: no free-function call per step,
the free functions' bytes on every backend (plans, both canary buffers, the log), their errors for
bad per-step inputs, and the HEAD write on a side stream forked from and joined back to the step's
stream (its order checked on a fake CuPy device here, on the GPU in test_session_graphs.py)."""

import warnings

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import CHAIN, POSITION, REAL_KV, TOKEN, count_free_calls, host, ring_rows
from conftest import get_backend_or_skip
from session_engine import ToyEngine

NUMPY = get_backend_or_skip("numpy")
HEAD, TAIL, SWEEP = kc.CanaryLaunchTag.HEAD_K_FULL, kc.CanaryLaunchTag.TAIL_K_FULL, kc.CanaryLaunchTag.SWEEP_K_FULL
SCHEDULE = [[1, 2], [1, 2, 3], [2, 1, 3, 4], [1, 2, 4], [3, 1, 2], [1, 2, 5, 4], [2, 1], [1, 2, 3]]
STALE_ENTRY_STEP, KV_FLIP_STEP = 4, 6
KV_WIDTH = 2  # int64 per slot: 16 bytes of "real KV", fingerprinted whole


class _FreeFunctionSession:
    """What CanarySession's steps launched before it bound its launchers: kc.plan, kc.verify and
    kc.write on buffers of its own, with the session's tags and options."""

    def __init__(self, ab, session, kv):
        self.ab = ab
        like = ab.like
        self.head, self.tail = (kc.allocate_canary_buffer(session.num_slots, like=like) for _ in range(2))
        self.log = kc.ViolationLog.allocate(session.log.capacity, like=like)
        caps = session.planner.capacities
        self.capacities = dict(verify_capacity=caps.verify_capacity, write_req_capacity=caps.write_req_capacity)
        self.plan = (kc.VerifyPlan.allocate(caps.verify_capacity, like=like), kc.WritePlan.allocate(caps.write_req_capacity, like=like))
        self.kv = dict(real_kv_sources=(kv,), real_kv_hash_mode=session.real_kv_hash_mode)

    def pre_forward(self, rp, prefix, extend, table, ids, pos, loc, *, expected_tokens, expected_tokens_valid_lens):
        vp, wp = kc.plan(rp, prefix, extend, table, **self.capacities, out=self.plan,
                         req_to_verify_expected_tokens=expected_tokens,
                         req_to_verify_expected_tokens_valid_lens=expected_tokens_valid_lens)
        kc.verify(self.head, vp, log=self.log, kernel_kind=HEAD, check_expected_token=True)
        kc.write(self.head, wp, ids, pos, loc, log=self.log, kernel_kind=HEAD)
        self.inputs = (ids, pos, loc)

    def post_forward(self):
        vp, wp = self.plan
        kc.verify(self.tail, vp, log=self.log, kernel_kind=TAIL, check_expected_token=True, **self.kv)
        kc.write(self.tail, wp, *self.inputs, log=self.log, kernel_kind=TAIL, **self.kv)

    def sweep(self, rp, lens, table):
        zeros = self.ab.asarray(np.zeros(len(lens), np.int64))
        vp, _ = kc.plan(rp, lens, zeros, table, verify_capacity=self.capacities["verify_capacity"])
        kc.verify(self.tail, vp, log=self.log, kernel_kind=SWEEP, **self.kv)


def _assert_same_state(ab, session, ref, context):
    got_vp, want_vp = host(ab, session.planner.verify_plan), host(ab, ref.plan[0])
    n = int(want_vp["verify_num_valid"][0])
    for k, want in want_vp.items():
        got = got_vp[k]
        if got.shape[0] > 1:  # the entries: past verify_num_valid they are unspecified
            got, want = got[:n], want[:n]
        np.testing.assert_array_equal(got, want, err_msg=f"{context}: verify_plan.{k}")
    got_wp = host(ab, session.planner.write_plan)
    for k, want in host(ab, ref.plan[1]).items():
        np.testing.assert_array_equal(got_wp[k], want, err_msg=f"{context}: write_plan.{k}")
    for name in ("head", "tail"):
        np.testing.assert_array_equal(ab.to_numpy(getattr(session, f"{name}_canary")), ab.to_numpy(getattr(ref, name)),
                                      err_msg=f"{context}: {name} canary")
    got, want = host(ab, session.log), host(ab, ref.log)
    for k in ("violation_counters", "slot_run_counters", "kernel_run_counters", "out_of_range_counters"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{context}: log.{k}")
    # the session's ring: one share per launch group, each with its ticket counter; the reference's: one ring
    share = got["ring"].shape[0] // len(kc.session.RING_GROUPS)
    shares = [dict(ring=got["ring"][g * share : (g + 1) * share], write_index=got["write_index"][g : g + 1])
              for g in range(len(kc.session.RING_GROUPS))]
    assert int(got["write_index"].sum()) == int(want["write_index"][0]), context
    assert sorted(r for x in shares for r in ring_rows(x)) == ring_rows(want), context  # GPU threads write in any order


def _strided(ab, x):
    """``x`` on the backend as a strided view (every other element of a wider array)."""
    return ab.asarray(np.repeat(x, 2))[::2]


@pytest.mark.parametrize("strided_tokens", [False, True], ids=["contiguous", "strided"])
def test_session_steps_launch_the_free_functions_bytes_through_bound_launchers(ab, monkeypatch, strided_tokens):
    """A toy engine loop (a stale table entry, a KV bit flip, expected tokens, a sweep) through the
    session and through the free functions it used to call: the same plans, canary bytes, counters
    and ring rows after every step.  Contiguous per-step arrays never reach a free function; strided
    token arrays take the free write (which copies them) and nothing else does."""
    engine = ToyEngine()
    kv_host = np.zeros((engine.num_slots, KV_WIDTH), np.int64)
    kv = ab.asarray(kv_host)
    source = kc.RealKvSource(kv, 1, 8 * KV_WIDTH, 8 * KV_WIDTH)
    session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, like=ab.like, on_violation="ignore",
                               real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL,
                               check_expected_tokens=True)
    ref = _FreeFunctionSession(ab, session, source)
    counts = count_free_calls(monkeypatch)  # the reference calls kc.plan/verify/write, which it does not reach
    tokens = (lambda x: _strided(ab, x)) if strided_tokens else ab.asarray
    for step, rows in enumerate(SCHEDULE):
        arrays = engine.step(rows)
        if step == STALE_ENTRY_STEP:
            engine.rtt[1, 2] = engine.rtt[2, 4]
        if step == KV_FLIP_STEP:
            kv_host[engine.rtt[2, 1], 0] ^= 1 << 40  # a cached slot of row 2 changes under the TAIL fingerprint
        a = {k: ab.asarray(arrays[k]) for k in ("rp", "prefix", "extend")} | {k: tokens(arrays[k]) for k in ("ids", "pos", "loc")}
        step_args = (a["rp"], a["prefix"], a["extend"], ab.asarray(engine.rtt), a["ids"], a["pos"], a["loc"])
        expected = dict(expected_tokens=ab.asarray(engine.expected_tokens()),
                        expected_tokens_valid_lens=ab.asarray(np.where(arrays["rp"] != 0, arrays["prefix"], 0)))
        session.pre_forward(*step_args, **expected)
        ref.pre_forward(*step_args, **expected)
        new = arrays["loc"] != 0
        kv_host[arrays["loc"][new]] = np.stack([arrays["ids"][new], arrays["pos"][new]], axis=1)  # the forward's KV store
        kv[...] = ab.asarray(kv_host)
        session.post_forward()
        ref.post_forward()
        ab.synchronize()
        _assert_same_state(ab, session, ref, f"step {step}")
        session.end_step()  # stages the log and resets the ring's write index: so does the reference
        ref.log.write_index[...] = 0
    sweep = (ab.asarray(np.array([3, 4], np.int64)), ab.asarray(engine.lens[[3, 4]]), ab.asarray(engine.rtt))
    session.sweep(*sweep)
    ref.sweep(*sweep)
    ab.synchronize()
    _assert_same_state(ab, session, ref, "sweep")
    session.check()
    found = {(v.launch_tag, v.fail_reason_bits) for v in session.report().violations}
    stale_entry, kv_flip = CHAIN | POSITION | TOKEN, REAL_KV
    assert {("HEAD_K_FULL", stale_entry), ("TAIL_K_FULL", stale_entry), ("TAIL_K_FULL", kv_flip)} <= found
    assert counts == {"plan": 0, "verify": 0, "write": 2 * len(SCHEDULE) if strided_tokens else 0}


def test_bad_per_step_inputs_raise_the_free_functions_errors_before_anything_runs(ab):
    """What the session does not check itself, the free functions do, with their messages."""
    engine = ToyEngine()
    session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, like=ab.like)
    a = {k: ab.asarray(v) for k, v in engine.step([1, 2]).items()}
    table = ab.asarray(engine.rtt)
    cases = {
        "prefix_lens int32": (a["rp"], ab.asarray(engine.lens[:8].astype(np.int32)), a["extend"], table),
        "short extend_seq_lens": (a["rp"], a["prefix"], a["extend"][:3], table),
        "table int64": (a["rp"], a["prefix"], a["extend"], ab.asarray(engine.rtt.astype(np.int64))),
        "2-D req_pool_indices": (ab.asarray(np.zeros((8, 1), np.int64)), a["prefix"], a["extend"], table),
    }
    for name, plan_args in cases.items():
        with pytest.raises((TypeError, ValueError)) as want:
            kc.plan(*plan_args, verify_capacity=session.planner.capacities.verify_capacity,
                    out=(session.planner.verify_plan, session.planner.write_plan))
        with pytest.raises(want.type) as got:
            session.pre_forward(*plan_args, a["ids"], a["pos"], a["loc"])
        assert str(got.value) == str(want.value), name
    assert int(ab.to_numpy(session.log.kernel_run_counters).sum()) == 0  # nothing ran


# ---- the HEAD write's side stream, on a fake CuPy device -------------------------------------------


def _fake_session(dev, engine, **kw):
    a = {k: dev.asarray(v) for k, v in engine.step([1, 2]).items()}
    session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, like=a["rp"], on_violation="ignore", **kw)
    pre = lambda: session.pre_forward(a["rp"], a["prefix"], a["extend"], dev.asarray(engine.rtt), a["ids"], a["pos"], a["loc"])
    dev.timeline.clear()
    return session, pre


def _short(timeline):
    """Launches by kernel family (plan, verify, write, stage ...), events and waits as they are."""
    out = []
    for op, what, where in timeline:
        if op == "launch":
            what = what.split("::")[-1].split("<")[0].removeprefix("canary_").removeprefix("session_")
            what = "plan" if what.startswith("plan") else what
        out.append((op, what, where))
    return out


def test_head_write_forks_onto_the_side_stream_and_post_forward_joins_it():
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    with fake_device(record_bytes=False) as dev:
        session, pre = _fake_session(dev, ToyEngine())
        assert session.overlap_head_write  # the default on a GPU
        side = session._head_write_stream.name
        pre()
        (fork,) = [e for op, e, s in dev.timeline if op == "record"]
        assert _short(dev.timeline) == [
            ("launch", "plan", "main"), ("launch", "verify", "main"),  # plan and HEAD verify on the step's stream
            ("record", fork, "main"), ("wait", side, fork), ("launch", "write", side),  # HEAD write behind them
        ]
        dev.timeline.clear()
        session.post_forward()
        (join,) = [e for op, e, s in dev.timeline if op == "record"]
        assert _short(dev.timeline) == [
            ("launch", "verify", "main"), ("launch", "write", "main"),  # TAIL verify and write overlap it too
            ("record", join, side), ("wait", "main", join),
        ]
        dev.timeline.clear()
        pre()
        dev.timeline.clear()
        with pytest.raises(kc.CanaryUsageError, match=r"pre_forward\(\) twice"):
            pre()  # no post_forward in between: refused before anything is queued
        assert dev.timeline == []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nothing runs on a fake device: the staged record reads as empty
            session.end_step()  # no post_forward: end_step joins before staging the log the write fills
        assert _short(dev.timeline)[:3] == [("record", join, side), ("wait", "main", join), ("launch", "stage", "main")]


def test_without_overlap_every_launch_is_on_the_step_stream():
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    with fake_device(record_bytes=False) as dev:
        session, pre = _fake_session(dev, ToyEngine(), overlap_head_write=False)
        pre()
        session.post_forward()
        assert not session.overlap_head_write
        assert _short(dev.timeline) == [("launch", k, "main") for k in ("plan", "verify", "write", "verify", "write")]


def test_overlap_head_write_must_be_a_bool():
    with pytest.raises(TypeError, match="overlap_head_write must be a bool, got str"):
        kc.CanarySession(16, max_batch_size=2, overlap_head_write="yes")
    assert kc.CanarySession(16, max_batch_size=2).overlap_head_write is False  # NumPy sessions run in order
