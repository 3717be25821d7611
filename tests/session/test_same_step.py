"""Same-step reads (kc.resolve_same_step_reads, CanarySession(same_step_reads=True)) and row labels.

The engine behaviour modelled: vLLM's scheduler matches prefix blocks when it schedules, so a
request B of a step may read, as its cached prefix, blocks another request A writes in that very
step; B's chain continues from a slot A writes.  Every backend computes the same bytes.
"""

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import hmix3, signed

I64 = np.int64
B = 4  # block size


def a64(ab, values):
    return ab.asarray(np.asarray(values, I64))


def a32(ab, values):
    return ab.asarray(np.asarray(values, np.int32))


def shared_prefix_step(tokens_b=None):
    """A writes positions 0..7 into blocks 1, 2; B (same step) reads them as its prefix and writes
    positions 8, 9 into block 3.  Returns (block table, prefix_lens, extend_seq_lens, input_ids,
    positions, out_cache_loc, expected-token pool, its valid lengths)."""
    table = np.array([[1, 2, 0], [1, 2, 3]], np.int32)
    prompt = list(range(100, 108))
    ids = prompt + [200, 201]
    pool = np.zeros((2, 12), I64)
    pool[0, :8] = prompt
    pool[1, :10] = prompt + [200, 201] if tokens_b is None else tokens_b
    return (table, np.array([0, 8]), np.array([8, 2]), np.array(ids, I64), np.array(list(range(8)) + [8, 9], I64),
            np.arange(4, 14, dtype=I64), pool, np.array([8, 10]))


def resolve(ab, table, prefix, extend, ids, pos, loc, pool=None, lens=None, *, num_slots=16, waves=3):
    vp, wp = kc.plan(a64(ab, [0, 1][: len(prefix)]) if table.shape[0] > 1 else a64(ab, [0]), a64(ab, prefix),
                     a64(ab, extend), kc.BlockTable(ab.asarray(table), B), verify_capacity=64,
                     req_to_verify_expected_tokens=None if pool is None else a32(ab, pool),
                     req_to_verify_expected_tokens_valid_lens=None if lens is None else a64(ab, lens))
    reads = kc.SameStepReads.allocate(num_slots, len(prefix), waves=waves, like=ab.like)
    kc.resolve_same_step_reads(reads, vp, wp, a64(ab, ids), a64(ab, pos), a64(ab, loc))
    n = int(ab.to_numpy(vp.verify_num_valid)[0])
    return ab.to_numpy(vp.verify_slot_indices)[:n], ab.to_numpy(reads.write_waves), reads.counts(), ab.to_numpy(reads.written_at)


def test_reads_of_blocks_written_in_the_step_are_verified_as_written(ab):
    table, prefix, extend, ids, pos, loc, pool, lens = shared_prefix_step()
    slots, waves, counts, written_at = resolve(ab, table, prefix, extend, ids, pos, loc, pool, lens)
    assert slots.tolist() == [0] * 8  # B's 8 prefix entries: exactly what A writes there
    # B's seed is slot 11 (position 7), written by A: B waits for wave 1; A (anchor) is wave 0.
    assert waves.dtype == np.int32 and waves.tolist() == [0, 1]
    assert counts == {"stamp": 1, "verified_as_written": 8, "deeper_than_waves": 0}
    assert written_at[4:14].tolist() == [(1 << 32) | i for i in range(10)] and written_at[:4].tolist() == [0] * 4


@pytest.mark.parametrize("fault", ["token", "position", "slot", "predecessor"])
def test_a_read_that_differs_from_what_the_step_writes_stays_verified(ab, fault):
    table, prefix, extend, ids, pos, loc, pool, lens = shared_prefix_step()
    if fault == "token":  # B's prompt differs at position 5 (a wrong prefix-cache hit)
        pool[1, 5] = 999
    elif fault == "position":  # A writes position 6 one off
        pos[6] = 7
    elif fault == "slot":  # A's token 6 lands one slot off: slot 10 is written by no token at position 6
        loc[6] = 11
    else:  # B's block table gives position 3 another block, so position 4's predecessor differs from A's
        table[1] = [3, 2, 1]
    slots, _, counts, _ = resolve(ab, table, prefix, extend, ids, pos, loc, pool, lens)
    kept = {"token": [5], "position": [6], "slot": [6, 7], "predecessor": [0, 1, 2, 3, 4]}[fault]
    assert [i for i, s in enumerate(slots) if s != 0] == kept
    assert counts["verified_as_written"] == 8 - len(kept)


