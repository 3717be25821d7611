"""The reduction worker thread of a session with a process_group (kvcanary_cupy/rank_worker.py):
its lifecycle and errors over real gloo ranks, and the worker itself in one process."""

import re
import threading
import time

import pytest

from conftest import EXPECT_GPU
from dist_harness import PEER_TIMEOUT_S, STOP_STEP, run_ranks
from kvcanary_cupy.rank_worker import ReductionWorker

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= 1
CASES = [
    pytest.param(("numpy", 2), id="gloo-numpy-2"),
    pytest.param(("numpy", 4), id="gloo-numpy-4"),
    pytest.param(("cupy", 1), id="nccl-cupy-1",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not (_GPU or EXPECT_GPU), reason="needs a CUDA device")]),
]


@pytest.fixture(scope="module", params=CASES)
def ranks(request, tmp_path_factory):
    array, world_size = request.param
    out = tmp_path_factory.mktemp(f"worker-{array}-{world_size}")
    try:
        results = run_ranks(world_size, array, str(out), scenarios=("lifecycle", "peer_stops"), timeout=180)
    except TimeoutError as exc:
        pytest.fail(str(exc))
    for r, result in enumerate(results):
        for name, outcome in result.items():
            assert "crashed" not in outcome, f"rank {r} crashed in {name}:\n{outcome['crashed']}"
    return world_size, results


def test_the_thread_starts_at_the_first_reduction_and_stops_at_close_and_when_dropped(ranks):
    _, results = ranks
    for r, result in enumerate(results):
        got = result["lifecycle"]
        name = f"kvcanary-reduce-rank{r}"
        assert got["before"] == [] and got["thread_at_start"] is False
        assert got["running"] == [name, True, True, [name]]
        assert got["after_close"] == [False, []]
        assert got["refused"] == ("kv-canary: the session was closed (session.close()): its process_group reductions "
                                  "are stopped")
        assert got["after_drop"] == [False, []]


def test_a_peer_that_stops_fails_the_next_end_step_with_the_reduction_named(ranks):
    world_size, results = ranks
    if world_size == 1:
        pytest.skip("needs a peer rank")
    for r, result in enumerate(results):
        got = result["peer_stops"]
        assert got["after_close"] == [False, []]
        if r == world_size - 1:  # the rank that stopped
            assert got["error"] is None
            continue
        # the reduction of STOP_STEP hangs on the worker until the group's timeout; the next end_step reads it
        assert got["step"] == STOP_STEP + 1, got
        assert re.match(rf"kv-canary: the canary's reduction issued at step {STOP_STEP} failed on thread "
                        rf"'kvcanary-reduce-rank{r}': ", got["error"]), got["error"]
        assert got["cause"] != "NoneType"
        assert PEER_TIMEOUT_S <= got["seconds"] < PEER_TIMEOUT_S + 20


# -- the worker alone ---------------------------------------------------------------------------


def _threads(name):
    return [t for t in threading.enumerate() if t.name == name]


def test_results_come_back_in_order_and_the_thread_is_lazy_and_closed():
    worker = ReductionWorker("kvcanary-test-worker", timeout_s=10)
    assert worker.thread is None and not worker.pending()
    for i in range(3):
        worker.submit(lambda i=i: (i, threading.current_thread().name), f"job {i}")
        assert worker.pending()
        assert worker.result() == (i, "kvcanary-test-worker")
        assert not worker.pending()
    assert worker.thread.daemon and len(_threads("kvcanary-test-worker")) == 1
    worker.close()
    worker.close()
    assert not worker.thread.is_alive() and _threads("kvcanary-test-worker") == []
    with pytest.raises(RuntimeError, match=r"^kv-canary: kvcanary-test-worker is closed \(session.close\(\) was called\)"):
        worker.submit(lambda: None, "late")


def test_a_job_error_is_raised_by_the_next_result_naming_the_job():
    worker = ReductionWorker("kvcanary-test-errors", timeout_s=10)
    worker.submit(lambda: 1 // 0, "the reduction issued at step 7")
    with pytest.raises(RuntimeError, match=r"^kv-canary: the reduction issued at step 7 failed on thread "
                                           r"'kvcanary-test-errors': ZeroDivisionError: ") as info:
        worker.result()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    worker.submit(lambda: (_ for _ in ()).throw(ValueError("kv-canary: the ranks disagree")), "a check")
    with pytest.raises(ValueError, match=r"^kv-canary: the ranks disagree$"):  # the reducer's own checks: as raised
        worker.result()
    worker.submit(lambda: "fine", "after errors")  # the thread survives a job's error
    assert worker.result() == "fine"
    with pytest.raises(RuntimeError, match="got a job while"):
        worker.submit(lambda: None, "one")
        worker.submit(lambda: None, "two")
    worker.close()


def test_a_job_that_never_finishes_fails_the_wait_instead_of_hanging():
    release = threading.Event()
    worker = ReductionWorker("kvcanary-test-stuck", timeout_s=0.2)
    worker.submit(lambda: release.wait(30), "the reduction issued at step 3")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^kv-canary: the reduction issued at step 3 did not finish within 0 s on "
                                           r"thread 'kvcanary-test-stuck' \(a peer rank stopped"):
        worker.result()
    assert time.monotonic() - started < 5
    release.set()
    assert worker.result() is True  # still the job's result once it lands
    worker.close()
    assert _threads("kvcanary-test-stuck") == []


def test_a_failing_thread_setup_is_raised_with_the_first_job():
    def setup():
        raise OSError("no device")

    worker = ReductionWorker("kvcanary-test-setup", timeout_s=10, setup=setup)
    worker.submit(lambda: 1, "the first reduction")
    with pytest.raises(RuntimeError, match=r"the first reduction failed on thread 'kvcanary-test-setup': OSError: no device"):
        worker.result()
    worker.close()
