"""Coverage past the record (issue 27 items 2 and 3): deep fingerprints of every layer, rotated
re-fingerprinting, and lost KV stores, on every backend, against hand-computed rows.

A toy forward stores, for each token it writes, KV bytes that depend on (token, position, layer,
half) only, into a pool ``uint8 [layers, 2, num_slots, ROW]``; a fault drops one layer's store.
"""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason, RealKvHashMode, RealKvSource
from kvcanary_cupy.coverage import DEEP_FIELD

LAYERS, ROW, SLOTS, ROWS, COLS = 3, 32, 64, 4, 16
DEEP, LOST = FailReason.VERIFY_DEEP_KV_MISMATCH, FailReason.WRITE_KV_NOT_STORED


def kv_row(token, position, layer, half):
    rng = np.random.default_rng([token, position, layer, half])
    return rng.integers(0, 256, ROW, dtype=np.uint8)


class Engine:
    """Requests on req_to_token rows; each step appends tokens and runs the session around a toy forward."""

    def __init__(self, ab, *, deep=False, lost_layers=None, **session_kw):
        self.ab = ab
        self.pool_host = np.zeros((LAYERS, 2, SLOTS, ROW), np.uint8)
        self.pool = ab.asarray(self.pool_host)
        self.rtt = np.zeros((ROWS, COLS), np.int32)
        self.lens = {}
        self.next_slot = 1
        self.tokens = {}
        self.layer0 = tuple(RealKvSource(self.pool[0, h], 1, ROW, ROW) for h in (0, 1))
        self.every_layer = tuple(RealKvSource(self.pool[l, h], 1, ROW, ROW) for l in range(LAYERS) for h in (0, 1))
        if deep:
            session_kw["deep_kv_sources"] = self.every_layer
        if lost_layers is not None:
            session_kw["lost_kv_sources"] = tuple(self.every_layer[2 * l + h] for l in lost_layers for h in (0, 1))
        session_kw.setdefault("real_kv_sources", self.layer0)
        session_kw.setdefault("real_kv_hash_mode", RealKvHashMode.ALL)
        self.session = kc.CanarySession(SLOTS, max_batch_size=ROWS, like=ab.like, on_violation="ignore", **session_kw)

    def store(self, slot, token, position, layers=range(LAYERS)):
        for layer in layers:
            for half in (0, 1):
                self.pool_host[layer, half, slot] = kv_row(token, position, layer, half)
                self.pool[layer, half, slot] = self.ab.asarray(self.pool_host[layer, half, slot])

    def step(self, work, *, drop=(), slots=None):
        """``work``: {row: new token ids}; ``drop``: (flat token index, layer) stores the forward skips;
        ``slots``: flat slots to use instead of fresh ones (a re-run into the same slots)."""
        rp, prefix, extend, ids, pos, loc = [], [], [], [], [], []
        for row, new in work.items():
            start = self.lens.get(row, 0)
            rp.append(row), prefix.append(start), extend.append(len(new))
            for i, t in enumerate(new):
                slot = slots[len(loc)] if slots is not None else self.next_slot
                if slots is None:
                    self.next_slot += 1
                self.rtt[row, start + i] = slot
                ids.append(t), pos.append(start + i), loc.append(slot)
            self.lens[row] = start + len(new)
        a = lambda v: self.ab.asarray(np.asarray(v, np.int64))
        s = self.session
        s.pre_forward(a(rp), a(prefix), a(extend), self.ab.asarray(self.rtt), a(ids), a(pos), a(loc))
        for i, (slot, t, p) in enumerate(zip(loc, ids, pos)):
            self.store(slot, t, p, [l for l in range(LAYERS) if (i, l) not in drop])
        s.post_forward()
        s.end_step()
        return loc

    def flip(self, slot, layer, half, byte=5, bit=3):
        self.pool_host[layer, half, slot, byte] ^= np.uint8(1 << bit)
        self.pool[layer, half, slot] = self.ab.asarray(self.pool_host[layer, half, slot])

    def report(self):
        self.session.check()
        return self.session.report()

    def deep_value(self, slot):
        """The deep fingerprint of ``slot``'s bytes, by hand: every layer's K then V, folded (0 stored as 1)."""
        h = kc.real_kv_fold([self.pool_host[l, half, slot].tobytes() for l in range(LAYERS) for half in (0, 1)])
        return h or 1


