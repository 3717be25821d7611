"""Bound launchers (CanaryPlanner.plan, WriteLauncher, VerifyLauncher) against the free functions.

Byte for byte on every backend (randomised steps), the kernel launches themselves on a fake CuPy
device (no GPU needed), the same errors for bad per-step inputs, re-binding when a bound torch
tensor moves, and KVCANARY_FULL_VALIDATION.
"""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import launchers, ops, planner as planner_module
from canary_builders import a64, canary, count_free_calls, i64, linear_rtt, make_log, make_write_plan
from conftest import get_backend_or_skip
from fuzz_cases import TABLE_KINDS, _plan_inputs, assert_same, launch_targets, make_case, run_case

NUMPY = get_backend_or_skip("numpy")


def _free_functions_refused(monkeypatch):
    """Make any call of the free functions fail: what runs must be the bound path."""
    def refuse(*args, **kwargs):
        raise AssertionError("the free function ran: the bound path was expected")

    for name in ("write", "verify"):
        monkeypatch.setattr(ops, name, refuse)
    monkeypatch.setattr(planner_module, "plan_step", refuse)


# ----------------------------------------------------------------------------------------------
# the same bytes


@pytest.mark.parametrize("backend", ["numpy", "torch_cpu", "cupy", "torch_cuda"])
def test_bound_steps_match_numpy(backend, monkeypatch):
    """Randomised steps (every table kind, several buffers, real KV, out-of-range values) through a
    CanaryPlanner and bound launchers give the NumPy free functions' bytes, without ever falling back."""
    ab = get_backend_or_skip(backend)
    cases = [make_case(seed) for seed in range(300 if ab.is_gpu else 30)]
    cases += [make_case(10_000 + seed, big=True) for seed in range(3 if ab.is_gpu else 1)]
    want = [run_case(NUMPY, case) for case in cases]
    _free_functions_refused(monkeypatch)
    for case, ref in zip(cases, want):
        assert_same(ref, run_case(ab, case, bound=True), context=f"{backend} bound seed {case.seed}")


def _rows_of_wider_table(asarray, table):
    """``table`` on the device as the first columns of a wider one (row stride > columns)."""
    wide = np.zeros((table.shape[0], table.shape[1] + 3), table.dtype)
    wide[:, : table.shape[1]] = table
    return asarray(wide)[:, : table.shape[1]]


