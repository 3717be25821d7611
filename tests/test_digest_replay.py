"""The digest's CUDA road on the CPU (kvcanary_cupy/devtools/fake_cupy.py: CuPy arrays over host
memory, launches recorded, not run): each launch carries the parameter structs of the call, and a
call with the last call's arguments, unchanged, replays the checked launches byte for byte
without checking again (digest/memo.py); anything changed, in place too, takes the checked path;
the memo keeps no array alive."""

import gc
import weakref

import numpy as np
import pytest

import kvcanary_cupy as kc
from digest_pools import Model, build_pool
from kvcanary_cupy.backends.cuda.params import log_struct
from kvcanary_cupy.binding import log_views
from kvcanary_cupy.digest import cuda, memo, pages, verdicts
from kvcanary_cupy.devtools.fake_cupy import fake_device

torch = pytest.importorskip("torch")


@pytest.fixture(params=[False, True], ids=["cupy-launch", "overlapped"])
def dev(monkeypatch, request):
    with fake_device(overlap=request.param) as d:
        import cupy

        real = cupy.asarray  # KvLayout places its pointer array with cupy.asarray: onto the fake device too
        monkeypatch.setattr(cupy, "asarray", lambda a, *args, **kw: a if isinstance(a, cupy.ndarray) else d.asarray(np.asarray(a)))
        yield d
        monkeypatch.setattr(cupy, "asarray", real)


