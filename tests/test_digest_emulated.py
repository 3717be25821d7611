"""The CUDA digest kernels' bytes on a machine without a GPU: ``kernels/digest.cu`` built for the
CPU with g++ (kvcanary_cupy/devtools/digest_emulate.py, a host thread a lane) runs the launches the
library makes on the fake device, and the CUDA road's records, counters and verdicts must equal
the NumPy backend's, through the tests the GPU backends run (tests/test_digest.py) and a
verify_digest of every verdict.  The fake device launches as an sm_90 one does (cuLaunchKernelEx);
tests/test_digest_replay.py checks the other road's launches are the same."""

import numpy as np
import pytest

import kvcanary_cupy as kc
import test_digest as digest_tests
from conftest import ArrayBackend
from digest_pools import Model

pytest.importorskip("cupy")

from kvcanary_cupy.devtools import digest_emulate  # noqa: E402
from kvcanary_cupy.devtools.fake_cupy import fake_device  # noqa: E402


@pytest.fixture
def emulated():
    """An array backend whose arrays live on the fake device; reading one back first runs the
    launches made so far through the emulator."""
    try:
        digest_emulate._library()
    except RuntimeError as exc:  # no g++ with C++20 here
        pytest.skip(str(exc))
    with fake_device(overlap=True) as dev, pytest.MonkeyPatch.context() as mp:
        import cupy

        # KvLayout places its pointer array with cupy.asarray: onto the fake device too
        mp.setattr(cupy, "asarray", lambda a, *args, **kw: a if isinstance(a, cupy.ndarray) else dev.asarray(np.asarray(a)))
        emulator = digest_emulate.Emulator(dev, caps=(1, 3, 16))  # grids of 8 to 128 warps: chunks of 1 to 32 positions

        def to_numpy(x):
            emulator.run_pending()
            return dev.to_numpy(x).copy()

        yield ArrayBackend("cupy-emulated", False, lambda a: dev.asarray(np.asarray(a)), to_numpy)


def test_fuzzed_cases(emulated):
    digest_tests.test_fuzzed_cases_are_byte_identical_to_numpy(emulated)


def test_out_of_range_requests_and_positions(emulated):
    digest_tests.test_out_of_range_is_skipped_and_counted(emulated)


@pytest.mark.parametrize("table_kind", ["req_to_token", "block", "virtual", "paged"])
def test_table_kinds(emulated, table_kind):
    digest_tests.test_table_kinds_and_backends_give_the_same_bytes(emulated, table_kind)


def test_every_pool_shape(emulated):
    for kind in digest_tests.KINDS:
        digest_tests.test_every_pool_shape_digests_to_the_oracle(emulated, kind, "bfloat16")


def test_verify_digest_gives_every_verdict_and_its_log_rows(emulated):
    numpy_ab = digest_tests.kc_numpy()
    rng = np.random.default_rng(11)
    model = Model.random(rng, [6, 9, 3, 12, 5, 7])
    pool = digest_tests.filled("sglang", model, rng)
    expected, _ = digest_tests.run(numpy_ab, pool, model, kc.DigestSpec.full(3))
    expected = expected[:6].copy()
    actual = expected.copy()
    actual[1, 5] ^= 1  # the KV sum: MISMATCH_KV
    actual[2, 6] ^= 1  # the provenance sum: MISMATCH_PROVENANCE
    actual[3, 0] = 0  # no record: MISSING
    actual[4, 1] ^= 1  # another spec's signature: INCOMPARABLE
    actual[5, 4] += 1  # another range: INCOMPARABLE
    got = {}
    for ab in (numpy_ab, emulated):
        log = kc.ViolationLog.allocate(16, num_kinds=kc.DIGEST_NUM_KINDS, like=ab.like)
        codes = ab.asarray(np.full(6, -9, np.int32))
        batch = lambda rows: kc.DigestBatch(ab.asarray(rows), ab.asarray(np.zeros(1, np.int64)))  # noqa: E731
        kc.verify_digest(batch(expected), batch(actual), log=log, out=codes, kernel_kind=kc.DigestLaunchTag.RELOAD)
        got[ab.name] = [ab.to_numpy(codes)] + [ab.to_numpy(x) for x in log.arrays().values()]
    V = kc.DigestVerdict
    assert got["numpy"][0].tolist() == [V.MATCH, V.MISMATCH_KV, V.MISMATCH_PROVENANCE, V.MISSING, V.INCOMPARABLE, V.INCOMPARABLE]
    for want, have in zip(got["numpy"], got["cupy-emulated"]):
        assert want.tobytes() == have.tobytes()


def test_model_sized_heads(emulated):
    digest_tests.test_wide_heads_are_byte_identical_to_numpy(emulated)