def test_bound_kernel_launches_equal_the_free_ones_on_a_fake_device(monkeypatch):
    """Same kernels, grids, blocks, stream and argument bytes as the free functions, for the same
    arrays, and all of it on the bound path (empty batches and int32 tokens included)."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    free_functions = (ops.write, ops.verify, kc.plan)
    kinds, buffers = set(), set()
    for seed in [*range(40), 10_000]:
        case = make_case(seed, big=seed >= 10_000)
        kinds.add(case.table_kind)
        buffers.add(case.buffers)
        with fake_device() as dev:
            a = dev.asarray
            wide = lambda x: _rows_of_wider_table(a, x) if x.ndim == 2 else a(x)  # tables with row stride > columns
            shape = (case.num_slots, 32) if case.uint8_canary else (case.num_slots, 4)
            canaries = [a(np.zeros(shape, np.uint8 if case.uint8_canary else np.int64)) for _ in range(case.buffers)]
            buf = canaries[0]
            log = kc.ViolationLog.allocate(case.ring_capacity, like=buf)
            lut = None if case.lut is None else a(case.lut)
            targets = launch_targets(case, canaries, tuple(kc.RealKvSource(a(t), p, n, r) for t, p, n, r in case.sources))
            planner = kc.CanaryPlanner(kc.CanaryCapacities(case.verify_capacity, case.write_req_capacity), like=buf,
                                       swa_window_size=case.window, full_to_swa_index_mapping=lut,
                                       kv_token_id_vs_position_offset=case.token_offset)
            vp, wp = planner.verify_plan, planner.write_plan
            for step, s in enumerate(case.steps):
                rp, table, pool = _plan_inputs(case, s, wide)
                prefix, extend = a(s.prefix_lens), a(s.extend_seq_lens)
                expected = dict(req_to_verify_expected_tokens=pool,
                                req_to_verify_expected_tokens_valid_lens=None if pool is None else a(s.valid_lens))
                # seeds 1-7 mod 8 make some of the three int32 (each its own dtype: input_widths)
                tokens = tuple(a(x.astype(np.int32) if (seed >> k) & 1 else x)
                               for k, x in enumerate((s.input_ids, s.positions, s.out_cache_loc)))
                checks = {} if s.expected_tokens is None else dict(
                    expected_input_tokens=a(s.expected_tokens), expected_input_positions=a(s.expected_positions))
                flag = s.chain_flag if isinstance(s.chain_flag, bool) else a(s.chain_flag)
                head_buf, head_kinds, head_sources = targets(s.kinds[0])
                tail_buf, tail_kinds, tail_sources = targets(s.kinds[1])
                write_options = dict(log=log, kernel_kind=tail_kinds, chain_position_assert=flag,
                                     real_kv_sources=tail_sources, real_kv_hash_mode=case.mode)
                verify_options = dict(log=log, kernel_kind=head_kinds, check_expected_token=s.check_token,
                                      real_kv_sources=head_sources, real_kv_hash_mode=case.mode)

                write, verify, plan = free_functions
                plan(rp, prefix, extend, table, verify_capacity=case.verify_capacity,
                     write_req_capacity=case.write_req_capacity, swa_window_size=case.window,
                     full_to_swa_index_mapping=lut, kv_token_id_vs_position_offset=case.token_offset,
                     out=(vp, wp), **expected)
                verify(head_buf, vp, **verify_options)
                write(tail_buf, wp, *tokens, **write_options, **checks)
                free, dev.launches[:] = list(dev.launches), []

                with monkeypatch.context() as mp:
                    _free_functions_refused(mp)
                    planner.plan(rp, prefix, extend, table, **expected)
                    kc.VerifyLauncher(head_buf, vp, **verify_options)()
                    kc.WriteLauncher(tail_buf, wp, **write_options)(*tokens, **checks)
                assert dev.launches == free, f"seed {seed} step {step}"
                dev.launches[:] = []
    assert kinds == set(TABLE_KINDS) and len(buffers) > 1


def test_one_bound_planner_and_write_keep_the_free_launches_as_optional_inputs_come_and_go(monkeypatch):
    """A planner and a WriteLauncher used step after step, the table kind, the expected-token pool
    and the expected input tokens changing from one call to the next (bound launchers write the
    fields these set only when they are used or were used last): the free functions' launches."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    cases = [make_case(seed) for seed in range(24)]
    steps = [(case, s) for pair in zip(*(case.steps for case in cases)) for case, s in zip(cases, pair)]
    vcap, wcap = 4096, max(case.write_req_capacity for case in cases)
    used = {"pool": set(), "expected": set(), "kind": set()}
    with fake_device() as dev:
        a = dev.asarray
        buf = a(np.zeros((64, 4), np.int64))
        log = kc.ViolationLog.allocate(64, like=buf)
        planner = kc.CanaryPlanner(kc.CanaryCapacities(vcap, wcap), like=buf)
        vp, wp = planner.verify_plan, planner.write_plan
        write = kc.WriteLauncher(buf, wp, log=log)
        for call, (case, s) in enumerate(steps):
            rp, table, pool = _plan_inputs(case, s, a)
            pool = pool if call % 3 else None  # a pool given, dropped, given again ...
            lens = (a(s.prefix_lens), a(s.extend_seq_lens))
            expected = dict(req_to_verify_expected_tokens=pool,
                            req_to_verify_expected_tokens_valid_lens=None if pool is None else a(s.valid_lens))
            tokens = (a(s.input_ids), a(s.positions), a(s.out_cache_loc))
            checks = {} if s.expected_tokens is None or call % 2 else dict(
                expected_input_tokens=a(s.expected_tokens), expected_input_positions=a(s.expected_positions))
            used["pool"].add(pool is not None)
            used["expected"].add(bool(checks))
            used["kind"].add(case.table_kind)
            kc.plan(rp, *lens, table, verify_capacity=vcap, write_req_capacity=wcap, out=(vp, wp), **expected)
            ops.write(buf, wp, *tokens, log=log, **checks)
            free, dev.launches[:] = list(dev.launches), []
            with monkeypatch.context() as mp:
                _free_functions_refused(mp)
                planner.plan(rp, *lens, table, **expected)
                write(*tokens, **checks)
            assert dev.launches == free, f"call {call}: seed {case.seed} ({case.table_kind})"
            dev.launches[:] = []
    assert used == {"pool": {False, True}, "expected": {False, True}, "kind": set(TABLE_KINDS)}


