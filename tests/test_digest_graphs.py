"""digest_pages and verify_digest captured once in a CUDA graph (CuPy and torch) and replayed
with new KV bytes and new ranges in the same buffers: every replay equals NumPy's digest and
verdicts (issue 24)."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from conftest import get_backend_or_skip
from digest_pools import Model, build_pool, layout_of

NUMPY = get_backend_or_skip("numpy")


def _pool():
    rng = np.random.default_rng(12)
    model = Model.random(rng, [40, 17, 64], head_dim=32)
    pool = build_pool("vllm-NHD", model, page_size=16, num_pages=12, rng=rng)
    for r in range(3):
        pool.write(r, model)
        pool.stamp(r, model)
    return model, pool


def _digest(ab, layout, pool, model, starts, ends, keys, out):
    toks = np.zeros(pool.table.shape, np.int32)
    for r, t in enumerate(model.tokens):
        toks[pool.rows[r], : len(t)] = t
    return kc.digest_pages(layout, pool.table_on, pool.rows_on, starts, ends, spec=kc.DigestSpec(3), sample_keys=keys,
                           records=pool.canary_on, expected_tokens=pool.tokens_on, out=out)


@pytest.mark.parametrize("framework", ["cupy", "torch_cuda"])
def test_digest_and_verify_replay_in_a_graph(framework):
    ab = get_backend_or_skip(framework)
    kc.warmup()
    model, pool = _pool()
    tensors, layout = layout_of(pool, model, ab)
    toks = np.zeros(pool.table.shape, np.int32)
    for r, t in enumerate(model.tokens):
        toks[pool.rows[r], : len(t)] = t
    pool.table_on, pool.rows_on = ab.asarray(pool.table), ab.asarray(np.array(pool.rows, np.int64))
    pool.canary_on, pool.tokens_on = ab.asarray(pool.canary), ab.asarray(toks)
    starts, ends = ab.asarray(np.zeros(3, np.int64)), ab.asarray(np.array([40, 17, 64], np.int64))
    keys = ab.asarray(np.array([5, -6, 7], np.int64))
    actual = kc.DigestBatch.allocate(3, like=ab.like)
    codes = ab.asarray(np.full(3, -1, np.int32))
    log = kc.ViolationLog.allocate(16, num_kinds=kc.DIGEST_NUM_KINDS, like=ab.like)
    # the sender's records: NumPy's digest of the same pool, before anything changes
    _, host_layout = layout_of(pool, model, NUMPY)
    host = type("P", (), {})()
    host.table_on, host.rows_on, host.canary_on, host.tokens_on = pool.table, np.array(pool.rows, np.int64), pool.canary, toks

    def numpy_rows(ends_np):
        out = kc.DigestBatch.allocate(3)
        _, lay = layout_of(pool, model, NUMPY)
        _digest(NUMPY, lay, host, model, np.zeros(3, np.int64), ends_np, np.array([5, -6, 7], np.int64), out)
        return out.records.copy()

    expected = kc.DigestBatch.from_records(kc.DigestBatch(numpy_rows(np.array([40, 17, 64])), np.zeros(1, np.int64)).to_records(),
                                           like=ab.like)
    step = lambda: (_digest(ab, layout, pool, model, starts, ends, keys, actual),
                    kc.verify_digest(expected, actual, log=log, out=codes))
    if framework == "cupy":
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            step()
            graph = stream.end_capture()
        on_stream = stream
        replay = lambda: (graph.launch(stream), stream.synchronize())
    else:
        import contextlib

        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        log.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        on_stream = contextlib.nullcontext()
        replay = lambda: (graph.replay(), torch.cuda.synchronize())

    replay()
    assert ab.to_numpy(codes).tolist() == [0, 0, 0]
    np.testing.assert_array_equal(ab.to_numpy(actual.records), numpy_rows(np.array([40, 17, 64])))
    page = int(pool.table[pool.rows[2], 20]) // 16  # request 2's second page loses its K half in layer 1
    with on_stream:
        tensors[1][0][0, page] = 0
    pool.physical[1][0, page] = 0
    replay()
    assert ab.to_numpy(codes).tolist() == [0, 0, kc.DigestVerdict.MISMATCH_KV]
    np.testing.assert_array_equal(ab.to_numpy(actual.records), numpy_rows(np.array([40, 17, 64])))
    with on_stream:  # new ranges in the same buffer: request 1 digests fewer positions
        ends[...] = ab.asarray(np.array([40, 9, 64], np.int64))
    replay()
    assert ab.to_numpy(codes).tolist() == [0, kc.DigestVerdict.INCOMPARABLE, kc.DigestVerdict.MISMATCH_KV]
    np.testing.assert_array_equal(ab.to_numpy(actual.records), numpy_rows(np.array([40, 9, 64])))
    report = log.read()
    assert report.total_violations == 1 + 2 and int(report.kernel_run_counters[kc.DigestLaunchTag.TRANSFER]) == 3