def test_a_chain_of_deferrals_gets_one_wave_per_link_and_the_overflow_is_counted(ab):
    # A writes 0..3 (block 1), B reads them and writes 4..7 (block 2), C reads 0..7 and writes 8.
    table = np.array([[1, 0, 0], [1, 2, 0], [1, 2, 3]], np.int32)
    prefix, extend = np.array([0, 4, 8]), np.array([4, 4, 1])
    ids = np.arange(9, dtype=I64) + 50
    pos = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8], I64)
    loc = np.array([4, 5, 6, 7, 8, 9, 10, 11, 12], I64)
    rp = a64(ab, [0, 1, 2])
    for waves, want, deeper in ((3, [0, 1, 2], 0), (2, [0, 1, 1], 1)):
        vp, wp = kc.plan(rp, a64(ab, prefix), a64(ab, extend), kc.BlockTable(ab.asarray(table), B), verify_capacity=64)
        reads = kc.SameStepReads.allocate(16, 3, waves=waves, like=ab.like)
        kc.resolve_same_step_reads(reads, vp, wp, a64(ab, ids), a64(ab, pos), a64(ab, loc))
        assert ab.to_numpy(reads.write_waves).tolist() == want
        assert reads.counts()["deeper_than_waves"] == deeper
        assert reads.counts()["verified_as_written"] == 12  # B's 4 and C's 8 entries


def test_the_wave_options_write_a_deferred_request_after_its_seed(ab):
    # The resolve leaves the seeds as the plan made them; wave 0 writes A alone, wave 1 B, whose
    # chain continues from A's record in slot 11 (position 7).
    table, prefix, extend, ids, pos, loc, _, _ = shared_prefix_step()
    vp, wp = kc.plan(a64(ab, [0, 1]), a64(ab, prefix), a64(ab, extend), kc.BlockTable(ab.asarray(table), B),
                     verify_capacity=64)
    seeds = ab.to_numpy(wp.write_seed_slot_indices).tolist()
    reads = kc.SameStepReads.allocate(16, 2, like=ab.like)
    step = [a64(ab, x) for x in (ids, pos, loc)]
    kc.resolve_same_step_reads(reads, vp, wp, *step)
    assert ab.to_numpy(wp.write_seed_slot_indices).tolist() == seeds == [-1, 11]
    canary, log = kc.allocate_canary_buffer(16, like=ab.like), kc.ViolationLog.allocate(8, like=ab.like)
    options = reads.wave_options()
    assert [o["wave"] for o in options] == [0, 1, 2] and all(o["write_waves"] is reads.write_waves for o in options)
    kc.write(canary, wp, *step, log=log, **options[0])
    out = ab.to_numpy(canary)
    assert out[4:12, 0].tolist() == list(range(100, 108)) and not out[12:14].any()  # B waits
    for o in options[1:]:
        kc.write(canary, wp, *step, log=log, **o)
    out = ab.to_numpy(canary)
    assert out[12:14, :2].tolist() == [[200, 8], [201, 9]]
    assert out[12, 2] == out_hash(out[11])  # B's first token chains from A's last record
    assert int(ab.to_numpy(log.slot_run_counters)[0]) == 10 and int(ab.to_numpy(log.violation_counters)[0]) == 0


def out_hash(record):
    """The chain value after a stored record (its prev_hash mixed with its token and position), signed."""
    return signed(hmix3(int(record[2]), int(record[0]), int(record[1])))