def test_a_bound_planner_picks_each_calls_table_layout_as_the_free_plan_does(monkeypatch):
    """One planner, one table after another: the table layout it launches (configs.table_layout,
    its per-shape part kept by the planner) follows each call's table as the free function's does:
    a CSR table's kv_indices length (the bound of its rows) crossing 2**31 tokens, its kv_indptr's
    dtype, a block table's id dtype, null block, block size and width, and a req_to_token of the
    same shape as a block table of block size 1."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    i32, big = np.int32, 2**30
    bt = np.array([[1, 2], [3, 4]])
    with fake_device() as dev:
        a = dev.asarray
        rp, prefix, extend = a(np.array([1, 0])), a(np.array([2, 1])), a(np.array([1, 1]))
        csr = lambda indptr, indices, page, indptr_dtype=i32: (None, kc.PagedKvIndices(
            a(np.array(indptr, indptr_dtype)), a(np.array(indices, i32)), page))
        calls = [  # (req_pool_indices, table), the layout (kTable) it plans through
            ((rp, kc.BlockTable(a(bt.astype(i32)), 16)), 6),
            ((rp, kc.BlockTable(a(bt), 16)), 2),  # int64 ids
            ((rp, kc.BlockTable(a(bt.astype(i32)), 16, null_block=2**31)), 2),
            ((rp, kc.BlockTable(a(bt.astype(i32)), 16, null_block=-(2**31))), 6),
            ((rp, kc.BlockTable(a(bt.astype(i32)), 12)), 2),
            ((rp, kc.BlockTable(a(bt.astype(i32)), big)), 2),  # rows of 2**31 tokens
            ((rp, kc.BlockTable(a(bt[:, :1].astype(i32)), big)), 6),
            ((rp, kc.BlockTable(a(bt.astype(i32)), 1)), 6),
            ((rp, a(bt.astype(i32))), 0),  # the same shape as that block table
            ((rp, kc.BlockTable(a(bt.astype(i32)), 1)), 6),
            (csr([0, 1, 2], [5, 6], big), 3),  # 2**31 tokens of kv_indices
            (csr([0, 1, 1], [5], big), 7),
            (csr([0, 1, 1], [5], big, np.int64), 3),
            (csr([0, 1, 1], [5], 16), 7),
            (csr([0, 2, 2], [5, 6], 48), 3),
        ]
        planner = kc.CanaryPlanner(kc.CanaryCapacities(64, 2), like=prefix)
        for (rows, table), layout in calls:
            kc.plan(rows, prefix, extend, table, verify_capacity=64, out=(planner.verify_plan, planner.write_plan))
            free, dev.launches[:] = list(dev.launches), []
            with monkeypatch.context() as mp:
                _free_functions_refused(mp)
                planner.plan(rows, prefix, extend, table)
            assert [launch.name for launch in free] == [f"kvcanary::plan_small<{layout}, false, false>"], (table, layout)
            assert dev.launches == free
            dev.launches[:] = []


# ----------------------------------------------------------------------------------------------
# per-step inputs outside the common case: the free function decides


def _write_setup(ab):
    buf = ab.asarray(canary(16))
    log = make_log(ab)
    wp = make_write_plan(ab, [0, 2, 3], [-1, -1])
    return buf, wp, log


def _snapshot(ab, *arrays):
    return [ab.to_numpy(x).copy() for x in arrays]


def _assert_same_error(ab, free, bound, state):
    with pytest.raises((TypeError, ValueError)) as want:
        free()
    before = _snapshot(ab, *state)
    with pytest.raises(want.type) as got:
        bound()
    assert str(got.value) == str(want.value)
    for x, y in zip(_snapshot(ab, *state), before):
        np.testing.assert_array_equal(x, y)


BAD_TOKENS = {
    "float input_ids": lambda ab, t: (ab.asarray(np.array([1, 2, 3], np.float64)), t[1], t[2]),  # int32 is taken
    "2-D positions": lambda ab, t: (t[0], ab.asarray(np.zeros((3, 1), np.int64)), t[2]),
    "short out_cache_loc": lambda ab, t: (t[0], t[1], a64(ab, [4, 5])),
    "list input_ids": lambda ab, t: ([1, 2, 3], t[1], t[2]),
}


@pytest.mark.parametrize("bad", sorted(BAD_TOKENS))
def test_write_launcher_refuses_bad_tokens_like_the_free_function(ab, bad):
    buf, wp, log = _write_setup(ab)
    tokens = BAD_TOKENS[bad](ab, (a64(ab, [7, 8, 9]), a64(ab, [0, 1, 0]), a64(ab, [3, 4, 5])))
    launcher = kc.WriteLauncher(buf, wp, log=log)
    _assert_same_error(ab, lambda: kc.write(buf, wp, *tokens, log=log), lambda: launcher(*tokens),
                       [buf, *log.arrays().values()])


def test_write_launcher_refuses_half_an_input_assert_like_the_free_function(ab):
    buf, wp, log = _write_setup(ab)
    tokens = (a64(ab, [7, 8, 9]), a64(ab, [0, 1, 0]), a64(ab, [3, 4, 5]))
    launcher = kc.WriteLauncher(buf, wp, log=log)
    _assert_same_error(ab, lambda: kc.write(buf, wp, *tokens, log=log, expected_input_tokens=tokens[0]),
                       lambda: launcher(*tokens, expected_input_tokens=tokens[0]), [buf, *log.arrays().values()])


def test_write_launcher_refuses_arrays_of_another_device(gpu_ab):
    buf, wp, log = _write_setup(gpu_ab)
    host_ids = i64([7, 8, 9])
    tokens = (host_ids, a64(gpu_ab, [0, 1, 0]), a64(gpu_ab, [3, 4, 5]))
    launcher = kc.WriteLauncher(buf, wp, log=log)
    _assert_same_error(gpu_ab, lambda: kc.write(buf, wp, *tokens, log=log), lambda: launcher(*tokens),
                       [buf, *log.arrays().values()])


def test_planner_refuses_bad_inputs_like_the_free_function(ab):
    planner = kc.CanaryPlanner.from_engine(kv_pool_size=64, max_running_requests=4, like=ab.like)
    rtt = ab.asarray(linear_rtt(4, 16))
    good = (a64(ab, [1, 2]), a64(ab, [2, 3]), a64(ab, [1, 1]))
    bad_inputs = {
        "int32 prefix_lens": (good[0], ab.asarray(np.array([2, 3], np.int32)), good[2], rtt),
        "short extend_seq_lens": (good[0], good[1], a64(ab, [1]), rtt),
        "int64 req_to_token": (*good, ab.asarray(linear_rtt(4, 16).astype(np.int64))),
        "1-D req_to_token": (*good, ab.asarray(linear_rtt(4, 16)[0])),
        "batch above capacity": (a64(ab, [1] * 5), a64(ab, [1] * 5), a64(ab, [1] * 5), rtt),
    }
    state = [*planner.verify_plan.arrays().values(), *planner.write_plan.arrays().values()]
    for inputs in bad_inputs.values():
        _assert_same_error(ab, lambda: kc.plan(*inputs, verify_capacity=planner.capacities.verify_capacity,
                                               write_req_capacity=planner.capacities.write_req_capacity,
                                               out=(planner.verify_plan, planner.write_plan)),
                           lambda: planner.plan(*inputs), state)
    pool = ab.asarray(np.zeros((4, 16), np.int32))
    _assert_same_error(ab, lambda: kc.plan(*good, rtt, verify_capacity=192, req_to_verify_expected_tokens=pool,
                                           out=(planner.verify_plan, planner.write_plan)),
                       lambda: planner.plan(*good, rtt, req_to_verify_expected_tokens=pool), state)


def test_uncommon_inputs_take_the_free_function_with_the_same_bytes(ab, monkeypatch):
    """Strided tokens, and (CPU torch) a NumPy array among torch tensors: accepted, copied or viewed
    by the free function, with the same bytes."""
    counts = count_free_calls(monkeypatch)
    out = {}
    for path in ("free", "bound"):
        buf, wp, log = _write_setup(ab)
        wide = a64(ab, [7, 0, 8, 0, 9, 0])
        tokens = (wide[::2], a64(ab, [0, 1, 0]), i64([3, 4, 5]) if ab.name == "torch_cpu" else a64(ab, [3, 4, 5]))
        if path == "free":
            ops.write(buf, wp, *tokens, log=log)
        else:
            kc.WriteLauncher(buf, wp, log=log)(*tokens)
        out[path] = _snapshot(ab, buf, *log.arrays().values())
    assert counts["write"] == 2  # the launcher handed the strided call to the free function
    for x, y in zip(out["bound"], out["free"]):
        np.testing.assert_array_equal(x, y)


def test_strided_bound_plans_take_the_free_function(ab, monkeypatch):
    """A WritePlan of strided views would be copied by the free function: it cannot be bound."""
    counts = count_free_calls(monkeypatch)
    strided = kc.WritePlan(write_offsets=a64(ab, [0, 9, 1, 9, 2, 9])[::2], write_seed_slot_indices=a64(ab, [5, 9, -1, 9])[::2],
                           write_num_valid_reqs=ab.asarray(np.array([2], np.int32)), verify_offsets=a64(ab, [0] * 6)[::2])
    buf, log = ab.asarray(canary(16)), make_log(ab)
    launcher = kc.WriteLauncher(buf, strided, log=log)
    for _ in range(2):
        launcher(a64(ab, [7, 8]), a64(ab, [0, 1]), a64(ab, [3, 4]))
    assert counts["write"] == 2
    want_buf, want_log = ab.asarray(canary(16)), make_log(ab)
    for _ in range(2):
        ops.write(want_buf, strided, a64(ab, [7, 8]), a64(ab, [0, 1]), a64(ab, [3, 4]), log=want_log)
    np.testing.assert_array_equal(ab.to_numpy(buf), ab.to_numpy(want_buf))


def test_launchers_refuse_bad_bound_buffers_like_the_free_functions(ab):
    buf, wp, log = _write_setup(ab)
    other = ab.asarray(canary(16))
    tokens = (a64(ab, [7]), a64(ab, [0]), a64(ab, [3]))
    for bufs, kwargs in ((buf, dict(log=object())), (buf, dict(log=log, kernel_kind=99)),
                         (buf, dict(log=log, chain_position_assert="yes")), ([buf, other], dict(log=log, kernel_kind=1)),
                         ([buf, buf], dict(log=log, kernel_kind=[0, 1]))):
        with pytest.raises((TypeError, ValueError)) as want:
            kc.write(bufs, wp, *tokens, **kwargs)
        with pytest.raises(want.type) as got:
            kc.WriteLauncher(bufs, wp, **kwargs)
        assert str(got.value) == str(want.value)
    vp = kc.VerifyPlan.allocate(4, like=ab.like)
    with pytest.raises((TypeError, ValueError)) as want:
        kc.verify(buf, vp, log=log, check_expected_token=1)
    with pytest.raises(want.type) as got:
        kc.VerifyLauncher(buf, vp, log=log, check_expected_token=1)
    assert str(got.value) == str(want.value)


def test_a_side_stream_on_the_cpu_is_refused_like_the_free_function():
    buf, wp, log = _write_setup(NUMPY)
    tokens = (i64([7]), i64([0]), i64([3]))
    launcher = kc.WriteLauncher(buf, wp, log=log, stream=object())
    _assert_same_error(NUMPY, lambda: kc.write(buf, wp, *tokens, log=log, stream=object()), lambda: launcher(*tokens),
                       [buf, *log.arrays().values()])


# ----------------------------------------------------------------------------------------------
# bound buffers that move


def test_launchers_rebind_a_torch_tensor_that_moved():
    torch = pytest.importorskip("torch")
    ab = get_backend_or_skip("torch_cpu")
    buf, wp, log = _write_setup(ab)
    vp = kc.VerifyPlan.allocate(4, like=ab.like)
    write = kc.WriteLauncher(buf, wp, log=log)
    verify = kc.VerifyLauncher(buf, vp, log=log)
    old = buf.view(-1)  # keeps the old memory alive and visible
    buf.set_(torch.zeros(32, 4, dtype=torch.int64))  # reallocated: new address, new shape
    log.kernel_run_counters.set_(torch.zeros(12, dtype=torch.int64))
    write(a64(ab, [7, 8, 9]), a64(ab, [0, 1, 0]), a64(ab, [30, 31, 5]))
    verify()
    want_buf, want_log = torch.zeros(32, 4, dtype=torch.int64), make_log(ab)
    kc.write(want_buf, wp, a64(ab, [7, 8, 9]), a64(ab, [0, 1, 0]), a64(ab, [30, 31, 5]), log=want_log)
    kc.verify(want_buf, vp, log=want_log)
    assert torch.equal(buf, want_buf) and buf[31, 0].item() == 8  # slot 31 exists only in the new buffer
    assert not old.any()  # nothing went to the old memory
    for key, arr in log.arrays().items():
        assert torch.equal(arr, want_log.arrays()[key]), key


def test_planner_rebinds_its_buffers_after_a_reallocation():
    torch = pytest.importorskip("torch")
    ab = get_backend_or_skip("torch_cpu")
    planner = kc.CanaryPlanner.from_engine(kv_pool_size=8, max_running_requests=2, like=ab.like)
    inputs = (a64(ab, [1]), a64(ab, [2]), a64(ab, [1]), ab.asarray(linear_rtt(3, 8)))
    planner.plan(*inputs)
    # shorter than write_req_capacity: the full checks of the re-bind refuse it
    planner.write_plan.write_seed_slot_indices.set_(torch.full((1,), -1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"write_req_capacity=2 does not match out\[1\].write_seed_slot_indices.shape\[0\]=1"):
        planner.plan(*inputs)


# ----------------------------------------------------------------------------------------------
# KVCANARY_FULL_VALIDATION


def test_full_validation_env_sends_every_call_to_the_free_functions(ab, monkeypatch):
    counts = count_free_calls(monkeypatch)
    tokens = (a64(ab, [7]), a64(ab, [0]), a64(ab, [3]))
    plan_inputs = (a64(ab, [1]), a64(ab, [0]), a64(ab, [1]), ab.asarray(linear_rtt(3, 8)))

    def step():
        buf, log = ab.asarray(canary(32)), make_log(ab)
        planner = kc.CanaryPlanner.from_engine(kv_pool_size=32, max_running_requests=2, like=ab.like)
        verify = kc.VerifyLauncher(buf, planner.verify_plan, log=log)
        write = kc.WriteLauncher(buf, planner.write_plan, log=log)
        for _ in range(3):
            planner.plan(*plan_inputs)
            verify()
            write(*tokens)
        return _snapshot(ab, buf, *log.arrays().values())

    fast = step()
    assert counts == {"plan": 0, "write": 0, "verify": 0}
    monkeypatch.setenv(launchers.FULL_VALIDATION_ENV, "1")
    full = step()
    assert counts == {"plan": 3, "write": 3, "verify": 3}
    for x, y in zip(full, fast):
        np.testing.assert_array_equal(x, y)
    monkeypatch.setenv(launchers.FULL_VALIDATION_ENV, "0")
    step()
    assert counts == {"plan": 3, "write": 3, "verify": 3}


# ----------------------------------------------------------------------------------------------
# the write on a side stream, on a fake CuPy device


@pytest.mark.parametrize("full_validation", [False, True], ids=["bound", "free"])
def test_side_stream_write_forks_and_join_joins_with_one_event_each(monkeypatch, full_validation):
    """Each call records the fork event on the caller's stream and launches behind it on the side
    stream; join() records the join event there and the caller's stream waits for it.  Under
    KVCANARY_FULL_VALIDATION the free function forks (an event of its own per call) and join() still joins."""
    cupy = pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    monkeypatch.setenv(launchers.FULL_VALIDATION_ENV, "1" if full_validation else "0")
    with fake_device(record_bytes=False) as dev:
        buf = dev.asarray(canary(16))
        wp = kc.WritePlan.allocate(2, like=buf)
        side = cupy.cuda.Stream(non_blocking=True)
        write = kc.WriteLauncher(buf, wp, log=kc.ViolationLog.allocate(8, like=buf), stream=side)
        tokens = tuple(dev.asarray(np.array(v, np.int64)) for v in ([7, 8, 9], [0, 1, 0], [3, 4, 5]))
        dev.timeline.clear()
        write(*tokens)
        write(*tokens)
        write.join()
        records = [(e, s) for op, e, s in dev.timeline if op == "record"]
        forks = [e for e, s in records if s == "main"]
        (join,) = [e for e, s in records if s == side.name]
        expected = [("record", forks[0], "main"), ("wait", side.name, forks[0]), ("launch", "write", side.name),
                    ("record", forks[1], "main"), ("wait", side.name, forks[1]), ("launch", "write", side.name),
                    ("record", join, side.name), ("wait", "main", join)]
        short = [(op, "write" if op == "launch" and "canary_write" in what else what, where) for op, what, where in dev.timeline]
        assert short == expected
        assert (forks[0] == forks[1]) != full_validation  # the bound path reuses its fork event


@pytest.mark.parametrize("widths", ["32,32,32", "32,64,64", "64,32,64", "64,64,32", "64,32,32"])
def test_write_launcher_takes_int32_tokens_on_its_bound_path(ab, widths, monkeypatch):
    """int32 input_ids / positions / out_cache_loc, each its own dtype, stay on the bound path (the
    free write refused) and give the free function's bytes (which reads them as they are too)."""
    values = ([7, 8, 9], [0, 1, 0], [3, 4, 60])  # slot 60 is past the buffer: counted, skipped
    dtypes = [np.int32 if w == "32" else np.int64 for w in widths.split(",")]
    out = []
    for launch in (False, True):
        buf, wp, log = _write_setup(ab)
        tokens = [ab.asarray(np.array(v, t)) for v, t in zip(values, dtypes)]
        if launch:
            write = kc.WriteLauncher(buf, wp, log=log)
            _free_functions_refused(monkeypatch)
            write(*tokens)
            write(*tokens)  # twice: the second reads the first's records back
        else:
            for _ in range(2):
                kc.write(buf, wp, *tokens, log=log)
        out.append((ab.to_numpy(buf).tobytes(), log.read().to_json()))
    assert out[0] == out[1]