def test_deep_field_holds_every_layers_fold_and_the_record_is_unchanged(ab):
    plain, deep = Engine(ab), Engine(ab, deep=True, deep_check_slots=8)
    for e in (plain, deep):
        e.step({1: [11, 12, 13], 2: [21, 22]})
        e.step({1: [14], 2: [23]})
    tail_plain, tail_deep = (ab.to_numpy(e.session.tail_canary) for e in (plain, deep))
    assert tail_plain.shape == (SLOTS, 4) and tail_deep.shape == (SLOTS, 6)
    assert np.array_equal(tail_deep[:, :4], tail_plain)  # SGLang's 32 bytes are the same with the option on
    for slot in range(1, 8):
        assert int(tail_deep[slot, DEEP_FIELD]) == kc.to_signed(deep.deep_value(slot))
    assert not tail_deep[8:, DEEP_FIELD].any() and not tail_deep[:, 5].any()
    assert deep.report().total_violations == plain.report().total_violations == 0


@pytest.mark.parametrize("layer, half", [(2, 0), (1, 1), (0, 0)])
def test_a_flip_in_any_layer_is_caught_by_the_rotation_at_its_step(ab, layer, half):
    """per_step 16 over ring 63: step k re-fingerprints slots 1 + (16 k + i) % 63; slot 40 is in step 2's share."""
    e = Engine(ab, deep=True, deep_check_slots=16, real_kv_sources=())
    assert e.session.coverage.deep_check_period == 4
    e.next_slot = 38
    e.step({1: [5, 6, 7, 8]})  # step 0: slots 38..41 (checks slots 1..16)
    before = e.deep_value(40)
    e.flip(40, layer, half)
    e.step({1: [9]})  # step 1: checks 17..32
    assert e.report().total_violations == 0
    e.step({1: [10]})  # step 2: checks 33..48
    report = e.report()
    rows = [(v.launch_tag, v.slot_idx, v.position, v.stored_token, v.expected_token, v.stored_chain_hash, v.expected_aux,
             v.fail_reason_bits, v.first_step) for v in report.violations]
    assert rows == [("TAIL_K_FULL", 40, 2, 7, -1, before, e.deep_value(40), DEEP, 2)]


def test_every_slot_is_rechecked_within_the_period(ab):
    """A flip in a slot written long ago is caught within deep_check_period steps, wherever the cursor is."""
    e = Engine(ab, deep=True, deep_check_slots=10)
    period = e.session.coverage.deep_check_period
    assert period == 7  # ceil(63 / 10)
    e.step({1: list(range(100, 116)), 2: list(range(200, 216))})  # slots 1..32
    for victim in (3, 17, 32):
        e.flip(victim, LAYERS - 1, 1)
        steps = 0
        while not e.report().violations or e.report().violations[-1].slot_idx != victim:
            e.step({3: [steps]}) if e.lens.get(3, 0) < COLS else e.step({})
            steps += 1
            assert steps <= period
        e.flip(victim, LAYERS - 1, 1)  # flip back: the slot matches its fingerprint again


def test_lost_store_is_caught_with_its_row(ab):
    e = Engine(ab, check_lost_stores=True, max_step_tokens=8)
    e.step({1: [11, 12, 13]})  # slots 1..3
    e.step({1: [14], 2: [21, 22]})  # slots 4, 5, 6
    # Request 1 finishes; request 3 gets its slots 1..3 again and the forward drops token 1's store.
    e.lens[1] = 0
    e.step({3: [31, 32, 33]}, slots=[1, 2, 3], drop={(1, l) for l in range(LAYERS)})
    report = e.report()
    lost = [v for v in report.violations if v.fail_reason_bits & LOST]
    assert [(v.launch_tag, v.slot_idx, v.position, v.stored_token, v.expected_token, v.expected_aux, v.first_step)
            for v in lost] == [("TAIL_K_FULL", 2, 1, 12, 32, 0, 2)]  # column 6: source 0 (layer 0 K) did not change
    assert e.session.stats["violations_by_reason"]["write_kv_not_stored"] == 1