def counting(monkeypatch, module, name):
    """Count the calls of ``module.name`` (a check of the checked path)."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


def call(dev, rtt=None):
    """Sender-mode digest_pages of a small SGLang pool, every array on the fake device."""
    rng = np.random.default_rng(3)
    model = Model.random(rng, [9, 5])
    pool = build_pool("sglang", model, page_size=4, num_pages=8, rng=rng)
    layout = kc.KvLayout.from_sglang([dev.asarray(p[0]) for p in pool.physical], [dev.asarray(p[1]) for p in pool.physical],
                                     page_size=4, dtype="bfloat16")
    a = {"table": dev.asarray(pool.table) if rtt is None else rtt, "rows": dev.asarray(np.array(pool.rows, np.int64)),
         "starts": dev.asarray(np.zeros(2, np.int64)), "ends": dev.asarray(np.array([9, 5], np.int64)),
         "keys": dev.asarray(np.array([4, 5], np.int64)), "canary": dev.asarray(pool.canary),
         "out": kc.DigestBatch.allocate(2, like=dev.asarray(np.zeros(1)))}
    spec = kc.DigestSpec(3)
    run = lambda **kw: kc.digest_pages(layout, a["table"], a["rows"], a["starts"], a["ends"], spec=spec,  # noqa: E731
                                       sample_keys=a["keys"], records=a["canary"], out=a["out"], **kw)
    return a, run


def launches(dev, fn):
    dev.launches.clear()
    fn()
    return [(x.name, x.grid, x.block, x.args) for x in dev.launches]


def test_the_launches_carry_the_structs_of_the_call(dev, monkeypatch):
    a, run = call(dev)
    seen = []
    real = cuda.digest
    monkeypatch.setattr(cuda, "digest", lambda args, placement: (seen.append(args), real(args, placement))[1])
    overlapped = len(dev.overlapped)
    (init, acc) = launches(dev, run)
    assert len(dev.overlapped) == overlapped + 2 * dev.overlap  # on sm_90 through cuLaunchKernelEx, as every canary op
    (args,) = seen
    structs = (cuda.table_struct(args.table), cuda.pool_struct(args.layout), cuda.requests_struct(args))
    nw = cuda.unit_words(args.layout, args.num_layers_total, args.sample_layers, args.window_bytes)
    assert nw == 2  # this small pool's 16-byte strips, whole: a lane a (layer, half, head) strip
    assert init[0] == "kvcanary::digest_init" and acc[0] == "kvcanary::digest_units<0>"
    assert init[3] == acc[3] == tuple(s.tobytes() for s in structs)
    assert init[1] == (1,) and acc[1][1] == 2  # one block of 256 for the headers; y walks the 2 requests

    log = kc.ViolationLog.allocate(4, num_kinds=kc.DIGEST_NUM_KINDS, like=a["rows"])
    codes = dev.asarray(np.zeros(2, np.int32))
    (v,) = launches(dev, lambda: kc.verify_digest(a["out"], a["out"], log=log, out=codes,
                                                  kernel_kind=kc.DigestLaunchTag.OFFLOAD))
    p = lambda x: np.uint64(x.data.ptr).tobytes()  # noqa: E731
    assert v[0] == "kvcanary::digest_verify" and v[3] == (p(a["out"].records), p(a["out"].records), np.int64(2).tobytes(),
                                                         p(codes), log_struct(log_views(log)).tobytes(),
                                                         np.int32(kc.DigestLaunchTag.OFFLOAD).tobytes())


def test_the_same_arguments_replay_the_checked_launches(dev, monkeypatch):
    a, run = call(dev)
    checks = counting(monkeypatch, pages, "table_view")
    first = launches(dev, run)
    assert launches(dev, run) == first and len(checks) == 1  # replayed: not checked again
    monkeypatch.setattr(pages, "_strict_check", lambda args: None)  # its host read of the indices: no device here
    launches(dev, lambda: run(strict=True))
    assert len(checks) == 2  # strict checks every time

    log = kc.ViolationLog.allocate(4, num_kinds=kc.DIGEST_NUM_KINDS, like=a["rows"])
    codes = dev.asarray(np.zeros(2, np.int32))
    log_checks = counting(monkeypatch, verdicts, "log_views")
    verify = lambda kind=kc.DigestLaunchTag.TRANSFER: kc.verify_digest(a["out"], a["out"], log=log, out=codes,  # noqa: E731
                                                                       kernel_kind=kind)
    first = launches(dev, verify)
    assert launches(dev, verify) == first and len(log_checks) == 1
    other = launches(dev, lambda: verify(kc.DigestLaunchTag.RELOAD))
    assert len(log_checks) == 2 and other[0][3][-1] == np.int32(kc.DigestLaunchTag.RELOAD).tobytes()
    with pytest.raises(ValueError, match="kernel_kind must be in"):
        verify(kc.DIGEST_NUM_KINDS)  # a value the last call did not have is checked


def test_changed_arguments_take_the_checked_path(dev, monkeypatch):
    a, run = call(dev)
    checks = counting(monkeypatch, pages, "table_view")
    first = launches(dev, run)
    a["starts"] = dev.asarray(np.zeros(2, np.int64))  # equal values, another array
    moved = launches(dev, run)
    assert len(checks) == 2 and moved != first
    assert moved[0][3][2] != first[0][3][2] and moved[0][3][:2] == first[0][3][:2]  # only the requests' struct
    a["ends"].shape = (2, 1)  # reshaped in place: same object, same address
    with pytest.raises(ValueError, match="ends"):
        run()
    a["ends"].shape = (2,)  # back as it was when the call was remembered: replayed
    assert launches(dev, run) == moved and len(checks) == 2


def test_padded_arrays_are_checked_every_call(dev, monkeypatch):
    """Only calls whose arrays are all contiguous are remembered (a non-contiguous 1-D input is
    copied on the checked path, and a replay must not reuse a copy)."""
    padded = dev.asarray(np.zeros((3, 40), np.int32))[:, :16]  # rows contiguous, the array not
    a, run = call(dev, rtt=padded)
    checks = counting(monkeypatch, pages, "table_view")
    run()
    run()
    assert len(checks) == 2


def test_the_memo_keeps_no_array_alive(dev):
    a, run = call(dev)
    run()
    refs = [weakref.ref(a["out"].records), weakref.ref(a["starts"]), weakref.ref(a["canary"])]
    del a, run
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_last_call_matches_identity_values_and_array_metadata():
    m = memo.LastCall()
    t, spec = torch.zeros(4, dtype=torch.int64), kc.DigestSpec(2)
    m.put((spec, t, None), (1,), [t], "L")
    assert m.get((spec, t, None), (1,)) == "L"
    assert m.get((spec, t, None), (2,)) is None  # another value
    assert m.get((spec, t.clone(), None), (1,)) is None  # another tensor
    assert m.get((spec, t, t), (1,)) is None  # None is no match for an object
    t.requires_grad_(False)
    assert m.get((spec, t, None), (1,)) == "L"
    t.resize_(8)  # in place: another shape
    assert m.get((spec, t, None), (1,)) is None
    f = torch.zeros(2)
    m.put((f,), (), [f], "G")
    f.requires_grad_()  # which the checks refuse for a written tensor
    assert m.get((f,)) is None
    m.put((kc.DigestSpec(3), t), (), [t], "M")
    gc.collect()
    assert m.get((None, t)) is None  # a dead reference matches nothing, None included
    m.put((object(),), (), [], "N")  # no weak references: nothing remembered
    assert m.get((None,)) is None


def test_on_the_device_a_replay_reads_new_values_and_an_in_place_reshape_is_checked(gpu_ab):
    """On a real GPU: the second call (replayed) digests the bytes and ranges as they are now, and
    an array reshaped in place after the remembered call is checked (its error), not replayed."""
    from conftest import get_backend_or_skip
    from digest_pools import layout_of

    numpy_ab = get_backend_or_skip("numpy")
    rng = np.random.default_rng(5)
    model = Model.random(rng, [11, 6])
    pool = build_pool("vllm-NHD", model, page_size=4, num_pages=8, rng=rng)
    for r in range(2):
        pool.write(r, model)
        pool.stamp(r, model)
    spec = kc.DigestSpec.full(3)

    def digest(ab, ends_np):
        """A call of the pool's two requests on ``ab``: the call, its arrays and its out batch."""
        _, layout = layout_of(pool, model, ab)
        arrays = {"table": ab.asarray(pool.table), "rows": ab.asarray(np.array(pool.rows, np.int64)),
                  "starts": ab.asarray(np.zeros(2, np.int64)), "ends": ab.asarray(ends_np),
                  "keys": ab.asarray(np.array([1, 2], np.int64)), "canary": ab.asarray(pool.canary)}
        out = kc.DigestBatch.allocate(2, like=arrays["rows"])
        run = lambda: kc.digest_pages(layout, arrays["table"], arrays["rows"], arrays["starts"], arrays["ends"], spec=spec,  # noqa: E731
                                      sample_keys=arrays["keys"], records=arrays["canary"], out=out)
        return run, arrays, out

    want = lambda ends_np: numpy_ab.to_numpy(digest(numpy_ab, ends_np)[0]().records)  # noqa: E731
    run, arrays, out = digest(gpu_ab, np.array([11, 6], np.int64))
    run()
    np.testing.assert_array_equal(gpu_ab.to_numpy(out.records), want(np.array([11, 6], np.int64)))
    arrays["ends"][...] = gpu_ab.asarray(np.array([7, 6], np.int64))  # new values, same array: replayed
    run()
    np.testing.assert_array_equal(gpu_ab.to_numpy(out.records), want(np.array([7, 6], np.int64)))
    ends = arrays["ends"]
    if gpu_ab.name == "cupy":
        ends.shape = (2, 1)
    else:
        ends.resize_(2, 1)
    with pytest.raises(ValueError, match="ends"):
        run()
