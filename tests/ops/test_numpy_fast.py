"""The NumPy backend's fast paths (backends/numpy_fast.py) against its reference (numpy_backend.py):
every output byte for byte, the ring's row order included, on randomized inputs and edge cases."""

import warnings

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.args import CanaryTarget, VerifyArgs
from kvcanary_cupy.backends import get_backend, numpy_backend, numpy_fast, numpy_kv
from kvcanary_cupy.binding import log_views
from kvcanary_cupy.hashing import mix3_array, to_signed
from conftest import get_backend_or_skip
from fuzz_cases import STEP_KINDS, make_case, run_case

NUMPY = get_backend_or_skip("numpy")
_WRITE_DECODE = numpy_fast._write_decode


# The plan's two ways of laying out runs: joined slices of the rows, or gathers in groups (tiny ones here).
PLAN_PATHS = {"slices": dict(SLICE_MIN_RUN=0), "gathers": dict(SLICE_MIN_RUN=10**9, GATHER_GROUP=7)}


@pytest.fixture(params=sorted(PLAN_PATHS))
def plan_path(request, monkeypatch):
    for name, value in PLAN_PATHS[request.param].items():
        monkeypatch.setattr(numpy_fast, name, value)
    return request.param


@pytest.fixture
def reference(monkeypatch):
    """A context in which the NumPy backend runs its reference plan, verify, plan_verify and write."""
    def use_reference():
        for name in ("plan", "verify", "plan_verify", "write"):
            monkeypatch.setattr(numpy_fast, name, getattr(numpy_backend, name))
    return use_reference


def assert_identical(want: dict, got: dict, context: str) -> None:
    for step, (w, g) in enumerate(zip(want["snapshots"], got["snapshots"])):
        assert w.keys() == g.keys()
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=f"{context} step {step}: {key}")
            assert g[key].dtype == w[key].dtype, f"{context} step {step}: {key}"


def test_the_numpy_backend_is_the_fast_one():
    assert get_backend("numpy") is numpy_fast
    assert numpy_fast.write.__module__ == numpy_fast.__name__  # each call looks the reference's op up


@pytest.mark.parametrize("step", STEP_KINDS)
def test_fuzz_cases_match_the_reference(step, reference, plan_path, monkeypatch):
    """The differential fuzz cases (every table kind, SWA and LUT, the expected-token pool, overflow,
    out-of-range values in every input, several buffers, real-KV sources) through the free
    functions, in small verify chunks so that requests and irregular entries straddle them; each
    plan path takes its own 48 seeds."""
    monkeypatch.setattr(numpy_fast, "VERIFY_CHUNK", 5)
    first = 0 if plan_path == "slices" else 48
    cases = [(seed, make_case(seed)) for seed in range(first, first + 48)]
    cases = [(seed, c) for seed, c in cases if step != "fused" or c.buffers == 1]
    fast = [run_case(NUMPY, c, step=step) for _, c in cases]
    reference()
    for (seed, c), got in zip(cases, fast):
        assert_identical(run_case(NUMPY, c, step=step), got, f"seed {seed} {step}")


@pytest.mark.parametrize("seed", range(3))
def test_wide_fuzz_cases_and_bound_launchers_match_the_reference(seed, reference, plan_path):
    """Thousands of requests (several default-size verify chunks), and the bound launchers."""
    cases = [make_case(10_000 + seed, big=True), make_case(seed)]
    fast = [run_case(NUMPY, cases[0]), run_case(NUMPY, cases[1], bound=True)]
    reference()
    assert_identical(run_case(NUMPY, cases[0]), fast[0], f"big seed {seed}")
    assert_identical(run_case(NUMPY, cases[1], bound=True), fast[1], f"bound seed {seed}")


# ---- plan through a req_to_token: drawn inputs, valid and not ----------------------------------------


def _plan_outputs(run, bs, cap, previous_bs):
    vp, wp = kc.VerifyPlan.allocate(cap), kc.WritePlan.allocate(bs + 3)
    for a in vp.arrays().values():
        a[...] = 0x5A5A
    wp.write_num_valid_reqs[0] = previous_bs
    run(verify_capacity=cap, out=(vp, wp))
    return {k: v.copy() for k, v in {**vp.arrays(), **wp.arrays()}.items()}


