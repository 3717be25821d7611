"""Write waves (``write(..., write_waves=, wave=)``) and the seed values they replaced.

A step written in several launches (kc.SameStepReads) marks each request with its write wave; a
launch writes the requests of its own wave only, the others skipped as if absent.  Every seed keeps
SGLang's meaning: any negative seed, INT64_MIN included, starts a new chain (the library once
spent INT64_MIN on "skip this request", which no SGLang seed means).  Expected records are built
by hand from the reference hash in canary_builders, not from the library; every backend, the free
function and the bound launcher alike.
"""

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import ANCHOR_H, hmix3, make_log, make_write_plan, signed

INT64_MIN = -(2**63)
N_SLOTS = 16
BOUND = pytest.mark.parametrize("bound", [False, True], ids=["free", "bound"])


def run_write(ab, offsets, seeds, ids, pos, loc, *, bound, canary=None, log=None, waves=None, strict=False):
    """Write one step, once per entry of ``waves`` (None: one launch without write_waves, else
    ``(write_waves, [wave, ...])``); returns the canary buffer and the log on the backend."""
    canary = ab.asarray(np.zeros((N_SLOTS, 4), np.int64)) if canary is None else canary
    log = make_log(ab) if log is None else log
    wp = make_write_plan(ab, offsets, seeds)
    options = [{}] if waves is None else [{"write_waves": ab.asarray(np.asarray(waves[0], np.int32)), "wave": k}
                                          for k in waves[1]]
    step = [ab.asarray(np.asarray(x, np.int64)) for x in (ids, pos, loc)]
    for o in options:
        if bound:
            kc.WriteLauncher(canary, wp, log=log, **o)(*step)
        else:
            kc.write(canary, wp, *step, log=log, strict=strict, **o)
    return canary, log


def counters(ab, log):
    """(slots written, out-of-range values, violations, launches) of launch kind 0."""
    return tuple(int(ab.to_numpy(getattr(log, k))[0]) for k in ("slot_run_counters", "out_of_range_counters",
                                                                 "violation_counters", "kernel_run_counters"))


@BOUND
def test_a_seed_of_int64_min_is_an_anchor_like_every_other_negative_seed(ab, bound):
    # Request 0 writes tokens 7, 8 at positions 5, 6 into slots 1, 2 (the warp path), request 1
    # token 9 at position 3 into slot 4 (a lane of its own).  Slot 3 holds a record a positive seed
    # would continue from; no negative seed reads it, and an anchor has no position to continue.
    offsets, ids, pos, loc = [0, 2, 3], [7, 8, 9], [5, 6, 3], [1, 2, 4]
    first = hmix3(ANCHOR_H, 7, 5)
    want = np.zeros((N_SLOTS, 4), np.int64)
    want[3] = [1, 40, 123, 0]
    want[1] = [7, 5, signed(ANCHOR_H), 0]
    want[2] = [8, 6, signed(first), 0]
    want[4] = [9, 3, signed(ANCHOR_H), 0]
    for seeds in ([-1, -1], [INT64_MIN, INT64_MIN], [INT64_MIN, -1], [-7, INT64_MIN], [-(2**63) + 1, -2]):
        start = np.zeros((N_SLOTS, 4), np.int64)
        start[3] = [1, 40, 123, 0]
        canary, log = run_write(ab, offsets, seeds, ids, pos, loc, bound=bound, canary=ab.asarray(start))
        assert ab.to_numpy(canary).tolist() == want.tolist(), seeds
        assert counters(ab, log) == (3, 0, 0, 1), seeds  # nothing skipped, out of range or violated
        assert int(ab.to_numpy(log.write_index)[0]) == 0
    # Strict mode agrees: INT64_MIN is no out-of-range seed.
    canary, log = run_write(ab, offsets, [INT64_MIN, INT64_MIN], ids, pos, loc, bound=False, strict=True)
    assert ab.to_numpy(canary)[1:3, :3].tolist() == [[7, 5, signed(ANCHOR_H)], [8, 6, signed(first)]]


def three_requests(seed1=2, slot1=3):
    """r0 writes tokens 7, 8 (positions 0, 1) into slots 1, 2 as an anchor, wave 0; r1 token 9
    (position 2) into ``slot1``, continuing from ``seed1`` (slot 2: r0's last token), wave 1; r2
    tokens 4, 5, 6 (positions 0-2) into slots 5-7 with seed INT64_MIN (an anchor), wave 0."""
    return dict(offsets=[0, 2, 3, 6], seeds=[-1, seed1, INT64_MIN], ids=[7, 8, 9, 4, 5, 6], pos=[0, 1, 2, 0, 1, 2],
                loc=[1, 2, slot1, 5, 6, 7])