def test_lost_store_in_one_deep_layer_names_its_source(ab):
    """With deep sources, a store lost in layer 2 only is named by that layer's source index (2 * 2 + half)."""
    e = Engine(ab, deep=True, deep_check_slots=4, check_lost_stores=True, max_step_tokens=4)
    e.step({1: [11, 12]})
    e.lens[1] = 0
    e.step({2: [41, 42]}, slots=[1, 2], drop={(0, 2)})
    lost = [v for v in e.report().violations if v.fail_reason_bits & LOST]
    assert [(v.slot_idx, v.position, v.stored_token, v.expected_token, v.expected_aux) for v in lost] == [(1, 0, 11, 41, 4)]


def test_identical_bytes_of_the_same_record_are_legitimate(ab):
    """The same token, position and chain recomputed into the same slot leave identical bytes: no row.
    The same bytes under another chain (another prefix) are a lost store by the rule."""
    e = Engine(ab, check_lost_stores=True, max_step_tokens=8)
    e.step({1: [11, 12, 13]})
    e.lens[1] = 0
    e.step({1: [11, 12, 13]}, slots=[1, 2, 3])  # a recompute: same record, same bytes
    assert e.report().total_violations == 0
    e.step({2: [7, 12]}, slots=[4, 2])  # slot 2 again holds token 12 at position 1, behind another token
    lost = [v for v in e.report().violations if v.fail_reason_bits & LOST]
    assert [(v.slot_idx, v.position, v.stored_token, v.expected_token) for v in lost] == [(2, 1, 12, 12)]


def test_lost_kv_sources_leave_out_a_position_independent_source(ab, monkeypatch):
    """A first layer's V that depends on the token alone (as a transformer's layer-0 V does): the same
    token stored at another position leaves those bytes unchanged, a row when that source is compared;
    lost_kv_sources of the other layers compare only bytes that depend on the position, and still see
    a store lost in one of them (expected_aux: its index among those sources)."""
    token_only = kv_row
    monkeypatch.setitem(globals(), "kv_row",
                        lambda t, p, layer, half: token_only(t, 0 if (layer, half) == (0, 1) else p, layer, half))

    def reuse(e, drop=()):
        e.step({1: [11, 12]})  # slots 1, 2: token 11 at position 0
        e.lens[1] = 0
        e.step({2: [5, 11]}, slots=[3, 1], drop=drop)  # slot 1: token 11 again, at position 1
        return [(v.slot_idx, v.position, v.stored_token, v.expected_token, v.expected_aux) for v in e.report().violations
                if v.fail_reason_bits & LOST]

    assert reuse(Engine(ab, check_lost_stores=True, max_step_tokens=4)) == [(1, 1, 11, 11, 1)]  # layer 0's V: unchanged
    assert reuse(Engine(ab, check_lost_stores=True, max_step_tokens=4, lost_layers=(1, 2))) == []
    e = Engine(ab, check_lost_stores=True, max_step_tokens=4, lost_layers=(1, 2))
    assert e.session.coverage.lost.count == 4 and e.session.coverage.lost.bytes_per_slot == 4 * ROW  # ALL: every byte
    assert reuse(e, drop={(1, 2)}) == [(1, 1, 11, 11, 2)]  # layer 2's K, the third of the four sources


def test_clean_steps_give_no_false_positive(ab):
    e = Engine(ab, deep=True, check_lost_stores=True, max_step_tokens=8)
    rng = np.random.default_rng(7)
    for _ in range(12):
        work = {r: list(rng.integers(0, 1000, size=1 if e.lens.get(r) else 3)) for r in (1, 2, 3)
                if e.lens.get(r, 0) < COLS - 3}
        e.step(work)
    assert e.report().total_violations == 0


def test_tokens_past_max_step_tokens_are_counted(ab):
    e = Engine(ab, check_lost_stores=True, max_step_tokens=2)
    with pytest.warns(kc.CanaryCoverageWarning, match="or write tokens past max_step_tokens"):
        e.step({1: [11, 12, 13], 2: [21]})
        e.step({1: [14]})
        assert e.session.check() == 2  # 4 tokens, 2 checked; counted on the device, so graph replays count too
    assert e.session.stats["out_of_range_skipped"] == 2
    assert e.report().total_violations == 0