def _plan_drawn(drawn) -> list:
    """:func:`_plan_outputs` of each drawn ``(seed, args, kw, bs, cap, previous)`` plan, in order."""
    out = []
    for _, args, kw, bs, cap, previous in drawn:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kc.CanaryCapacityWarning)  # the overflowing plans warn
            out.append(_plan_outputs(lambda **o: kc.plan(*args, **kw, **o), bs, cap, previous))
    return out


def _draw_plan(rng):
    bs, rows, cols = int(rng.integers(0, 12)), int(rng.integers(1, 9)), int(rng.integers(1, 40))
    rtt = rng.integers(-3, 60, (rows, cols)).astype(np.int32)
    if rng.random() < 0.3:  # a row stride past the width
        rtt = np.zeros((rows, cols + 5), np.int32)[:, :cols]
        rtt[...] = rng.integers(-3, 60, (rows, cols))
    rp = rng.integers(-1, rows + 1, bs)
    prefix = rng.choice([-1, 0, 1, cols // 2, cols, cols + 1], bs) if rng.random() < 0.3 else rng.integers(0, cols + 1, bs)
    extend = rng.choice([-1, 0, 1, 2**62], bs) if rng.random() < 0.2 else rng.integers(0, 3, bs)
    kw = dict(swa_window_size=int(rng.choice([0, 0, 1, 5])),
              kv_token_id_vs_position_offset=int(rng.choice([0, 1, -2, 2**62, -(2**63), 2**63 - 1])))
    if kw["swa_window_size"] or rng.random() < 0.4:
        kw["full_to_swa_index_mapping"] = rng.integers(-2, 70, int(rng.integers(1, 80)))
    if rng.random() < 0.5:
        kw["req_to_verify_expected_tokens"] = rng.integers(0, 9, (rows + 1, int(rng.integers(1, cols + 4)))).astype(np.int32)
        kw["req_to_verify_expected_tokens_valid_lens"] = rng.integers(-2, cols + 4, bs)
    args = (rp.astype(np.int64), prefix.astype(np.int64), extend.astype(np.int64), kc.ReqToToken(rtt))
    return args, kw, bs


@pytest.mark.parametrize("first", range(0, 600, 200))
def test_req_to_token_plans_match_the_reference(first, reference, plan_path):
    """Out-of-range rows, prefixes and extends, padding rows, negative table values, windows, LUTs
    (short ones clamp), pools with bad valid lengths, token offsets at the ends of int64, tables
    with a row stride past their width, tight and overflowing capacities, stale rows of an earlier plan."""
    drawn = []
    for seed in range(first, first + 200):
        rng = np.random.default_rng(seed)
        args, kw, bs = _draw_plan(rng)
        cap = int(rng.integers(0, 60))
        drawn.append((seed, args, kw, bs, cap, int(rng.integers(0, bs + 4))))

    fast = _plan_drawn(drawn)
    reference()
    for (seed, *_), want, got in zip(drawn, _plan_drawn(drawn), fast):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"seed {seed}: {key}")
    assert sum(int(f["verify_num_valid"][0]) > 0 for f in fast) > 100  # most plans expand entries


def _draw_paged_plan(rng):
    """A page-size-1 kv_indices plan as transformers builds them (each row's reads are its prefix then
    its new tokens), mostly in range; now and then a value out of range, a window, a LUT, a page size."""
    bs = int(rng.integers(0, 14))
    lengths = rng.integers(0, 30, bs)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = rng.integers(-2, 200, int(indptr[-1]) + int(rng.integers(0, 3)))
    if rng.random() < 0.2:
        indices[rng.integers(0, indices.shape[0], 2) if indices.size else []] = -(2**63)  # clamped to -(2**63 - 1)
    extend = rng.integers(0, 3, bs)
    prefix = np.maximum(lengths - extend, 0)
    if rng.random() < 0.15:  # a prefix, extend or row past its bounds
        r = int(rng.integers(0, bs)) if bs else 0
        if bs:
            which = rng.integers(0, 4)
            if which == 0:
                prefix[r] = lengths[r] + 1
            elif which == 1:
                prefix[r] = -1
            elif which == 2:
                extend[r] = rng.choice([-1, 2**62])
            else:
                indptr[r + 1 :] += 10**6
    kw = dict(kv_token_id_vs_position_offset=int(rng.choice([0, 0, 1, -2, 2**62, -(2**63), 2**63 - 1])))
    if rng.random() < 0.1:
        kw["swa_window_size"] = int(rng.choice([1, 5]))
        kw["full_to_swa_index_mapping"] = rng.integers(-2, 300, int(rng.integers(1, 300)))
    if rng.random() < 0.6:
        kw["req_to_verify_expected_tokens"] = rng.integers(0, 9, (bs + int(rng.integers(0, 2)), int(rng.integers(1, 40)))).astype(np.int32)
        columns = kw["req_to_verify_expected_tokens"].shape[1]
        kw["req_to_verify_expected_tokens_valid_lens"] = (rng.choice([-1, 0, columns, columns + 1], bs) if rng.random() < 0.2
                                                          else rng.integers(0, columns + 1, bs))
    narrow = rng.random() < 0.4
    table = kc.PagedKvIndices(indptr.astype(np.int32) if narrow else indptr,
                              indices.astype(np.int32) if narrow and rng.random() < 0.8 else indices,
                              page_size=1 if rng.random() < 0.9 else 2)
    return (None, prefix.astype(np.int64), extend.astype(np.int64), table), kw, bs


@pytest.mark.parametrize("first", range(0, 900, 300))
def test_paged_kv_plans_match_the_reference(first, reference):
    """Transformers' page-size-1 kv_indices plans (numpy_fast.plan_paged_rows), in range and not:
    rows, prefixes and extends past their bounds, INT64_MIN entries, int32 tables, pools with bad
    valid lengths, token offsets at the ends of int64, tight and overflowing capacities, stale rows
    of an earlier plan; the windows, LUTs and page sizes it leaves to the reference too."""
    drawn = []
    for seed in range(first, first + 300):
        rng = np.random.default_rng(seed)
        args, kw, bs = _draw_paged_plan(rng)
        cap = int(rng.integers(0, 300)) if rng.random() < 0.3 else 400
        drawn.append((seed, args, kw, bs, cap, int(rng.integers(0, bs + 4))))
    taken = []
    original = numpy_fast.plan_paged_rows

    def counted(a, vcap):
        done = original(a, vcap)
        taken.append(done)
        return done

    numpy_fast.plan_paged_rows = counted
    try:
        fast = _plan_drawn(drawn)
    finally:
        numpy_fast.plan_paged_rows = original
    reference()
    for (seed, *_), want, got in zip(drawn, _plan_drawn(drawn), fast):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"seed {seed}: {key}")
            assert got[key].dtype == want[key].dtype
    assert sum(taken) > 150 and len(taken) - sum(taken) > 40  # both the fast path and the reference ran