def random_step(rng):
    """A batch whose later requests share earlier requests' blocks, some written this step."""
    bs, width = int(rng.integers(1, 7)), 6
    num_blocks = 24
    table = np.zeros((bs, width), np.int32)
    prefix, extend = np.zeros(bs, I64), np.zeros(bs, I64)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    for r in range(bs):
        if r and rng.random() < 0.6:  # share a prefix of an earlier row's blocks
            src = int(rng.integers(0, r))
            k = int(rng.integers(1, width))
            table[r, :k] = table[src, :k]
            prefix[r] = int(rng.integers(0, k * B + 1))
        for c in range(width):
            if table[r, c] == 0 and free:
                table[r, c] = free.pop()
        extend[r] = int(rng.integers(0, width * B - prefix[r] + 1)) if rng.random() < 0.8 else 0
    tok, pos, loc = [], [], []
    for r in range(bs):
        for p in range(prefix[r], prefix[r] + extend[r]):
            pos.append(p if rng.random() < 0.95 else p + 1)
            loc.append(table[r, p // B] * B + p % B if rng.random() < 0.95 else int(rng.integers(-1, num_blocks * B)))
            tok.append(int(p % 7))  # position-determined: shared prefixes agree
    pool = np.tile(np.arange(width * B) % 7, (bs, 1)).astype(I64)
    pool[rng.random(pool.shape) < 0.03] = 5
    return table, prefix, extend, np.array(tok, I64), np.array(pos, I64), np.array(loc, I64), pool, num_blocks * B


@pytest.mark.parametrize("seed", range(6))
def test_every_backend_resolves_the_same_bytes(ab, seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        table, prefix, extend, ids, pos, loc, pool, num_slots = random_step(rng)
        bs = len(prefix)
        got = []
        for backend in (ab, None):
            x = backend or _NUMPY
            vp, wp = kc.plan(a64(x, np.arange(bs)), a64(x, prefix), a64(x, extend), kc.BlockTable(x.asarray(table), B),
                             verify_capacity=256, req_to_verify_expected_tokens=a32(x, pool),
                             req_to_verify_expected_tokens_valid_lens=a64(x, np.full(bs, pool.shape[1])))
            reads = kc.SameStepReads.allocate(num_slots, bs, like=x.like)
            for _step in range(2):  # the second resolve of the same step finds its own marks again
                kc.resolve_same_step_reads(reads, vp, wp, a64(x, ids), a64(x, pos), a64(x, loc))
            n = int(x.to_numpy(vp.verify_num_valid)[0])
            got.append((x.to_numpy(vp.verify_slot_indices)[:n].tolist(), x.to_numpy(reads.write_waves).tolist(),
                        x.to_numpy(reads.counters).tolist(), x.to_numpy(reads.written_at).tolist()))
        assert got[0] == got[1]


class _NumpyBackend:
    name = "numpy"
    asarray = staticmethod(lambda a: np.array(a, copy=True))
    to_numpy = staticmethod(lambda x: np.asarray(x).copy())
    like = None


_NUMPY = _NumpyBackend()


def run_steps(ab, steps, *, same_step_reads, labels=None):
    """A session over ``steps`` (each: block table, prefix, extend, ids, pos, loc, pool, lens)."""
    session = kc.CanarySession(64, max_batch_size=4, like=ab.like, on_violation="ignore", check_expected_tokens=True,
                               same_step_reads=same_step_reads)
    for k, (table, prefix, extend, ids, pos, loc, pool, lens) in enumerate(steps):
        session.pre_forward(a64(ab, np.arange(len(prefix))), a64(ab, prefix), a64(ab, extend),
                            kc.BlockTable(ab.asarray(table), B), a64(ab, ids), a64(ab, pos), a64(ab, loc),
                            expected_tokens=a32(ab, pool), expected_tokens_valid_lens=a64(ab, lens),
                            row_labels=None if labels is None else labels[k])
        session.post_forward()
        session.end_step()
    session.check()
    return session


def decode_step(k, rows=(0, 1)):
    """Step k >= 1 after shared_prefix_step: A decodes position 7 + k into its block 4, B position
    9 + k into block 3; batch rows in the order ``rows`` (0: A, 1: B)."""
    table = np.array([[1, 2, 4], [1, 2, 3]], np.int32)
    prefix, ids = np.array([7 + k, 9 + k]), np.array([300 + 2 * k, 301 + 2 * k])
    loc = np.array([4 * 4 + k - 1, 3 * 4 + k + 1])
    pool = np.zeros((2, 12), I64)
    pool[0, : 8 + k] = list(range(100, 108)) + [300 + 2 * j for j in range(1, k + 1)]
    pool[1, : 10 + k] = list(range(100, 108)) + [200, 201] + [301 + 2 * j for j in range(1, k + 1)]
    r = list(rows)
    return (table[r], prefix[r], np.array([1, 1]), ids[r].astype(I64), prefix[r].astype(I64), loc[r].astype(I64),
            pool[r], (prefix + 1)[r])


def test_a_session_with_same_step_reads_runs_a_shared_prefill_clean(ab):
    steps = [shared_prefix_step(), decode_step(1), decode_step(2, (1, 0))]
    clean = run_steps(ab, steps, same_step_reads=True)
    assert clean.stats["violations"] == 0 and clean.stats["same_step_verified"] == 8
    assert clean.stats["verified_entries"] == 8 + 18 + 20  # B's 8 prefix entries in step 0 count as verified
    # Without the rule the same steps read as corruption: B's same-step reads and its chain.
    assert run_steps(ab, steps, same_step_reads=False).stats["violations"] > 0


def test_a_fault_on_a_same_step_read_is_still_reported_with_its_request_id(ab):
    step0 = list(shared_prefix_step(tokens_b=list(range(100, 105)) + [999, 106, 107, 200, 201]))  # B's prompt differs at 5
    labels = [["req-A", "req-B"], ["req-A", "req-B"], ["req-B", "req-A"]]
    session = run_steps(ab, [tuple(step0), decode_step(1), decode_step(2, (1, 0))], same_step_reads=True, labels=labels)
    report = session.report()
    assert report.violations and {v.slot_idx for v in report.violations} == {9}  # position 5 of block 2
    assert all(v.request_ids == ("req-B",) and not v.is_write for v in report.violations)
    assert session.stats["same_step_verified"] == 7


def test_row_labels_follow_rows_that_move(ab):
    # Step 2 swaps the rows: B is row 0.  A fault then hits only B's block 3 (slot 14, position 10).
    steps = [shared_prefix_step(), decode_step(1), decode_step(2, (1, 0))]
    labels = [["a", "b"], ["a", "b"], ["b", "a"]]
    session = kc.CanarySession(64, max_batch_size=4, like=ab.like, on_violation="ignore", same_step_reads=True)
    for k, (table, prefix, extend, ids, pos, loc, pool, lens) in enumerate(steps):
        if k == 2:
            session.tail_canary[14] = 0  # B's record of step 1 lost (a stray write): read by B in step 2
            session.head_canary[14] = 0
        session.pre_forward(a64(ab, np.arange(2)), a64(ab, prefix), a64(ab, extend), kc.BlockTable(ab.asarray(table), B),
                            a64(ab, ids), a64(ab, pos), a64(ab, loc), row_labels=labels[k])
        session.post_forward()
        session.end_step()
    session.check()
    reads = [v for v in session.report().violations if not v.is_write]  # (B's write also fails its chain-position assert)
    assert reads and all(v.slot_idx == 14 and v.request_ids == ("b",) and v.batch_rows == (0,) for v in reads)


def test_row_labels_must_name_every_row():
    session = kc.CanarySession(16, max_batch_size=2)
    with pytest.raises(ValueError, match="row_labels must name every batch row: 2 rows"):
        session.pre_forward(np.arange(2), np.zeros(2, I64), np.ones(2, I64), kc.BlockTable(np.array([[1], [2]], np.int32), B),
                            np.zeros(2, I64), np.zeros(2, I64), np.array([4, 8], I64), row_labels=["only one"])


def test_kernel_constants_match_python():
    from test_kernels_compile import _cuh_constant

    from kvcanary_cupy import same_step

    assert _cuh_constant("kStampShift", "same_step.cu") == same_step._STAMP_SHIFT


def swapped_prefix_step():
    """shared_prefix_step with the rows swapped: B (row 0) reads the blocks row 1 (A) writes."""
    table, prefix, extend, ids, pos, loc, _, _ = shared_prefix_step()
    order = np.r_[8:10, 0:8]  # B's two tokens first
    return table[[1, 0]], prefix[[1, 0]], extend[[1, 0]], ids[order], pos[order], loc[order]


@pytest.mark.parametrize("framework", ["cupy", "torch_cuda"])
def test_a_captured_session_with_same_step_reads_replays_the_eager_bytes(framework):
    """pre_forward/post_forward captured once in a CUDA graph (nothing allocated: the resolve and
    the three wave launches, each with its wave fixed in its parameters) and replayed on two steps
    whose waves differ ([0, 1], then [1, 0]): the buffers and stats equal the eager NumPy session's."""
    import gc

    from conftest import get_backend_or_skip

    ab = get_backend_or_skip(framework)
    kc.warmup()
    steps = [shared_prefix_step()[:6], swapped_prefix_step()]

    def session_on(x):
        return kc.CanarySession(64, max_batch_size=2, like=x.like, on_violation="ignore", same_step_reads=True)

    reference = session_on(_NUMPY)
    for table, prefix, extend, ids, pos, loc in steps:
        reference.pre_forward(np.arange(2), prefix, extend, kc.BlockTable(table, B), ids, pos, loc)
        reference.post_forward()
        reference.end_step()
    reference.check()
    assert reference.stats["violations"] == 0 and reference.stats["same_step_verified"] == 16

    session = session_on(ab)
    bufs = [ab.asarray(np.asarray(a)) for a in steps[0]]  # table, prefix, extend, ids, pos, loc at fixed addresses
    rows = ab.asarray(np.arange(2))
    table = kc.BlockTable(bufs[0], B)

    def capture():
        session.pre_forward(rows, bufs[1], bufs[2], table, *bufs[3:])
        session.post_forward()

    if framework == "cupy":
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.Device().synchronize()
        with stream:
            stream.begin_capture()
            capture()
            graph = stream.end_capture()
        replay = lambda: (graph.launch(stream), stream.synchronize())  # noqa: E731
    else:
        import torch

        torch.cuda.synchronize()
        gc.collect()  # a CuPy graph of an earlier test freed by the GC inside torch's capture would invalidate it
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            capture()
        replay = lambda: (graph.replay(), torch.cuda.synchronize())  # noqa: E731
    waves = []
    for step in steps:
        for buf, value in zip(bufs, step):
            buf[...] = ab.asarray(np.asarray(value))
        ab.synchronize()
        replay()
        waves.append(ab.to_numpy(session.same_step.write_waves).tolist())
        session.end_step()
    session.check()
    assert waves == [[0, 1], [1, 0]]
    for name in ("head_canary", "tail_canary"):
        assert ab.to_numpy(getattr(session, name)).tolist() == getattr(reference, name).tolist(), name
    assert session.stats == reference.stats


def test_the_gpu_session_packs_one_write_launch_per_wave_into_each_buffer():
    """On a fake device (no GPU): the resolve's four launches come before the HEAD verify, then each
    buffer's write takes one bound launch per wave, in order, each with its wave and the session's
    write_waves in its WriteInputs (the seeds stay the plan's: one seeds array for every wave)."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    with fake_device(record_bytes=False) as dev:
        table, prefix, extend, ids, pos, loc, _, _ = shared_prefix_step()
        session = kc.CanarySession(16, max_batch_size=2, like=dev.asarray(np.zeros(1, np.int32)), on_violation="ignore",
                                   same_step_reads=True)
        dev.timeline.clear()
        session.pre_forward(*(dev.asarray(x) for x in (np.arange(2), prefix, extend)), kc.BlockTable(dev.asarray(table), B),
                            *(dev.asarray(x) for x in (ids, pos, loc)))
        session.post_forward()
        names = [what.split("::")[-1].split("<")[0] for op, what, _ in dev.timeline if op == "launch"]
        assert names[1:] == (["same_step_begin", "same_step_mark", "same_step_entries", "same_step_seeds", "canary_verify"]
                             + ["canary_write"] * 3 + ["canary_verify"] + ["canary_write"] * 3)
        waves_ptr = session.same_step.write_waves.data.ptr
        seeds_ptr = session.planner.write_plan.write_seed_slot_indices.data.ptr
        for write in (session._head_write, session._tail_write):
            inputs = [launcher._bound.params["inputs"][0] for launcher in write.launchers]
            assert [int(i["wave"]) for i in inputs] == [0, 1, 2]
            assert {int(i["write_waves"]) for i in inputs} == {waves_ptr} and {int(i["seeds"]) for i in inputs} == {seeds_ptr}
