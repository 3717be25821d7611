"""An engine whose slot 0 is a real slot (transformers 5.17 hands out block 0 first): the canary keeps
its padding slot 0 apart by shifting every engine slot by ``slot_offset`` (RealKvSource.slot_offset;
the tables and out_cache_loc name canary slots), on every backend."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvHashMode, RealKvSource
from canary_builders import HostSource, a64, canary, fold_strips, kv_bytes, signed
from test_write import write


def _strip(host: HostSource, pool_slot: int, nbytes: int) -> bytes:
    return host.strip(pool_slot, nbytes)


@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
@pytest.mark.parametrize("offset, page_size", [(1, 1), (4, 1), (4, 4), (3, 2)])
def test_slot_offset_fingerprints_the_shifted_pool_slot(ab, mode, offset, page_size):
    pool_slots = 12
    data = kv_bytes(pool_slots // page_size, page_size * 32, seed=offset)
    src = RealKvSource(ab.asarray(data), page_size, 32, 32, slot_offset=offset)
    host = HostSource(data, page_size, 32, 32)
    num_slots = pool_slots + offset
    slots = [offset, offset + 1, num_slots - 1]  # pool slots 0, 1 and the last one
    b, _ = write(ab, ab.asarray(canary(num_slots)), [0, 3], [-1], [7, 8, 9], [0, 1, 2], slots,
                 real_kv_sources=(src,), real_kv_hash_mode=mode)
    nbytes = 16 if mode == RealKvHashMode.PARTIAL else 32
    for s in slots:
        assert int(b[s, 3]) == signed(fold_strips([_strip(host, s - offset, nbytes)])) != 0


def test_slots_below_the_offset_fold_a_zero_strip(ab):
    """A canary slot below slot_offset has no KV bytes in the source: its strip folds as zero (no read
    before the pool), next to a source without offset that reads its own bytes."""
    data = kv_bytes(8, 16, seed=3)
    shifted = RealKvSource(ab.asarray(data), 1, 16, 16, slot_offset=4)
    plain = RealKvSource(ab.asarray(kv_bytes(12, 16, seed=4)), 1, 16, 16)
    host_plain = HostSource(kv_bytes(12, 16, seed=4), 1, 16, 16)
    b, _ = write(ab, ab.asarray(canary(12)), [0, 2], [-1], [1, 2], [0, 1], [2, 3],
                 real_kv_sources=(shifted, plain), real_kv_hash_mode=RealKvHashMode.PARTIAL)
    for s in (2, 3):
        assert int(b[s, 3]) == signed(fold_strips([b"", host_plain.strip(s, 16)]))


def test_slot_offset_verify_catches_a_flip_at_pool_slot_zero(ab):
    """Pool slot 0 (canary slot `offset`) is verified like any other: a flip of its KV bytes is a
    real-KV violation, found by the TAIL verify of a reader."""
    offset = 4
    data = kv_bytes(8, 16, seed=5)
    kv = ab.asarray(data)
    src = RealKvSource(kv, 1, 16, 16, slot_offset=offset)
    table = kc.PagedKvIndices(a64(ab, [0, 2]), a64(ab, [offset, offset + 1]), page_size=1)
    buf = ab.asarray(canary(8 + offset))
    vp, wp = kc.plan(None, a64(ab, [0]), a64(ab, [2]), table, verify_capacity=8)
    log = kc.ViolationLog.allocate(16, like=buf)
    kc.write(buf, wp, a64(ab, [11, 12]), a64(ab, [0, 1]), a64(ab, [offset, offset + 1]), log=log,
             real_kv_sources=(src,), real_kv_hash_mode=RealKvHashMode.PARTIAL)
    vp, _ = kc.plan(None, a64(ab, [2]), a64(ab, [0]), table, verify_capacity=8)
    kc.verify(buf, vp, log=log, real_kv_sources=(src,), real_kv_hash_mode=RealKvHashMode.PARTIAL)
    assert log.read().total_violations == 0
    flipped = data.copy()
    flipped[0, 3] ^= 0x10
    src = RealKvSource(ab.asarray(flipped), 1, 16, 16, slot_offset=offset)
    kc.verify(buf, vp, log=log, real_kv_sources=(src,), real_kv_hash_mode=RealKvHashMode.PARTIAL)
    report = log.read()
    assert [(v.slot_idx, v.position, v.reasons) for v in report.violations] == [(offset, 0, "verify_real_kv_hash")]


def test_slot_offset_rows_cover_the_shifted_slots_and_bad_offsets_are_named(ab):
    src = RealKvSource(ab.asarray(np.zeros((8, 16), np.uint8)), 1, 16, 16, slot_offset=4)
    with pytest.raises(ValueError, match=r"8 slots from slot_offset=4 but canary_buf has 13"):
        write(ab, ab.asarray(canary(13)), [0, 1], [-1], [1], [0], [5], real_kv_sources=(src,),
              real_kv_hash_mode=RealKvHashMode.PARTIAL)
    for bad in (-1, 1.5, 2**62):
        with pytest.raises(ValueError, match=r"^kv-canary: RealKvSource.slot_offset must be an int in \[0, 2\*\*62\)"):
            RealKvSource(ab.asarray(np.zeros((8, 16), np.uint8)), 1, 16, 16, slot_offset=bad)