@pytest.mark.parametrize("kw, exc, match", [
    (dict(check_lost_stores=True), ValueError, r"check_lost_stores=True needs max_step_tokens"),
    (dict(check_lost_stores=True, max_step_tokens=4, real_kv_sources=()), ValueError,
     r"check_lost_stores=True needs KV bytes to compare"),
    (dict(check_lost_stores=1, max_step_tokens=4), TypeError, r"check_lost_stores must be a bool, got int"),
    (dict(deep_check_slots=4), ValueError, r"deep_check_slots needs deep_kv_sources"),
    (dict(deep_kv_sources=[object()]), TypeError, r"deep_kv_sources\[0\] must be a RealKvSource, got object"),
    (dict(check_lost_stores=True, max_step_tokens=0), ValueError, r"max_step_tokens must be"),
    (dict(deep_kv_sources=None, deep_check_slots=0), ValueError, r"deep_check_slots must be"),
    (dict(lost_kv_sources=None), ValueError, r"lost_kv_sources needs check_lost_stores=True"),
    (dict(lost_kv_sources=[object()], check_lost_stores=True, max_step_tokens=4), TypeError,
     r"lost_kv_sources\[0\] must be a RealKvSource, got object"),
])
def test_coverage_options_are_checked_by_name(ab, kw, exc, match):
    kw = dict(kw)  # the parameter's dict is shared by every backend's run: the defaults below are this run's
    pool = ab.asarray(np.zeros((SLOTS, ROW), np.uint8))
    kw.setdefault("real_kv_sources", (RealKvSource(pool, 1, ROW, ROW),))
    for name in ("deep_kv_sources", "lost_kv_sources"):
        if name in kw and kw[name] is None:
            kw[name] = kw["real_kv_sources"]
    with pytest.raises(exc, match=match):
        kc.CanarySession(SLOTS, max_batch_size=2, like=ab.like, real_kv_hash_mode=RealKvHashMode.ALL, **kw)


def test_deep_sources_must_cover_the_pool(ab):
    small = ab.asarray(np.zeros((SLOTS - 1, ROW), np.uint8))
    with pytest.raises(ValueError, match=r"deep_kv_sources\[0\]\.tensor has 63 rows"):
        kc.CanarySession(SLOTS, max_batch_size=2, like=ab.like, deep_kv_sources=(RealKvSource(small, 1, ROW, ROW),))


def test_forget_clears_deep_fingerprints_and_checks_its_slots(ab):
    e = Engine(ab, deep=True, deep_check_slots=63)
    e.step({1: [5, 6, 7]})
    e.flip(2, 1, 0)
    e.session.coverage.forget(np.array([2, 3]))
    tail = ab.to_numpy(e.session.tail_canary)
    assert tail[[1, 2, 3], DEEP_FIELD].tolist() == [kc.to_signed(e.deep_value(1)), 0, 0]
    e.step({2: [9]})  # the rotation covers every slot: the forgotten flip is not reported
    assert e.report().total_violations == 0
    with pytest.raises(ValueError, match=r"forget slots must be in \[0, num_slots=64\), got 64"):
        e.session.coverage.forget([1, 64])


def test_partial_mode_sources_serve_the_lost_store_check(ab):
    """Without deep sources the check compares the real-KV sources' bytes of the session's mode (16 under PARTIAL)."""
    e = Engine(ab, real_kv_hash_mode=RealKvHashMode.PARTIAL, check_lost_stores=True, max_step_tokens=4)
    assert e.session.coverage.lost.bytes_per_slot == 2 * 16
    e.step({1: [11, 12]})
    e.lens[1] = 0
    e.step({2: [21, 22]}, slots=[1, 2], drop={(1, 0)})
    lost = [v for v in e.report().violations if v.fail_reason_bits & LOST]
    assert [(v.slot_idx, v.stored_token, v.expected_token, v.expected_aux) for v in lost] == [(2, 12, 22, 0)]