@BOUND
def test_each_wave_writes_its_own_requests_and_nothing_of_the_others(ab, bound):
    step = three_requests()
    waves = [0, 1, 0]
    canary, log = run_write(ab, **step, bound=bound, waves=(waves, [0]))
    r0 = [hmix3(ANCHOR_H, 7, 0)]
    r2 = [hmix3(ANCHOR_H, 4, 0)]
    r2.append(hmix3(r2[0], 5, 1))
    want = np.zeros((N_SLOTS, 4), np.int64)
    want[1], want[2] = [7, 0, signed(ANCHOR_H), 0], [8, 1, signed(r0[0]), 0]
    want[5], want[6], want[7] = [4, 0, signed(ANCHOR_H), 0], [5, 1, signed(r2[0]), 0], [6, 2, signed(r2[1]), 0]
    assert ab.to_numpy(canary).tolist() == want.tolist()  # slot 3 (r1, wave 1) untouched
    assert counters(ab, log) == (5, 0, 0, 1)

    # Wave 1 writes r1 alone, continuing from the record wave 0 left in slot 2 (position 1, so
    # position 2 passes the chain-position assert); wave 2 holds no request and writes nothing.
    run_write(ab, **step, bound=bound, canary=canary, log=log, waves=(waves, [1, 2]))
    want[3] = [9, 2, signed(hmix3(r0[0], 8, 1)), 0]
    assert ab.to_numpy(canary).tolist() == want.tolist()
    assert counters(ab, log) == (6, 0, 0, 3)

    # The waves in one go equal the same step written in order by hand, one launch a request.
    whole, whole_log = run_write(ab, **step, bound=bound, waves=(waves, [0, 1, 2]))
    assert ab.to_numpy(whole).tolist() == want.tolist() and counters(ab, whole_log) == (6, 0, 0, 3)


@BOUND
def test_a_request_of_another_wave_is_neither_checked_nor_counted(ab, bound):
    # r1's seed (40) and slot (50) lie outside the 16 slots: wave 0 skips r1, so they count only
    # in wave 1 (and only strict mode's wave 1 raises).
    step = three_requests(seed1=40, slot1=50)
    canary, log = run_write(ab, **step, bound=bound, waves=([0, 1, 0], [0]))
    assert counters(ab, log) == (5, 0, 0, 1)
    run_write(ab, **step, bound=bound, canary=canary, log=log, waves=([0, 1, 0], [1]))
    assert counters(ab, log) == (5, 2, 0, 2)
    assert not ab.to_numpy(canary)[3].any()
    if not bound:
        run_write(ab, **step, bound=False, waves=([0, 1, 0], [0]), strict=True)
        with pytest.raises(ValueError, match=r"write_plan.write_seed_slot_indices\[1\] = 40 is outside"):
            run_write(ab, **step, bound=False, waves=([0, 1, 0], [1]), strict=True)


def test_write_waves_and_wave_are_checked_by_name(ab):
    step = three_requests()
    wp = make_write_plan(ab, step["offsets"], step["seeds"])
    canary, log = ab.asarray(np.zeros((N_SLOTS, 4), np.int64)), make_log(ab)
    tokens = [ab.asarray(np.asarray(step[k], np.int64)) for k in ("ids", "pos", "loc")]
    waves32 = ab.asarray(np.zeros(3, np.int32))
    cases = [
        (dict(wave=1), ValueError, r"wave=1 selects the requests whose write_waves entry is 1; pass write_waves"),
        (dict(write_waves=waves32, wave=-1), ValueError, r"wave must be non-negative, got -1"),
        (dict(write_waves=waves32, wave=True), TypeError, r"wave"),
        (dict(write_waves=ab.asarray(np.zeros(3, np.int64))), TypeError, r"write_waves must have dtype int32"),
        (dict(write_waves=ab.asarray(np.zeros(2, np.int32))), ValueError, r"write_waves length must be write_req_capacity=3, got 2"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            kc.write(canary, wp, *tokens, log=log, **options)
        with pytest.raises(error, match=message):
            kc.WriteLauncher(canary, wp, log=log, **options)
    assert not ab.to_numpy(canary).any() and counters(ab, log) == (0, 0, 0, 0)