# ---- verify: drawn entries straight to the backend ---------------------------------------------------


def _chained_canary(rng, num_slots, fields):
    """Records whose chains follow slot order (slot s's predecessor is s - 1), a few broken."""
    canary = np.zeros((num_slots, fields), np.int64)
    canary[:, 0] = rng.integers(-5, 32000, num_slots)
    canary[:, 1] = np.arange(num_slots) - 1
    canary[:, 3] = np.where(rng.random(num_slots) < 0.05, 7, 0)
    for s in range(2, num_slots):
        canary[s, 2] = to_signed(int(mix3_array(canary[s - 1 : s, 2], canary[s - 1 : s, 0], canary[s - 1 : s, 1])[0]))
    broken = rng.random(num_slots) < 0.05
    canary[broken, 2] ^= 1
    canary[1, 2] = to_signed(int(numpy_fast._ANCHOR))
    return canary


def _verify_args(rng, canary, n, check_token, check_holes, targets=1):
    num_slots = canary.shape[0]
    slot = rng.integers(1, num_slots, n)
    runs = rng.random(n) < 0.7  # mostly runs of consecutive slots, as a plan lays them out
    for i in range(1, n):
        if runs[i]:
            slot[i] = slot[i - 1] % (num_slots - 1) + 1
    prev = np.concatenate([[-1], slot[:-1]])
    prev = np.where(rng.random(n) < 0.1, rng.choice([-1, 0, num_slots, num_slots + 9, 1, 2, 3]), prev)
    prev = np.where(rng.random(n) < 0.1, slot - 1, prev)
    if rng.random() < 0.5:
        slot = np.where(rng.random(n) < 0.05, rng.choice([-2, 0, num_slots, 2**62]), slot)
    position = np.where(rng.random(n) < 0.95, slot - 1, rng.integers(0, 5, n))
    tokens = np.where(rng.random(n) < 0.8, canary[np.clip(slot, 0, num_slots - 1), 0], rng.integers(-1, 3, n))
    cap = n + int(rng.integers(0, 3))
    pad = lambda a: np.concatenate([a, np.full(cap - n, 3, np.int64)]).astype(np.int64)  # noqa: E731
    log = kc.ViolationLog.allocate(int(rng.choice([2, 64, 4096])))
    kinds = [int(k) for k in rng.permutation(4)[:targets]]
    bufs = [canary] + [canary.copy() for _ in range(targets - 1)]
    for b in bufs[1:]:
        b[rng.random(num_slots) < 0.1, 1] += 1
    num_valid = int(rng.choice([n, n + 5, -1, 0])) if rng.random() < 0.2 else n
    return VerifyArgs(targets=tuple(CanaryTarget(b, k, ()) for b, k in zip(bufs, kinds)), verify_slot_indices=pad(slot),
                      verify_expected_tokens=pad(tokens), verify_expected_positions=pad(position),
                      verify_prev_slot_indices=pad(prev), verify_num_valid=np.array([num_valid], np.int32),
                      enable=np.array([int(rng.random() < 0.95)], np.int32), check_expected_token=check_token,
                      check_holes=check_holes, real_kv_hash_mode=0, log=log_views(log))


