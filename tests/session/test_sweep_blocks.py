"""CanarySession.sweep_blocks: a prefix cache's blocks swept from (block, start, predecessor) triples
(issue 23, gap 4), on every backend."""

import numpy as np
import pytest

import kvcanary_cupy as kc

I64 = np.int64
B = 4


def a64(ab, values):
    return ab.asarray(np.asarray(values, I64))


def session_with_two_sequences(ab, **kwargs):
    """Sequence A: positions 0..7 in blocks 3, 1; sequence B: 0..3 in block 2 (one step)."""
    session = kc.CanarySession(32, max_batch_size=2, like=ab.like, on_violation="ignore", **kwargs)
    table = kc.BlockTable(ab.asarray(np.array([[3, 1], [2, 0]], np.int32)), B)
    loc = [12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    session.pre_forward(a64(ab, [0, 1]), a64(ab, [0, 0]), a64(ab, [8, 4]), table, a64(ab, range(100, 112)),
                        a64(ab, list(range(8)) + list(range(4))), a64(ab, loc))
    session.post_forward()
    session.end_step()
    session.check()
    return session


def test_correct_triples_verify_every_block_once(ab):
    session = session_with_two_sequences(ab)
    session.sweep_blocks(a64(ab, [3, 1, 2]), a64(ab, [0, 4, 0]), a64(ab, [-1, 15, -1]), block_size=B)
    session.check()
    assert session.stats["violations"] == 0 and session.stats["sweeps"] == 1
    assert session.stats["verified_entries"] == 3 * B  # the step read nothing (prefix 0); the sweep 3 blocks
    assert session.stats["verify_skipped_sweeps"] == 0


@pytest.mark.parametrize("wrong,slots,reason", [
    ("start", [4, 5, 6, 7], kc.FailReason.VERIFY_POSITION_MISMATCH),  # block 1 claimed at position 0
    ("predecessor", [4], kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH),  # block 1 chained to block 2's last slot
])
def test_a_wrong_triple_is_reported_at_its_block_with_its_label(ab, wrong, slots, reason):
    session = session_with_two_sequences(ab)
    starts, prevs = [0, 0 if wrong == "start" else 4, 0], [-1, 11 if wrong == "predecessor" else 15, -1]
    session.sweep_blocks(a64(ab, [3, 1, 2]), a64(ab, starts), a64(ab, prevs), block_size=B, labels=["b3", "b1", "b2"])
    session.check()
    report = session.report()
    assert sorted(v.slot_idx for v in report.violations) == slots
    assert all(v.fail_reason_bits & reason and v.request_ids == ("b1",) and v.batch_rows == (1,) for v in report.violations)


def test_a_flipped_block_is_reported_through_its_fingerprint(ab):
    kv = ab.asarray(np.arange(32 * 16, dtype=np.uint8).reshape(32, 16))
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=16, read_bytes=16)
    session = session_with_two_sequences(ab, real_kv_sources=[source], real_kv_hash_mode=kc.RealKvHashMode.ALL)
    host = ab.to_numpy(kv)
    host[9, 0] ^= 1
    kv[9, 0] = int(host[9, 0])
    session.sweep_blocks(a64(ab, [3, 1, 2]), a64(ab, [0, 4, 0]), a64(ab, [-1, 15, -1]), block_size=B)
    session.check()
    assert [(v.slot_idx, v.fail_reason_bits) for v in session.report().violations] == [(9, int(kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH))]


def test_a_sweep_past_the_capacity_is_skipped_and_counted(ab):
    session = kc.CanarySession(32, max_batch_size=2, verify_capacity=7, like=ab.like, on_violation="ignore")
    session.sweep_blocks(a64(ab, [1, 2]), a64(ab, [0, 4]), a64(ab, [-1, 7]), block_size=B)
    session.check()
    assert session.stats["verify_skipped_sweeps"] == 1 and session.stats["violations"] == 0


def test_out_of_range_blocks_are_counted_never_read(ab):
    session = kc.CanarySession(16, max_batch_size=2, like=ab.like, on_violation="ignore")
    session.sweep_blocks(a64(ab, [9, -1]), a64(ab, [0, 0]), a64(ab, [-1, -1]), block_size=B)
    assert session.check() == 8  # 2 blocks x 4 slots outside the 16-slot canary
    assert session.stats["violations"] == 0


def test_bad_triples_name_the_argument():
    session = kc.CanarySession(16, max_batch_size=2)
    with pytest.raises(ValueError, match=r"start_positions must be \[len\(blocks\)=2\]"):
        session.sweep_blocks(np.array([1, 2]), np.array([0]), np.array([-1, 3]), block_size=B)
    with pytest.raises(ValueError, match="labels must name every block"):
        session.sweep_blocks(np.array([1, 2]), np.array([0, 4]), np.array([-1, 3]), block_size=B, labels=["x"])
    with pytest.raises(ValueError, match="block_size"):
        session.sweep_blocks(np.array([1]), np.array([0]), np.array([-1]), block_size=0)