def _graph_steps():
    """Two requests decoding one token a step (fixed shapes), a dropped store at step 3 and a flip
    in layer 2 of slot 1 after step 4."""
    out = []
    for step in range(10):
        loc = [1 + 2 * step, 2 + 2 * step]
        out.append(dict(rp=[1, 2], prefix=[step, step], extend=[1, 1], ids=[100 + step, 200 + step], pos=[step, step],
                        loc=loc, drop={(1, l) for l in range(LAYERS)} if step == 3 else set(), flip=step == 4))
    return out


def _run_graph_steps(ab, capture):
    e = Engine(ab, deep=True, deep_check_slots=8, check_lost_stores=True, max_step_tokens=2, overlap_head_write=False)
    steps = _graph_steps()
    bufs = {k: ab.asarray(np.asarray(steps[0][k], np.int64)) for k in ("rp", "prefix", "extend", "ids", "pos", "loc")}
    table = ab.asarray(e.rtt)
    s = e.session
    pre = lambda: s.pre_forward(bufs["rp"], bufs["prefix"], bufs["extend"], table, bufs["ids"], bufs["pos"], bufs["loc"])
    parts = capture(pre, s.post_forward) if capture else (pre, s.post_forward)
    for step in steps:
        for k in bufs:
            bufs[k][...] = ab.asarray(np.asarray(step[k], np.int64))
        for row, slot in zip(step["rp"], step["loc"]):
            e.rtt[row, step["pos"][0]] = slot
        table[...] = ab.asarray(e.rtt)
        parts[0]()
        for i, (slot, t, p) in enumerate(zip(step["loc"], step["ids"], step["pos"])):
            e.store(slot, t, p, [l for l in range(LAYERS) if (i, l) not in step["drop"]])
        parts[1]()
        ab.synchronize()
        s.end_step()
        if step["flip"]:
            e.flip(1, 2, 1)
    s.check()
    return s.report().to_dicts(), s.stats


@pytest.mark.parametrize("backend", ["numpy", "torch_cpu"])
def test_graph_schedule_rows_on_the_cpu(backend):
    """The schedule the graph test replays, eagerly: the lost store of step 3 (slot 8) and the flip of
    slot 1 after step 4, caught at step 7, whose share (8 slots from 56 of a 63-slot ring) wraps to slot 1."""
    from conftest import get_backend_or_skip

    got, _ = _run_graph_steps(get_backend_or_skip(backend), None)
    assert [(v["reasons"], v["slot_idx"], v["position"], v["first_step"]) for v in got] == [
        (["write_kv_not_stored"], 8, 3, 3), (["verify_deep_kv"], 1, 0, 7)]


@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_coverage_captured_in_cuda_graphs_matches_numpy(backend):
    """pre_forward and post_forward with both checks on, each captured once and replayed: the
    report equals the eager NumPy session's (a lost store at step 3, the flip caught by the rotation)."""
    from conftest import get_backend_or_skip

    ab = get_backend_or_skip(backend)
    kc.warmup()
    want, want_stats = _run_graph_steps(get_backend_or_skip("numpy"), None)

    def capture(*parts):
        graphs = []
        if backend == "cupy":
            import cupy

            stream = cupy.cuda.Stream(non_blocking=True)
            for part in parts:
                with stream:
                    stream.begin_capture()
                    part()
                    graphs.append(stream.end_capture())
            # the engine's stores (Engine.store) run on the legacy stream, which a non-blocking
            # stream does not wait for: the device sync orders them before each replay
            return tuple(lambda g=g: (cupy.cuda.Device().synchronize(), g.launch(stream), stream.synchronize())
                         for g in graphs)
        import torch

        for part in parts:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                part()
            graphs.append(g)
        return tuple(lambda g=g: (g.replay(), torch.cuda.synchronize()) for g in graphs)

    got, got_stats = _run_graph_steps(ab, capture)
    assert got == want and got_stats == want_stats


def test_coverage_benchmark_sessions_verify_clean():
    """The benchmark's sessions (kvcanary bench --sections coverage), on the CPU and small: after the
    warm-up step every step runs clean, deep rotation and lost-store folds included."""
    from kvcanary_cupy.devtools.bench import coverage_section as bc
    from kvcanary_cupy.devtools.bench import Workload, build

    d = build(Workload("tiny", 6, 8, 40, 1), np)
    pool = np.zeros((3, 2, d["canary"].shape[0], 32), np.float16)
    for options in bc.CONFIGS.values():
        s = bc.session(d, pool, **options)
        step = bc.warmed_step(s, d)
        for _ in range(4):
            step()
        assert int(s.log.violation_counters.sum()) == 0
        assert int(s.log.kernel_run_counters.sum()) == 4 * 4  # HEAD and TAIL verify and write, 4 steps after the reset