def _log_after(verify, args):
    fresh = lambda a: np.array(a, copy=True)  # noqa: E731
    log = type(args.log)(*(fresh(a) for a in args.log))
    verify(args._replace(log=log))
    return log


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, numpy_fast.VERIFY_CHUNK])
def test_drawn_verifies_match_the_reference(chunk, monkeypatch):
    """Runs of slots broken anywhere (chunk edges included), predecessors that are the entry before,
    another slot, the padding slot, past the buffer or none; slots out of range and padding
    (holes, with check_holes); every kind of mismatch; tokens checked or not; several buffers;
    small rings that fill; a disabled plan, a num_valid past the entries or negative."""
    monkeypatch.setattr(numpy_fast, "VERIFY_CHUNK", chunk)
    for seed in range(150):
        rng = np.random.default_rng(seed)
        canary = _chained_canary(rng, int(rng.integers(2, 90)), int(rng.choice([4, 4, 6])))
        args = _verify_args(rng, canary, int(rng.integers(0, 120)), bool(rng.random() < 0.5), bool(rng.random() < 0.5),
                            targets=int(rng.choice([1, 1, 2, 3])))
        want, got = _log_after(numpy_backend.verify, args), _log_after(numpy_fast.verify, args)
        for name, w, g in zip(want._fields, want, got):
            np.testing.assert_array_equal(g, w, err_msg=f"seed {seed}: {name}")


