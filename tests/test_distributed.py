"""CanarySession over real torch.distributed process groups (no mock): 2 and 4 gloo ranks on
127.0.0.1 with NumPy arrays and CPU tensors here; one NCCL rank on a GPU (the H200 run); 2 NCCL
ranks when 2 GPUs are present (issue 26: the same scenarios, case ``nccl-cupy-2``, i.e.
``run_ranks(2, "cupy", out)``).

Each parametrisation spawns its ranks once (module fixture) and runs every scenario of
tests/dist_harness.py; each test checks one scenario on every rank.
"""

import re

import pytest

from conftest import EXPECT_GPU
from dist_harness import FAULT_STEP, HEALTH_STEP, MISMATCH_STEP, STEPS, run_ranks

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

from kvcanary_cupy.distributed import TOTALS  # noqa: E402


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs(gpus: int):
    return pytest.mark.skipif(_gpus() < gpus and not (EXPECT_GPU and gpus == 1), reason=f"needs {gpus} CUDA device(s)")


# (array framework, world size): gloo for the CPU arrays, NCCL for the GPU ones.
CASES = [
    pytest.param(("numpy", 2), id="gloo-numpy-2"),
    pytest.param(("numpy", 4), id="gloo-numpy-4"),
    pytest.param(("torch_cpu", 2), id="gloo-torch_cpu-2"),
    pytest.param(("cupy", 1), id="nccl-cupy-1", marks=[pytest.mark.gpu, _needs(1)]),
    pytest.param(("torch_cuda", 1), id="nccl-torch_cuda-1", marks=[pytest.mark.gpu, _needs(1)]),
    pytest.param(("cupy", 2), id="nccl-cupy-2", marks=[pytest.mark.gpu, _needs(2)]),
]


@pytest.fixture(scope="module", params=CASES)
def ranks(request, tmp_path_factory):
    array, world_size = request.param
    if array in ("cupy", "torch_cuda") and not (dist.is_nccl_available() and _gpus() >= world_size):
        pytest.fail(f"{world_size} NCCL rank(s) need {world_size} CUDA device(s) and NCCL")  # KVCANARY_EXPECT_GPU=1
    out = tmp_path_factory.mktemp(f"{array}-{world_size}")
    try:
        results = run_ranks(world_size, array, str(out))
    except TimeoutError as exc:
        pytest.fail(str(exc))
    return world_size, results


def _scenario(ranks, name):
    world_size, results = ranks
    got = []
    for r, result in enumerate(results):
        outcome = result[name]
        assert "crashed" not in outcome, f"rank {r} crashed in {name}:\n{outcome['crashed']}"
        got.append(outcome)
    return world_size, got


def test_clean_run_raises_nothing_and_the_totals_are_the_sum(ranks):
    world_size, got = _scenario(ranks, "clean")
    for r, g in enumerate(got):
        assert g["raised"] == []
        assert g["stats"]["steps"] == STEPS and g["stats"]["violations"] == 0 and g["stats"]["verified_entries"] > 0
        # after check() every rank holds every rank's final totals, the same on every rank
        assert g["totals"] == got[0]["totals"] and g["per_rank"] == got[0]["per_rank"]
        assert g["reducer"]["reductions"] == STEPS + 1 and g["reducer"]["replica_mismatches"] == 0
    for k in TOTALS:
        want = sum(g["stats"][k] for g in got) if k != "handled_steps" else world_size * STEPS
        assert got[0]["totals"][k] == want, k
    for r, g in enumerate(got):
        assert got[0]["per_rank"][r]["verified_entries"] == g["stats"]["verified_entries"]


@pytest.mark.parametrize("scenario, every", [("fault", 1), ("fault_every_3", 3)])
def test_a_fault_on_one_rank_raises_on_every_rank_on_the_same_step(ranks, scenario, every):
    world_size, got = _scenario(ranks, scenario)
    odd = world_size - 1
    # handled by the faulty rank's next end_step, reduced at the first reduction after it, read at the next
    handled = FAULT_STEP + 1
    issued = next(s for s in range(handled, STEPS) if (s + 1) % every == 0)
    expected_step = issued + every if issued + every < STEPS else "check"
    for r, g in enumerate(got):
        (error,) = g["raised"]  # once: the repeats of the same violations are not new
        assert error["step"] == expected_step
        assert error["ranks"] == [odd]
        assert re.search(rf"new violations on ranks \[{odd}\] \(rank {odd}: 4\)", error["message"]), error["message"]
        assert f" on rank {r} (" in error["message"].splitlines()[0]
        if r == odd:
            assert len(error["violations"]) == 4  # HEAD and TAIL, the stale slot and its successor
            assert {(v["rank"], v["device"]) for v in error["violations"]} == {(odd, g["device"])}
        else:
            assert error["violations"] == []
        assert g["totals"]["violations"] == got[odd]["stats"]["violations"] > 0
    gathered = got[0]["gathered"]
    assert [g["gathered"] for g in got[1:]] == [None] * (world_size - 1)
    assert {v["rank"] for v in gathered["violations"]} == {odd} and len(gathered["violations"]) == 4
    assert gathered["total_violations"] == sum(g["stats"]["violations"] for g in got)
    assert gathered["steps"] == STEPS


