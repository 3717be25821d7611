"""Argument errors point at the caller: each names its argument, and its traceback ends in the
public function that was called, not in kv-canary's shared checking helpers."""

import traceback
from pathlib import Path

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import CanaryCapacities, CanaryPlanner, RealKvSource, VerifyPlan, ViolationLog, WritePlan
from canary_builders import canary, i64, linear_rtt, make_log, make_verify_plan, make_write_plan
from conftest import get_backend_or_skip

NP = get_backend_or_skip("numpy")


def _planner():
    return CanaryPlanner.from_engine(kv_pool_size=64, max_running_requests=2)


CALLS = {
    "plan": (lambda: kc.plan(i64([1]), i64([1]).astype(np.int32), i64([1]), linear_rtt(2, 4), verify_capacity=4),
             "ops/planning.py", "plan", TypeError),
    "write": (lambda: kc.write(canary(8), make_write_plan(NP, [0, 1], [-1]), i64([1]), i64([0, 1]), i64([3]),
                               log=make_log(NP)), "ops/canary.py", "write", ValueError),
    "verify": (lambda: kc.verify(canary(8), make_verify_plan(NP, [1], [0], [-1]), log=make_log(NP), kernel_kind=99),
               "ops/canary.py", "verify", ValueError),
    "verify strict": (lambda: kc.verify(canary(8), make_verify_plan(NP, [9], [0], [-1]), log=make_log(NP), strict=True),
                      "ops/canary.py", "verify", ValueError),
    "scatter": (lambda: kc.scatter_req_token_ids(i64([1]), i64([0]), i64([1]), np.zeros((2, 2), np.int32)),
                "ops/pool.py", "scatter_req_token_ids", ValueError),
    "ViolationLog.allocate": (lambda: ViolationLog.allocate(0), "log.py", "allocate", ValueError),
    "VerifyPlan.allocate": (lambda: VerifyPlan.allocate(-1), "plans.py", "allocate", ValueError),
    "WritePlan.allocate": (lambda: WritePlan.allocate(1.5), "plans.py", "allocate", TypeError),
    "allocate_canary_buffer": (lambda: kc.allocate_canary_buffer(-1), "plans.py", "allocate_canary_buffer", ValueError),
    "RealKvSource": (lambda: RealKvSource(np.zeros((4, 64), np.uint8), 0, 16, 16), "sources.py", "__post_init__", ValueError),
    "CanaryCapacities.from_engine": (lambda: CanaryCapacities.from_engine(kv_pool_size=1.0, max_running_requests=1),
                                     "planner.py", "from_engine", TypeError),
    "CanaryPlanner": (lambda: CanaryPlanner(None), "planner.py", "__init__", TypeError),
    "CanaryPlanner.from_engine": (lambda: CanaryPlanner.from_engine(kv_pool_size=4, max_running_requests="2"),
                                  "planner.py", "from_engine", TypeError),
    "CanaryPlanner.plan": (lambda: _planner().plan(i64([1]), [1], i64([1]), linear_rtt(2, 4)), "planner.py", "plan", TypeError),
    "WriteLauncher call": (lambda: kc.WriteLauncher(canary(8), make_write_plan(NP, [0, 1], [-1]), log=make_log(NP))(
        i64([1]), i64([0, 1]), i64([3])), "launchers.py", "__call__", ValueError),
    "CanaryPlanner.plan via plan": (lambda: _planner().plan(i64([1]), i64([9]), i64([1]), linear_rtt(2, 4), strict=True),
                                    "planner.py", "plan", ValueError),
}


@pytest.mark.parametrize("case", sorted(CALLS))
def test_argument_error_tracebacks_end_at_the_public_call(case):
    call, filename, function, exc = CALLS[case]
    with pytest.raises(exc, match="^kv-canary: ") as info:
        call()
    frames = traceback.extract_tb(info.tb)
    last = frames[-1]
    where = Path(last.filename).resolve().relative_to(Path(kc.__file__).resolve().parent).as_posix()
    assert (where, last.name) == (filename, function), frames
    assert not any(Path(f.filename).name in ("errors.py", "validation.py", "interop.py", "strict.py") and f.name != "entry_point"
                   for f in frames), frames


def test_other_errors_keep_their_whole_traceback(monkeypatch):
    """Only argument errors are trimmed: a failure inside a backend still shows where it happened."""
    from kvcanary_cupy.backends import get_backend

    def broken(args):
        raise ValueError("not an argument error")

    monkeypatch.setattr(get_backend("numpy"), "verify", broken)
    with pytest.raises(ValueError, match="not an argument error") as info:
        kc.verify(canary(8), make_verify_plan(NP, [1], [0], [-1]), log=make_log(NP))
    assert traceback.extract_tb(info.tb)[-1].name == "broken"


@pytest.mark.parametrize("index, name", enumerate(["req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token"]))
def test_planner_names_each_argument(index, name):
    args = [i64([1]), i64([1]), i64([1]), linear_rtt(2, 4)]
    args[index] = kc.ReqToToken([1]) if index == 3 else [1]  # a table's arrays are named as the table's fields
    with pytest.raises(TypeError, match=rf"^kv-canary: {name} must be a NumPy array, a CuPy array or a PyTorch tensor, got builtins.list"):
        _planner().plan(*args)


def test_planner_names_a_table_that_is_no_table():
    with pytest.raises(TypeError, match=r"^kv-canary: table must be a ReqToToken, BlockTable or PagedKvIndices \(or a 2-D int32 req_to_token array\), got builtins.list"):
        _planner().plan(i64([1]), i64([1]), i64([1]), [1])


def test_planner_names_keyword_arguments():
    with pytest.raises(TypeError, match=r"^kv-canary: req_to_verify_expected_tokens_valid_lens must be a NumPy array"):
        _planner().plan(i64([1]), i64([1]), i64([1]), linear_rtt(2, 4), req_to_verify_expected_tokens=np.zeros((2, 4), np.int32),
                        req_to_verify_expected_tokens_valid_lens=(1,))