@pytest.mark.parametrize("change", ["none", "token", "position", "chain", "prev", "slot", "num_slots"])
def test_a_second_verify_of_one_plan_matches_the_reference(change, monkeypatch):
    """A step's HEAD and TAIL verifies read one plan (numpy_fast keeps the entries' links and the
    records' hashes of the last verify): the second verify, of another buffer that differs in one
    hashed field, or of entries that differ in one predecessor or slot, or of a longer buffer,
    logs what the reference logs."""
    monkeypatch.setattr(numpy_fast, "VERIFY_CHUNK", 16)
    for seed in range(40):
        rng = np.random.default_rng(seed)
        canary = _chained_canary(rng, int(rng.integers(8, 90)), 4)
        args = _verify_args(rng, canary, int(rng.integers(1, 60)), True, False)
        other = canary.copy()
        second = args
        n = int(args.verify_num_valid[0])
        i = int(rng.integers(0, max(n, 1)))
        if change in ("token", "position", "chain"):
            other[int(args.verify_slot_indices[i]) % other.shape[0], ("token", "position", "chain").index(change)] ^= 1
        elif change == "prev":
            second = args._replace(verify_prev_slot_indices=args.verify_prev_slot_indices.copy())
            second.verify_prev_slot_indices[i] = rng.choice([-1, 1, 2])
        elif change == "slot":
            second = args._replace(verify_slot_indices=args.verify_slot_indices.copy())
            second.verify_slot_indices[i] = second.verify_slot_indices[i] % (canary.shape[0] - 1) + 1
        elif change == "num_slots":
            other = np.concatenate([canary, canary[-1:]])
        second = second._replace(targets=(CanaryTarget(other, 2, ()),))
        for verify in (numpy_backend.verify, numpy_fast.verify):  # the fast one: after a verify of the first args
            numpy_fast.verify(args._replace(log=_log_after(numpy_fast.verify, args)))
            got = _log_after(verify, second)
            if verify is numpy_backend.verify:
                want = got
        for name, w, g in zip(want._fields, want, got):
            np.testing.assert_array_equal(g, w, err_msg=f"seed {seed} {change}: {name}")


def test_a_clean_run_of_chains_finds_nothing_and_a_broken_link_is_found_once():
    """Hand-made: slots 1..5 chained from the anchor; breaking slot 3's token fails slot 4's chain."""
    rec = np.zeros((6, 4), np.int64)
    chain = int(numpy_fast._ANCHOR)
    for s in range(1, 6):
        rec[s] = [100 + s, s - 1, to_signed(chain), 0]
        chain = int(mix3_array(rec[s : s + 1, 2], rec[s : s + 1, 0], rec[s : s + 1, 1])[0])
    vp = kc.VerifyPlan.allocate(5)
    vp.verify_slot_indices[:] = [1, 2, 3, 4, 5]
    vp.verify_prev_slot_indices[:] = [-1, 1, 2, 3, 4]
    vp.verify_expected_positions[:] = [0, 1, 2, 3, 4]
    vp.verify_expected_tokens[:] = -1
    vp.verify_num_valid[0] = 5
    log = kc.ViolationLog.allocate(8)
    kc.verify(rec, vp, log=log)
    assert log.read().total_violations == 0
    rec[3, 0] += 1
    kc.verify(rec, vp, log=log)
    assert int(log.violation_counters.sum()) == 1
    assert log.ring[0, 1:3].tolist() == [4, 3] and log.ring[0, 7] == 1  # slot 4 at 3: VERIFY_CHAIN_HASH_MISMATCH


# ---- write: a decode step (one token a request) against the lock-step walk's general order ------------


def _decode_write(rng, padded: bool, int32: bool):
    """A decode write (at most one token a request) of drawn slots, seeds, tokens and positions, on
    a chained canary; ``padded`` appends an unseeded request of two tokens at the padding slot (walked,
    never stored: the same outputs but two more slot runs), which makes the write and its chain walk
    take the general order."""
    num_slots, bs = 24, int(rng.integers(1, 14))
    canary = _chained_canary(rng, num_slots, 4)
    lengths = rng.integers(0, 2, bs) if rng.random() < 0.5 else np.ones(bs, np.int64)  # all ones: the decode write
    loc = rng.choice([0, 1, 5, 5, 7, 12, 23, 24, 40, -3], int(lengths.sum()))  # repeats, slot 0, past the end
    ids, pos = rng.integers(-2, 9, loc.size), rng.integers(-1, 30, loc.size)
    seeds = rng.choice([-1, 0, 1, 3, 9, 23, 24, 99], bs)
    want_ids = np.where(rng.random(ids.size) < 0.8, ids, ids + 1)
    want_pos = np.where(rng.random(pos.size) < 0.8, pos, pos - 1)
    expected, assert_positions = rng.random() < 0.5, bool(rng.random() < 0.7)
    log = kc.ViolationLog.allocate(int(rng.choice([1, 64])))
    if padded:
        lengths, seeds = np.append(lengths, 2), np.append(seeds, -1)
        loc, ids, pos = np.append(loc, [0, 0]), np.append(ids, [4, 4]), np.append(pos, [0, 1])
        want_ids, want_pos = np.append(want_ids, [4, 4]), np.append(want_pos, [0, 1])
    wp = kc.WritePlan.allocate(lengths.size + 2)
    wp.write_offsets[: lengths.size + 1] = np.concatenate([[0], np.cumsum(lengths)])
    wp.write_seed_slot_indices[: lengths.size] = seeds
    wp.write_num_valid_reqs[0] = lengths.size
    cast = (lambda x: np.asarray(x, np.int32)) if int32 else (lambda x: np.asarray(x, np.int64))  # noqa: E731
    kw = dict(expected_input_tokens=np.asarray(want_ids, np.int64),  # int64 only
              expected_input_positions=np.asarray(want_pos, np.int64)) if expected else {}
    kc.write(canary, wp, cast(ids), cast(pos), cast(loc), log=log, chain_position_assert=assert_positions, **kw)
    return canary, log


