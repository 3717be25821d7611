"""A prefill -> decode transfer between two real torch.distributed processes (issue 26, item 2):
the KV and its DigestRecord cross the process group (gloo on the host here, NCCL between two GPUs
when two are present: case ``nccl-torch_cuda-2``), the decode side lands them in a pool of another
layout and page size, digests its own memory and compares.  Every fault of the digest's matrix
gives its verdict in FULL and sampled modes, and hundreds of clean transfers all MATCH."""

import numpy as np
import pytest

from test_digest_transfer import FAULTS
from transfer_harness import run_transfers

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

CLEAN_ROUNDS = 120
SPECS = ("full", "sampled")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


CASES = [
    pytest.param("numpy", id="gloo-numpy-2"),
    pytest.param("torch_cpu", id="gloo-torch_cpu-2"),
    pytest.param("torch_cuda", id="nccl-torch_cuda-2",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices")]),
]


def _cases():
    """The fault matrix in both modes (seeds as the one-process matrix's), then the clean rounds."""
    cases = [(fault, spec, len(fault), (37, 37, 53)) for fault, *_ in FAULTS for spec in SPECS]
    rng = np.random.default_rng(77)
    cases += [("clean", SPECS[i % 2], 1000 + i, tuple(int(x) for x in rng.integers(1, 60, 3))) for i in range(CLEAN_ROUNDS)]
    return cases


@pytest.fixture(scope="module", params=CASES)
def verdicts(request, tmp_path_factory):
    array = request.param
    if array == "torch_cuda" and not dist.is_nccl_available():
        pytest.fail("two CUDA devices but no NCCL in this torch build")
    cases = _cases()
    try:
        got = run_transfers(array, str(tmp_path_factory.mktemp(f"transfer-{array}")), cases)
    except TimeoutError as exc:
        pytest.fail(str(exc))
    return dict(zip(((fault, spec, seed) for fault, spec, seed, _ in cases), got))


@pytest.mark.parametrize("fault, full, sampled", FAULTS, ids=[f[0] for f in FAULTS])
def test_each_fault_gives_its_verdict_across_the_processes(verdicts, fault, full, sampled):
    for spec, want in (("full", full), ("sampled", sampled)):
        got = verdicts[(fault, spec, len(fault))]
        assert got[0] == want.name, (fault, spec)
        assert got[1:] == [want.name if fault == "incomparable" else "MATCH"] * 2  # a spec mismatch is every request's


def test_hundreds_of_clean_transfers_all_match(verdicts):
    clean = [v for (fault, _, seed), v in verdicts.items() if fault == "clean" and seed >= 1000]
    assert len(clean) == CLEAN_ROUNDS and all(v == ["MATCH"] * 3 for v in clean)


def test_the_transfer_benchmark_runs_and_lands_a_match_on_gloo():
    """benchmarks/bench_transfer.py (the 2-GPU run's figure) on the host: its decode rank raises
    unless the received request's digest MATCHes."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_transfer.py"), "--tokens", "64", "--repeats", "1"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "digest / send" in run.stdout and "gloo, one 70B-shaped request of 64 tokens" in run.stdout
