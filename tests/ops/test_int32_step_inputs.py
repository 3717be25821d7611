"""int32 per-step inputs (transformers builds input_ids, position_ids and cu_seq_lens as int32): write and
the session read them as they are, byte-identical to int64, on every backend (issue 22, gap 4)."""

import itertools

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvHashMode, RealKvSource
from canary_builders import a64, canary, kv_bytes
from test_write import make_log, make_write_plan


@pytest.mark.parametrize("widths", list(itertools.product((np.int32, np.int64), repeat=3)))
def test_write_reads_each_token_input_in_its_own_dtype(ab, widths):
    """Every mix of int32 and int64 input_ids / positions / out_cache_loc writes the same canary bytes
    and log as all-int64, real-KV fingerprints and a decode plus a prefill request included."""
    ids, pos, loc = [7, 8, 9, 1000000], [4, 0, 1, 2], [5, 9, 10, 11]
    src = RealKvSource(ab.asarray(kv_bytes(16, 32, seed=1)), 1, 32, 32)
    out = []
    for dtypes in ((np.int64,) * 3, widths):
        buf, log = ab.asarray(canary(16)), make_log(ab)
        wp = make_write_plan(ab, [0, 1, 4], [4, -1])
        args = [ab.asarray(np.array(v, d)) for v, d in zip((ids, pos, loc), dtypes)]
        kc.write(buf, wp, *args, log=log, real_kv_sources=(src,), real_kv_hash_mode=RealKvHashMode.ALL)
        out.append((ab.to_numpy(buf).tobytes(), log.read().to_json()))
    assert out[0] == out[1]
    assert ab.to_numpy(buf)[10, :2].tolist() == [9, 1]


def test_session_takes_int32_step_inputs(ab):
    """A session stepped with int32 input_ids, positions and out_cache_loc (and an int32 CSR indptr)
    ends with the same canary buffers and stats as one stepped with int64."""
    results = []
    for dtype in (np.int64, np.int32):
        s = kc.CanarySession(64, max_batch_size=2, like=ab.like, on_violation="ignore")
        indptr = ab.asarray(np.array([0, 3, 5], np.int32))
        steps = [((0, 0), (3, 2), [1, 2, 3, 4, 5], [0, 1, 2, 0, 1], [7, 8, 9, 20, 21]),
                 ((3, 2), (1, 1), [6, 7], [3, 2], [10, 22])]
        for prefix, extend, ids, pos, loc in steps:
            kv = [7, 8, 9, 10, 20, 21, 22][: sum(prefix) + sum(extend)]
            table = kc.PagedKvIndices(ab.asarray(np.array([0, prefix[0] + extend[0], sum(prefix) + sum(extend)], np.int32)),
                                      a64(ab, [7, 8, 9, 10, 20, 21, 22][: prefix[0] + extend[0]]
                                          + [20, 21, 22][: prefix[1] + extend[1]]), page_size=1)
            s.pre_forward(None, a64(ab, prefix), a64(ab, extend), table, *(ab.asarray(np.array(v, dtype)) for v in (ids, pos, loc)))
            s.post_forward()
            s.end_step()
        s.check()
        results.append((ab.to_numpy(s.head_canary).tobytes(), ab.to_numpy(s.tail_canary).tobytes(),
                        {k: v for k, v in s.stats.items()}))
        del indptr, kv
    assert results[0] == results[1]
    assert results[0][2]["verified_entries"] == 5 and results[0][2]["violations"] == 0