@pytest.mark.parametrize("int32", [False, True])
def test_decode_writes_match_the_general_walk_order(int32, monkeypatch):
    """The write's decode shortcuts (one token a request: no walk-order sorts, each chain its seed;
    request r writing token r: the fast backend's decode write) give the bytes of the general
    lock-step order: canary, counters and ring rows, with repeated slots (the later token wins), the
    padding slot, slots past the buffer, every kind of seed, expected-input and position-assert
    failures, a ring too small for the rows, int32 inputs."""
    decodes = []
    monkeypatch.setattr(numpy_fast, "_write_decode", lambda *a: decodes.append(a) or _WRITE_DECODE(*a))
    rows = 0
    for seed in range(300):
        got_canary, got_log = _decode_write(np.random.default_rng(seed), False, int32)
        want_canary, want_log = _decode_write(np.random.default_rng(seed), True, int32)
        np.testing.assert_array_equal(got_canary, want_canary, err_msg=f"seed {seed}")
        want_log.slot_run_counters[0] -= 2  # the padding request's two tokens
        for name in ("ring", "write_index", "violation_counters", "slot_run_counters", "kernel_run_counters",
                     "out_of_range_counters"):
            np.testing.assert_array_equal(getattr(got_log, name), getattr(want_log, name), err_msg=f"seed {seed}: {name}")
        rows += int(got_log.write_index[0])
    assert rows > 100  # failures among the cases
    assert len(decodes) > 100  # and the decode write took many of them


# ---- real-KV fingerprints --------------------------------------------------------------------------