def test_a_cpu_torch_session_takes_numpy_step_arrays_on_its_bound_path(monkeypatch):
    """On the CPU, NumPy per-step arrays among a torch session's tensors stay on the bound path (the
    free functions refused; they take both too) and give the bytes of the same steps in torch."""
    torch = pytest.importorskip("torch")
    rtt = np.arange(1, 1 + 3 * 16, dtype=np.int32).reshape(3, 16)
    steps = [([1, 2], [0, 0], [3, 2], [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [17, 18, 19, 33, 34]),  # table row 0: padding
             ([1, 2], [3, 2], [1, 1], [10, 11], [3, 2], [20, 35])]
    out = {}
    for framework in ("torch", "numpy"):
        like = torch.zeros(1, dtype=torch.int64)
        session = kc.CanarySession(64, max_batch_size=2, verify_capacity=64, like=like)
        table = torch.from_numpy(rtt)
        with monkeypatch.context() as mp:
            if framework == "numpy":
                _free_functions_refused(mp)
            for step in steps:
                arrays = [np.array(v, np.int64) for v in step]
                if framework == "torch":
                    arrays = [torch.from_numpy(a) for a in arrays]
                rp, prefix, extend, ids, pos, loc = arrays
                session.pre_forward(rp, prefix, extend, table, ids, pos, loc)
                session.post_forward()
                session.end_step()
        session.check()
        out[framework] = (session.head_canary.numpy().tobytes(), session.tail_canary.numpy().tobytes(),
                          session.stats["violations"])
    assert out["numpy"] == out["torch"]
    assert out["torch"][2] == 0 and out["torch"][0] != bytes(len(out["torch"][0]))