def test_callable_and_log_policies_run_on_every_rank_on_the_same_step(ranks):
    world_size, got = _scenario(ranks, "fault_callable")
    odd = world_size - 1
    for r, g in enumerate(got):
        assert g["calls"] == [dict(step=FAULT_STEP + 2, ranks=[odd], violations=4 if r == odd else 0)]
    world_size, got = _scenario(ranks, "fault_log")
    for r, g in enumerate(got):
        warnings = [m for level, m in g["records"] if level == "WARNING"]
        headline = [m for m in warnings if m.startswith("kv-canary: ")]
        assert len(headline) == 1 and f"new violations on ranks [{odd}] (rank {odd}: 4)" in headline[0]
        lines = [m for m in warnings if m.startswith("kv_canary violation: ")]
        assert len(lines) == (4 if r == odd else 0) and all(f" rank={odd} device=" in m for m in lines)


def test_a_health_problem_on_one_rank_raises_on_every_rank_on_the_same_step(ranks):
    world_size, got = _scenario(ranks, "health")
    odd = world_size - 1
    for r, g in enumerate(got):
        (error,) = g["raised"]
        assert error["step"] == HEALTH_STEP + 2
        if r == odd:
            assert error["message"].startswith(f"kv-canary: no canary kernel ran for launch tags ['HEAD_K_FULL', "
                                               f"'TAIL_K_FULL'] in step {HEALTH_STEP}")
        else:
            assert error["message"] == (f"kv-canary: rank {odd} handled 1 health problem(s) by step {HEALTH_STEP + 1} "
                                        "(that rank's log has the message)")


def test_a_replicated_kv_mismatch_names_both_ranks_and_the_slot(ranks):
    world_size, got = _scenario(ranks, "replicated")
    odd = world_size - 1
    for r, g in enumerate(got):
        assert g["local"] == []  # no rank's own canary can see it: the KV was wrong before it was fingerprinted
        if world_size == 1:
            assert g["raised"] == [] and g["reducer"]["replicated_slots_compared"] > 0
            continue
        (error,) = g["raised"]
        assert error["step"] == MISMATCH_STEP + 1  # compared after the step that wrote it, read at the next
        ((m,),) = [error["mismatches"]]
        assert (m["kind"], m["slot_idx"], m["rank"], m["other_rank"], m["step"]) == (
            "replicated_kv_mismatch", g["slot"], odd, 0, MISMATCH_STEP)
        # both fingerprints exactly as the two ranks hold them (any 64-bit value passes the reduction intact)
        assert (m["real_kv_hash"], m["other_real_kv_hash"]) == (got[odd]["own_hash"], got[0]["own_hash"])
        assert m["real_kv_hash"] != m["other_real_kv_hash"]
        assert error["ranks"] == [0, odd]
        assert f"replicated_kv_mismatch: slot_idx={g['slot']} rank={odd}" in error["message"]


def test_mismatched_pool_sizes_are_refused_at_start_naming_the_rank(ranks):
    world_size, got = _scenario(ranks, "agreement")
    if world_size == 1:
        assert got[0] == {"canary": None, "pool": None}
        return
    odd = world_size - 1
    for g in got:
        assert g["canary"] == (f"kv-canary: the ranks of process_group disagree on num_slots: rank 0 has 512, "
                               f"rank {odd} has 256; build every rank's session with the same sizes")
        assert g["pool"] == (f"kv-canary: the ranks of process_group disagree on real_kv_sources[0] slots (KV pool size): "
                             f"rank 0 has 512, rank {odd} has 640; build every rank's session with the same sizes")


def test_mismatched_table_shapes_are_refused_at_the_first_reduction(ranks):
    world_size, got = _scenario(ranks, "table_shape")
    if world_size == 1:
        assert got[0]["error"] is None
        return
    for g in got:
        assert g["step"] == 1
        assert g["error"].startswith(f"kv-canary: the ranks of process_group disagree on the table shape: rank 0 has "
                                     f"(9, 64), rank {world_size - 1} has (9, 48)")


def test_the_default_group_is_refused_unless_allowed(ranks):
    world_size, got = _scenario(ranks, "default_group")
    for g in got:
        assert g["refused"].startswith("kv-canary: process_group is the default (WORLD) group")
        assert g["steps"] == world_size


def test_each_rank_exports_its_metrics_under_its_rank(ranks):
    world_size, got = _scenario(ranks, "metrics")
    if not got[0]["prometheus_client"]:
        pytest.skip("prometheus_client is not installed (the test extra has it)")
    for g in got:
        assert (g["steps"], g["heartbeat"]) == (3, 3) and g["verified"] == g["stats_verified"] > 0


def test_a_hung_rank_fails_the_run_instead_of_hanging_it(tmp_path):
    with pytest.raises(TimeoutError, match=r"^2 numpy ranks did not finish within 10 s \(a hang\)$"):
        run_ranks(2, "numpy", str(tmp_path), scenarios=("hang",), timeout=10)