@pytest.mark.parametrize("lanes", [0, 64, 10**6])
def test_fast_real_kv_hashes_match_the_reference(lanes, monkeypatch):
    """PARTIAL fingerprints of word-gathered sources (several slot offsets, slots below them, byte
    offsets, row widths; the sources' fold on NumPy arrays or on int lanes) and of sources it leaves
    to the reference (a paged one, a padded row copy), for 1 to 300 slots, ALL and NONE too, and the
    prepared views of a sources tuple reused while it lives, rebuilt for another."""
    from kvcanary_cupy.args import SourceViews
    from kvcanary_cupy.backends import SourceView

    monkeypatch.setattr(numpy_kv, "LANE_FOLD_MAX_SLOTS", lanes)
    rng = np.random.default_rng(lanes)
    rows = 40
    data = [rng.integers(0, 256, (rows, w), dtype=np.uint8) for w in (32, 32, 48, 64)]
    padded = np.zeros((rows, 48), np.uint8)[:, :32]
    words = (SourceView(data[0], 1, 32, 32), SourceView(data[1], 1, 32, 32, slot_offset=5),
             SourceView(data[2], 1, 48, 48, byte_offset=16, slot_offset=5), SourceView(data[3], 1, 64, 64, byte_offset=8))
    others = (SourceView(data[0].reshape(-1, 64), 2, 32, 32), SourceView(padded, 1, 32, 32))
    cases = [words, words[:1], words[1:3], words + others[:1], others[1:] + words]
    cases += [SourceViews(c) for c in cases]  # a bound launcher's: views kept on it
    for sources in cases:
        for n in (1, 3, 12, 64, 65, 300):
            slots = rng.integers(0, rows, n).astype(np.int64)
            for mode in kc.RealKvHashMode:
                want = numpy_backend.real_kv_hashes(sources, int(mode), slots)
                for _ in range(2):  # the second call through the prepared views
                    got = numpy_fast.real_kv_hashes(sources, int(mode), slots)
                    assert got.dtype == want.dtype and got.tolist() == want.tolist(), (len(sources), n, mode)
    assert numpy_fast.real_kv_hashes(words, int(kc.RealKvHashMode.PARTIAL), np.zeros(0, np.int64)).shape == (0,)
    kept = cases[len(cases) // 2]  # SourceViews(words), its views kept by the calls above
    assert len(kept.words) == len(words)
    for data_row in range(3):  # the kept views read the pools' bytes as they are now
        data[0][data_row + 1] ^= 0x5A
        data[2][data_row + 7, 16:] += 1
        slots = np.arange(rows, dtype=np.int64)
        assert (numpy_fast.real_kv_hashes(kept, int(kc.RealKvHashMode.PARTIAL), slots).tolist()
                == numpy_backend.real_kv_hashes(words, int(kc.RealKvHashMode.PARTIAL), slots).tolist())
    # a new tuple of other sources at a reused id gets its own views (the cache keeps its tuple alive)
    fresh = (SourceView(data[3], 1, 64, 64),)
    slots = np.arange(rows, dtype=np.int64)
    assert (numpy_fast.real_kv_hashes(fresh, int(kc.RealKvHashMode.PARTIAL), slots).tolist()
            == numpy_backend.real_kv_hashes(fresh, int(kc.RealKvHashMode.PARTIAL), slots).tolist())


# ---- staging: the clean step's header and counters -----------------------------------------------


def _staged_records(corrupt_steps):
    """Every record a session's steps stage (a copy as staged), a few of them with corrupted slots."""
    session = kc.CanarySession(64, max_batch_size=4, on_violation="ignore", check_expected_tokens=True)
    req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)
    staged, stager = [], session._step_stager

    def snapshot(stamp, stream=None, staging=None):
        stager(stamp, stream, staging)
        staged.append(staging.copy())

    session._step_stager = snapshot
    pool = np.arange(64, dtype=np.int32).reshape(4, 16) + 5
    for step in range(5):
        prefix = np.array([3 * step, 3 * step])
        if step in corrupt_steps:
            session.head_canary[16 + max(3 * step - 1, 0), 0] ^= 1
        session.pre_forward(np.array([1, 2]), prefix, np.array([3, 3]), req_to_token,
                            np.concatenate([pool[1, 3 * step : 3 * step + 3], pool[2, 3 * step : 3 * step + 3]]).astype(np.int64),
                            np.concatenate([np.arange(3 * step, 3 * step + 3)] * 2),
                            np.concatenate([16 + np.arange(3 * step, 3 * step + 3), 32 + np.arange(3 * step, 3 * step + 3)]),
                            expected_tokens=pool, expected_tokens_valid_lens=prefix)
        session.post_forward()
        session.end_step()
    return staged, session.stats


@pytest.mark.parametrize("corrupt_steps", [(), (2,), (1, 4)])
def test_staged_records_match_the_reference(corrupt_steps, monkeypatch):
    """A clean staging (numpy_fast.prepare_stage) writes the bytes the reference's does, before and
    after steps whose rows it leaves to the reference."""
    fast, fast_stats = _staged_records(corrupt_steps)
    monkeypatch.setattr(numpy_fast, "prepare_stage", numpy_backend.prepare_stage)
    want, want_stats = _staged_records(corrupt_steps)
    assert len(fast) == len(want) == 5
    for step, (w, g) in enumerate(zip(want, fast)):
        np.testing.assert_array_equal(g, w, err_msg=f"step {step}")
    assert fast_stats == want_stats
    assert (fast_stats["rows_read"] > 0) == bool(corrupt_steps)
