"""digest_pages and verify_digest captured once in a CUDA graph (CuPy and torch) and replayed
with new KV bytes and new ranges in the same buffers: every replay equals NumPy's digest and
verdicts (issue 24); the same scenario as repeated eager calls on every backend."""

import contextlib

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


def _digest(layout, arrays, starts, ends, keys, out):
    """Receiver-mode digest through ``arrays`` (table, rows, canary, tokens), all on the layout's backend."""
    return kc.digest_pages(layout, arrays["table"], arrays["rows"], starts, ends, spec=kc.DigestSpec(3), sample_keys=keys,
                           records=arrays["canary"], expected_tokens=arrays["tokens"], out=out)


def _capture(framework, step):
    """Capture ``step`` once in a CUDA graph of ``framework``: (the stream to write inputs on, replay)."""
    if framework == "cupy":
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            step()
            graph = stream.end_capture()
        return stream, lambda: (graph.launch(stream), stream.synchronize())
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's warm-up before a capture, on a side stream
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return contextlib.nullcontext(), lambda: (graph.replay(), torch.cuda.synchronize())


def _replays(ab, capture):
    """The scenario: a clean digest and verify, then a page's K half zeroed, then a shorter range
    written into the same ``ends`` buffer; each replay is compared with NumPy's digest of the
    same bytes.  ``capture(step)`` gives (a context to write inputs in, replay)."""
    model, pool = _pool()
    tensors, layout = layout_of(pool, model, ab)
    toks = np.zeros(pool.table.shape, np.int32)
    for r, t in enumerate(model.tokens):
        toks[pool.rows[r], : len(t)] = t
    on = {"table": ab.asarray(pool.table), "rows": ab.asarray(np.array(pool.rows, np.int64)),
          "canary": ab.asarray(pool.canary), "tokens": ab.asarray(toks)}
    starts, ends = ab.asarray(np.zeros(3, np.int64)), ab.asarray(np.array([40, 17, 64], np.int64))
    keys = ab.asarray(np.array([5, -6, 7], np.int64))
    actual = kc.DigestBatch.allocate(3, like=ab.like)
    codes = ab.asarray(np.full(3, -1, np.int32))
    log = kc.ViolationLog.allocate(16, num_kinds=kc.DIGEST_NUM_KINDS, like=ab.like)
    host = {"table": pool.table, "rows": np.array(pool.rows, np.int64), "canary": pool.canary, "tokens": toks}

    def numpy_rows(ends_np):
        """NumPy's digest of the host copy of the pool (its bytes as they are now)."""
        out = kc.DigestBatch.allocate(3)
        _, lay = layout_of(pool, model, NUMPY)
        _digest(lay, host, np.zeros(3, np.int64), ends_np, np.array([5, -6, 7], np.int64), out)
        return out.records.copy()

    # the sender's records: NumPy's digest of the same pool, before anything changes
    expected = kc.DigestBatch.from_records(kc.DigestBatch(numpy_rows(np.array([40, 17, 64])), np.zeros(1, np.int64)).to_records(),
                                           like=ab.like)
    on_stream, replay = capture(lambda: (_digest(layout, on, starts, ends, keys, actual),
                                         kc.verify_digest(expected, actual, log=log, out=codes)))
    with on_stream:
        log.reset()  # what torch's warm-up or the CPU's capture-time call logged is not the replays'

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


@pytest.mark.parametrize("framework", ["cupy", "torch_cuda"])
def test_digest_and_verify_replay_in_a_graph(framework):
    ab = get_backend_or_skip(framework)
    kc.warmup()
    _replays(ab, lambda step: _capture(framework, step))


def test_the_graph_scenario_as_repeated_eager_calls(ab):
    """The same scenario, each replay a plain call with the same arrays: on the GPU backends the
    calls after the first replay the first one's checked launches (digest/memo.py), which must
    read the new bytes and ranges; on the CPU backends it runs the GPU test's own code."""

    def capture(step):
        step()
        return contextlib.nullcontext(), lambda: (step(), ab.synchronize())

    _replays(ab, capture)
