"""CUDA-graph capture and stream ordering: a whole canary step (plan, verify, write, verify) is
captured once and replayed with new batch contents, in CuPy and in torch, and matches NumPy;
through the free functions and through a CanaryPlanner with bound launchers."""

import contextlib
import numpy as np
import pytest

import kvcanary_cupy as kc
from conftest import get_backend_or_skip

NUMPY = get_backend_or_skip("numpy")


class Engine:
    """A toy engine with fixed-address step buffers in one framework (bs fixed, contents vary).

    ``table`` picks how the plan reads its slots: "rtt" (a req_to_token, row 0 = padding),
    "block" (a block table of pages of PAGE_SIZE slots, every row real) or "csr" (FlashInfer's
    page table: each batch row owns all pages of its block-table row, refilled every step).
    ``rtt_np`` is the slot of each (row, position) either way.  ``bound``: the same step through a
    CanaryPlanner and launchers bound to these buffers.
    """

    PAGE_SIZE = 4

    def __init__(self, ab, bs=16, rows=24, cols=64, tokens_per_step=3, table="rtt", bound=False):
        self.ab, self.kind = ab, table
        rng = np.random.default_rng(0)
        a = ab.asarray
        if table == "rtt":
            self.rtt_np = rng.permutation(np.arange(1, rows * cols + 1)).reshape(rows, cols).astype(np.int32)
            self.num_slots = rows * cols + 1
            self.rtt = a(self.rtt_np)
            self.table = kc.ReqToToken(self.rtt)
        else:
            ps, width = self.PAGE_SIZE, cols // self.PAGE_SIZE
            self.blocks_np = rng.permutation(np.arange(1, rows * width + 1)).reshape(rows, width).astype(np.int32)
            self.rtt_np = (np.repeat(self.blocks_np, ps, axis=1) * ps + np.arange(cols) % ps).astype(np.int32)
            self.num_slots = (rows * width + 1) * ps
            if table == "block":
                self.table = kc.BlockTable(a(self.blocks_np), ps)
            else:
                self.kv_indices = a(np.zeros(bs * width, np.int32))
                self.table = kc.PagedKvIndices(a(np.arange(0, (bs + 1) * width, width, dtype=np.int32)), self.kv_indices, ps)
        self.bs, self.tokens = bs, bs * tokens_per_step
        self.canary = kc.allocate_canary_buffer(self.num_slots, like=ab.like)
        self.log = kc.ViolationLog.allocate(256, like=ab.like)
        self.vp = kc.VerifyPlan.allocate(bs * cols // 2, like=ab.like)  # the last steps overflow
        self.wp = kc.WritePlan.allocate(bs, like=ab.like)
        z = np.zeros(bs, np.int64)
        self.rp, self.prefix, self.extend = a(z), a(z), a(z)
        zt = np.zeros(self.tokens, np.int64)
        self.ids, self.pos, self.loc = a(zt), a(zt), a(zt)
        self.flag = a(np.zeros(1, np.int32))
        self.bound = bound
        if bound:
            planner = kc.CanaryPlanner(kc.CanaryCapacities(self.vp.capacity, bs), like=ab.like)
            self.vp, self.wp = planner.verify_plan, planner.write_plan
            self.plan = lambda: planner.plan(None if table == "csr" else self.rp, self.prefix, self.extend, self.table)
            self.head = kc.VerifyLauncher(self.canary, self.vp, log=self.log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
            self.write = kc.WriteLauncher(self.canary, self.wp, log=self.log, kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL,
                                          chain_position_assert=self.flag)
            self.tail = kc.VerifyLauncher(self.canary, self.vp, log=self.log, kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL)

    def fill(self, step_inputs):
        """Copy a step's inputs into the fixed buffers (in place)."""
        for dst, src in zip((self.rp, self.prefix, self.extend, self.ids, self.pos, self.loc, self.flag), step_inputs):
            dst[...] = self.ab.asarray(src)
        if self.kind == "csr":
            self.kv_indices[...] = self.ab.asarray(self.blocks_np[step_inputs[0]].reshape(-1))

    def step(self):
        if self.bound:
            self.plan()
            self.head()
            self.write(self.ids, self.pos, self.loc)
            self.tail()
            return
        kc.plan(None if self.kind == "csr" else self.rp, self.prefix, self.extend, self.table,
                verify_capacity=self.vp.capacity, out=(self.vp, self.wp))
        kc.verify(self.canary, self.vp, log=self.log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
        kc.write(self.canary, self.wp, self.ids, self.pos, self.loc, log=self.log,
                 kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL, chain_position_assert=self.flag)
        kc.verify(self.canary, self.vp, log=self.log, kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL)

    def snapshot(self):
        out = {k: self.ab.to_numpy(v) for k, v in self.log.arrays().items()}
        out["canary"] = self.ab.to_numpy(self.canary)
        out.update({f"wp.{k}": self.ab.to_numpy(v) for k, v in self.wp.arrays().items()})
        return out


def step_inputs(engine, step, rng):
    """Step 0 prefills every request; later steps decode 1-3 tokens for a random subset."""
    bs, cols = engine.bs, engine.rtt_np.shape[1]
    rp = np.where(rng.random(bs) < 0.8, np.arange(1, bs + 1), 0)  # some padding rows
    if step == 0:
        prefix = np.zeros(bs, np.int64)
        extend = np.full(bs, 3)
    else:
        prefix = np.full(bs, 3 * step, np.int64)
        extend = np.full(bs, 3)
    if engine.kind != "rtt":  # every table row is real: a padding request is an empty one
        prefix = np.where(rp != 0, prefix, 0)
    extend = np.where(rp != 0, np.minimum(extend, cols - prefix), 0)
    loc, ids, pos = [], [], []
    for r in range(bs):
        p = prefix[r] + np.arange(extend[r])
        loc.append(engine.rtt_np[rp[r], p])
        pos.append(p)
        ids.append(rng.integers(0, 1000, extend[r]))
    pad = engine.tokens - sum(len(x) for x in loc)
    loc.append(np.zeros(pad)); pos.append(np.zeros(pad)); ids.append(np.zeros(pad))
    cat = lambda xs: np.concatenate(xs).astype(np.int64)
    return rp.astype(np.int64), prefix, extend.astype(np.int64), cat(ids), cat(pos), cat(loc), np.array([int(step > 0)], np.int32)


SHAPES = {"small": dict(bs=16, rows=24, cols=64), "fused": dict(bs=40, rows=48, cols=64),
          "two_kernels": dict(bs=4500, rows=4508, cols=12)}
TABLES = ("rtt", "block", "csr")


def test_shapes_take_every_plan_path():
    from kvcanary_cupy.backends.cuda import abi, configs

    assert SHAPES["small"]["bs"] <= abi.PLAN_SMALL_MAX_ROWS < SHAPES["fused"]["bs"] <= configs.policy().plan_fused_max_rows < SHAPES["two_kernels"]["bs"]


def reference_run(steps, shape, table="rtt"):
    engine = Engine(NUMPY, **shape, table=table)
    snaps = []
    for inputs in steps:
        engine.fill(inputs)
        engine.step()
        snaps.append(engine.snapshot())
    return snaps


def assert_snapshots_equal(got, want):
    for key in want:
        if key == "ring":
            continue
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _steps(shape, n=4, table="rtt"):
    rng = np.random.default_rng(1)
    probe = Engine(NUMPY, **shape, table=table)
    return [step_inputs(probe, i, rng) for i in range(n)]


def _prepare(ab, shape, n=4, table="rtt", bound=False):
    """Compiled kernels, the steps, NumPy's snapshots after each, and an engine on ``ab``."""
    kc.warmup()
    steps = _steps(SHAPES[shape], n, table)
    return steps, reference_run(steps, SHAPES[shape], table), Engine(ab, **SHAPES[shape], table=table, bound=bound)


@pytest.mark.parametrize("bound", [False, True], ids=["free", "bound"])
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_cupy_graph_capture_and_replay(shape, table, bound):
    steps, want, engine = _prepare(get_backend_or_skip("cupy"), shape, table=table, bound=bound)
    assert replay_in_cupy_graph(engine, steps, want) == len(steps)


@pytest.mark.parametrize("bound", [False, True], ids=["free", "bound"])
def test_cupy_graph_replays_the_scan_state_of_the_two_launch_plan(bound, launch_policy):
    """Each replay of a captured two-launch plan publishes its blocks' totals in the WritePlan's
    scan state under a new flag (forced for the 4,500-request shape, whatever
    plan_scan_state_min_rows)."""
    from kvcanary_cupy.backends.cuda import device as cuda_device

    launch_policy(plan_scan_state_min_rows=0)
    steps, want, engine = _prepare(get_backend_or_skip("cupy"), "two_kernels", bound=bound)
    assert replay_in_cupy_graph(engine, steps, want) == 4
    flags = engine.ab.to_numpy(kc.plans.scan_state(engine.wp))[:kc.plans.SCAN_STATE_TILES]
    assert (flags[:cuda_device.sm_count(0)] == 4).all() and not flags[cuda_device.sm_count(0):].any()  # one per replay


def capture_in_cupy_graph(engine, first_inputs, in_capture=lambda: None):
    """Capture one step of ``engine`` (its buffers holding ``first_inputs``) in a cupy.cuda.Graph,
    calling ``in_capture()`` before the capture ends.  Returns the capture stream and
    ``replay(inputs)``, which copies ``inputs`` in and replays the graph on that stream, waiting."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        engine.fill(first_inputs)
        stream.begin_capture()
        engine.step()
        in_capture()
        graph = stream.end_capture()

    def replay(inputs):
        with stream:  # the new inputs are copied on the stream the graph replays on
            engine.fill(inputs)
            graph.launch(stream)
            stream.synchronize()

    return stream, replay


def replay_in_cupy_graph(engine, steps, want) -> int:
    """Capture one step of ``engine`` in a cupy.cuda.Graph, replay it over ``steps`` and compare
    each replay with NumPy's snapshot (``want``); returns the number of replays."""
    return check_replays(engine, steps, want, capture_in_cupy_graph(engine, steps[0])[1])


def capture_in_torch_graph(engine, first_inputs, in_capture=lambda: None):
    """torch's recommended warm-up (one step on a side stream, then the log and canary cleared),
    then one step of ``engine`` captured in a torch.cuda.CUDAGraph, calling ``in_capture()`` before
    the capture ends.  Returns ``replay(inputs)``, as :func:`capture_in_cupy_graph`'s."""
    import torch

    engine.fill(first_inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        engine.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    engine.log.reset()
    engine.canary.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        engine.step()
        in_capture()

    def replay(inputs):  # on torch's current stream, which the graph replays on
        engine.fill(inputs)
        graph.replay()
        torch.cuda.synchronize()

    return replay


def check_replays(engine, steps, want, replay) -> int:
    """``replay`` each of ``steps`` and compare the engine with NumPy's snapshot after it
    (``want``); returns the number of replays."""
    for inputs, expected in zip(steps, want):
        replay(inputs)
        assert_snapshots_equal(engine.snapshot(), expected)
    return len(steps)


@pytest.mark.parametrize("bound", [False, True], ids=["free", "bound"])
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_torch_graph_capture_and_replay(shape, table, bound):
    steps, want, engine = _prepare(get_backend_or_skip("torch_cuda"), shape, table=table, bound=bound)
    assert check_replays(engine, steps, want, capture_in_torch_graph(engine, steps[0])) == len(steps)


@pytest.mark.parametrize("bound", [False, True], ids=["free", "bound"])
def test_torch_stream_ordering(bound):
    """Kernels run on torch's current stream, ordered after torch work queued before them."""
    import torch

    steps, want, engine = _prepare(get_backend_or_skip("torch_cuda"), "fused", n=2, bound=bound)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for inputs, expected in zip(steps, want):
            torch.cuda._sleep(2_000_000)  # a long kernel before the inputs land on this stream
            engine.fill(inputs)
            engine.step()
            stream.synchronize()
            assert_snapshots_equal(engine.snapshot(), expected)


def test_warmup_compiles_every_variant():
    get_backend_or_skip("cupy")
    from kvcanary_cupy.backends.cuda import compile as cuda_compile, device as cuda_device

    kc.warmup()
    import cupy

    dev = cupy.cuda.Device().id
    for family, spec in cuda_compile.FAMILIES.items():
        for name in spec.instantiations():
            assert (dev, family, name) in cuda_device.cache


# ---- nothing is copied or allocated inside a capture ----------------------------------------------


def capture_refusals(engine):
    """``(expected message, call)`` for every copy or allocation a call could need during a capture.

    Every array the calls use is made here, before the capture.
    """
    e = engine
    xp_zeros = lambda n: e.ab.asarray(np.zeros(n, np.int64))
    spread_ids = xp_zeros(2 * e.tokens)[::2]  # not contiguous: write would copy it
    spread_flat, offsets, rows = xp_zeros(8)[::2], xp_zeros(2), xp_zeros(1)
    pool = e.ab.asarray(np.zeros((4, 4), np.int32))
    planner = kc.CanaryPlanner.from_engine(kv_pool_size=e.num_slots, max_running_requests=e.bs, like=e.canary)
    pages = e.ab.asarray(np.array([1, 2], np.int64))
    host_inputs = [e.ab.to_numpy(x) for x in (e.rp, e.prefix, e.extend, e.rtt)]
    return [
        (r"kv-canary would copy input_ids \(it is not contiguous.*make input_ids contiguous before capturing",
         lambda: kc.write(e.canary, e.wp, spread_ids, e.pos, e.loc, log=e.log)),
        (r"kv-canary would copy flat_in \(it is not contiguous",
         lambda: kc.scatter_req_token_ids(spread_flat, offsets, rows, pool)),
        (r"plan with out=None allocates its VerifyPlan and WritePlan.*pass out=",
         lambda: kc.plan(e.rp, e.prefix, e.extend, e.rtt, verify_capacity=8)),
        (r"ViolationLog.allocate allocates new arrays.*call ViolationLog.allocate before capturing",
         lambda: kc.ViolationLog.allocate(4, like=e.canary)),
        (r"VerifyPlan.allocate allocates new arrays", lambda: kc.VerifyPlan.allocate(4, like=e.canary)),
        (r"WritePlan.allocate allocates new arrays", lambda: kc.WritePlan.allocate(4, like=e.canary)),
        (r"allocate_canary_buffer allocates new arrays", lambda: kc.allocate_canary_buffer(4, like=e.canary)),
        (r"req_pool_indices is a numpy array and the planner's buffers are .* arrays: kv-canary would copy it there",
         lambda: planner.plan(*host_inputs)),
        (r"strict=True copies the arguments to the host",
         lambda: kc.verify(e.canary, e.vp, log=e.log, strict=True)),
        (r"move_pages would allocate its staging area \(no workspace= was given\).*pass workspace= allocated before capturing",
         lambda: kc.move_pages(e.canary, pages, pages)),
    ]


def _assert_refused(refusals):
    for match, call in refusals:
        with pytest.raises(ValueError, match=match):
            call()


def test_cupy_capture_refuses_copies_and_allocations():
    """The measured corruption: a non-contiguous input_ids was copied inside a CuPy capture, the
    copy's memory went back to the pool, and replays overwrote the array that got it next.  Now
    every such call is refused, the capture stays valid, and replays write NumPy's bytes only."""
    import cupy

    steps, want, engine = _prepare(get_backend_or_skip("cupy"), "fused", n=3)
    refusals = capture_refusals(engine)
    refusals.append((r"kv-canary would copy input_ids \(it has negative strides\)",
                     lambda: kc.write(engine.canary, engine.wp, engine.ids[::-1], engine.pos, engine.loc, log=engine.log)))

    def in_capture():
        _assert_refused(refusals)
        assert cupy.cuda.get_current_stream().is_capturing()

    stream, replay = capture_in_cupy_graph(engine, steps[0], in_capture)
    with stream:  # CuPy's pool is per stream: the bystanders may take what a copy in the capture freed
        bystanders = [cupy.full(n, 7, cupy.int64) for n in (engine.tokens, 2 * engine.tokens, 64, 4096)]
    assert check_replays(engine, steps, want, replay) == len(steps)
    assert all(bool((b == 7).all()) for b in bystanders)


def test_torch_capture_refuses_copies_and_allocations():
    import torch

    steps, want, engine = _prepare(get_backend_or_skip("torch_cuda"), "fused", n=3)
    refusals = capture_refusals(engine)

    def in_capture():
        _assert_refused(refusals)
        assert torch.cuda.is_current_stream_capturing()

    replay = capture_in_torch_graph(engine, steps[0], in_capture)
    bystanders = [torch.full((n,), 7, dtype=torch.int64, device="cuda") for n in (engine.tokens, 64, 4096)]
    assert check_replays(engine, steps, want, replay) == len(steps)
    assert all(bool((b == 7).all()) for b in bystanders)


def test_eager_calls_still_copy_outside_a_capture(gpu_ab):
    """The refusals are for captures only: the same non-contiguous input works eagerly."""
    steps, want, engine = _prepare(gpu_ab, "fused", n=1)
    engine.fill(steps[0])
    spread = gpu_ab.asarray(np.repeat(steps[0][3], 2))[::2]
    kc.plan(engine.rp, engine.prefix, engine.extend, engine.rtt, verify_capacity=engine.vp.capacity, out=(engine.vp, engine.wp))
    kc.verify(engine.canary, engine.vp, log=engine.log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
    kc.write(engine.canary, engine.wp, spread, engine.pos, engine.loc, log=engine.log,
             kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL, chain_position_assert=engine.flag)
    kc.verify(engine.canary, engine.vp, log=engine.log, kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL)
    gpu_ab.synchronize()
    assert_snapshots_equal(engine.snapshot(), want[0])


# ---- move_pages in a graph -----------------------------------------------------------------------------


def _move_inputs(num_pages, n, steps):
    """Per replay: a permutation of n pages (sources and destinations overlap) and a bad id."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(steps):
        src = rng.permutation(num_pages)[:n]
        dst = rng.permutation(src)
        src[rng.integers(0, n)] = num_pages + 3  # skipped and counted
        out.append((src.astype(np.int64), dst.astype(np.int64)))
    return out


@contextlib.contextmanager
def _capture_context():
    """A failed capture's error with what else ran meanwhile: the threads alive and the garbage
    collections inside the capture (a global-mode capture fails on another thread's unsafe call)."""
    import gc
    import threading

    collections = []
    record = lambda phase, info: phase == "start" and collections.append(info["generation"])
    gc.callbacks.append(record)
    try:
        yield
    except RuntimeError as e:
        raise AssertionError(f"capture failed: {e}; threads alive: {[t.name for t in threading.enumerate()]}; "
                             f"garbage collections during the capture (generations): {collections}") from e
    finally:
        gc.callbacks.remove(record)


@pytest.mark.parametrize("warmed", [False, True], ids=["first-call-captured", "after-an-eager-call"])
@pytest.mark.parametrize("framework", ["cupy", "torch_cuda"])
def test_move_pages_capture_and_replay(framework, warmed):
    """A move captured once (with a workspace) replays new permutations, matching NumPy; the move
    captured as the process's first move, and after an eager one (torch's recipe: the torch case
    failed intermittently in one GPU run's order, "operation failed due to a previous error during
    capture", and passed alone)."""
    from test_move_pages import reference_move

    ab = get_backend_or_skip(framework)
    kc.warmup()
    page_size, num_pages, n = 4, 64, 24
    buf = np.random.default_rng(3).integers(-(2**40), 2**40, (num_pages * page_size, 4), dtype=np.int64)
    canary, count = ab.asarray(buf), ab.asarray(np.zeros(1, np.int64))
    src, dst = ab.asarray(np.zeros(n, np.int64)), ab.asarray(np.zeros(n, np.int64))
    workspace = kc.allocate_canary_buffer(n * page_size, like=canary)
    move = lambda: kc.move_pages(canary, src, dst, page_size=page_size, workspace=workspace, out_of_range_count=count)
    if warmed:  # an eager move of nothing: the pairs are zeros, page 0 onto itself, so the canary keeps its bytes
        move()
        ab.synchronize()
        np.testing.assert_array_equal(ab.to_numpy(canary), buf)
    if framework == "cupy":
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            move()
            graph = stream.end_capture()
        inputs_stream = stream  # the new inputs are copied on the stream the graph replays on
        replay = lambda: (graph.launch(stream), stream.synchronize())
    else:
        import torch

        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with _capture_context():
            with torch.cuda.graph(graph):
                move()
        inputs_stream = contextlib.nullcontext()  # torch's current stream, which the graph replays on
        replay = lambda: (graph.replay(), torch.cuda.synchronize())
    expected = buf
    for step, (s, d) in enumerate(_move_inputs(num_pages, n, 3)):
        with inputs_stream:
            src[...], dst[...] = ab.asarray(s), ab.asarray(d)
        replay()
        expected = reference_move(expected, s, d, page_size)
        np.testing.assert_array_equal(ab.to_numpy(canary), expected)
        assert int(ab.to_numpy(count)[0]) == step + 1