def test_kernel_constants_match_python():
    import re

    from kvcanary_cupy.backends.cuda import compile as jit
    from kvcanary_cupy.backends.cuda.coverage import COVERAGE_THREADS
    from kvcanary_cupy.constants import MAX_PIECE_LEVELS
    from kvcanary_cupy.coverage import SOURCE_FIELDS

    def constant(name, filename):
        return int(re.search(rf"constexpr int {name} = (\d+);", jit._read(filename)).group(1))

    assert constant("kMaxPieceLevels", "canary_common.cuh") == MAX_PIECE_LEVELS
    assert constant("kSourceFields", "coverage.cu") == SOURCE_FIELDS
    assert constant("kDeepField", "coverage.cu") == DEEP_FIELD
    assert constant("kCoverageThreads", "coverage.cu") == COVERAGE_THREADS
    assert "coverage" in jit.FAMILIES and len(jit.FAMILIES["coverage"].instantiations()) == 4


def test_deep_sources_with_slot_offset(ab):
    """Deep sources whose pool starts one slot later (slot_offset=1): canary slot s fingerprints pool row s - 1."""
    pool = np.random.default_rng(12).integers(0, 256, (2, SLOTS - 1, ROW), dtype=np.uint8)
    dev = ab.asarray(pool)
    deep = tuple(RealKvSource(dev[h], 1, ROW, ROW, slot_offset=1) for h in (0, 1))
    s = kc.CanarySession(SLOTS, max_batch_size=2, like=ab.like, on_violation="ignore", deep_kv_sources=deep,
                         deep_check_slots=SLOTS - 1)
    a = lambda v: ab.asarray(np.asarray(v, np.int64))
    s.pre_forward(a([1]), a([0]), a([3]), ab.asarray(np.arange(SLOTS, dtype=np.int32).reshape(4, 16)), a([7, 8, 9]),
                  a([0, 1, 2]), a([1, 2, 60]))
    s.post_forward()
    s.end_step()
    tail = ab.to_numpy(s.tail_canary)
    for slot in (1, 2, 60):
        want = kc.real_kv_fold([pool[0, slot - 1].tobytes(), pool[1, slot - 1].tobytes()]) or 1
        assert int(tail[slot, DEEP_FIELD]) == kc.to_signed(want)
    assert s.check() == 0 and s.report().total_violations == 0


def test_int32_out_cache_loc_gives_the_int64_bytes(ab):
    """The kernels read int64 slots: an int32 out_cache_loc (as transformers builds it) is widened
    on the GPU's checked path, never read as int64 (which would read past its end)."""
    pool = np.random.default_rng(5).integers(0, 256, (2, SLOTS, ROW), dtype=np.uint8)
    dev = ab.asarray(pool)
    deep = tuple(RealKvSource(dev[h], 1, ROW, ROW) for h in (0, 1))
    results = []
    for dtype in (np.int64, np.int32):
        s = kc.CanarySession(SLOTS, max_batch_size=2, like=ab.like, on_violation="ignore", deep_kv_sources=deep,
                             deep_check_slots=8, check_lost_stores=True, max_step_tokens=4)
        a = lambda v, t=np.int64: ab.asarray(np.asarray(v, t))  # noqa: E731
        s.pre_forward(a([1]), a([0]), a([3]), ab.asarray(np.arange(SLOTS, dtype=np.int32).reshape(4, 16)), a([7, 8, 9]),
                      a([0, 1, 2]), a([16, 17, 18], dtype))
        s.post_forward()
        s.end_step()
        s.check()
        results.append((ab.to_numpy(s.tail_canary).tobytes(), s.report().to_dicts(), s.stats["out_of_range_skipped"]))
    assert results[0] == results[1]
    assert results[0][1]  # the unchanged pool is a lost store of every slot: rows to compare
