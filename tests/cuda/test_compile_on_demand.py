"""A first call compiles only the kernels it launches; warm-up compiles every variant on threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvcanary_cupy as kc

pytest.importorskip("cupy")


def _recording_compile(monkeypatch, compile_module):
    built, real = [], compile_module._module

    def record(family, name):
        built.append((family, name, threading.current_thread().name))
        return real(family, name)

    monkeypatch.setattr(compile_module, "_module", record)
    return built


def test_a_first_call_compiles_the_instantiations_it_launches_only(monkeypatch):
    from kvcanary_cupy.backends.cuda import compile as cc
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    with fake_device() as dev:
        built = _recording_compile(monkeypatch, cc)
        rtt = dev.asarray(np.arange(64, dtype=np.int32).reshape(4, 16))
        canary, log = kc.allocate_canary_buffer(64, like=rtt), kc.ViolationLog.allocate(16, like=rtt)
        vp, wp = kc.plan(dev.asarray(np.array([1])), dev.asarray(np.array([2])), dev.asarray(np.array([3])), rtt,
                         verify_capacity=8)
        kc.verify(canary, vp, log=log)
        kc.write(canary, wp, *(dev.asarray(np.arange(3) + k) for k in (5, 2, 16)), log=log)
        launched = {x.name for x in dev.launches}
    names = [name for _, name, _ in built]
    assert len(names) == len(set(names)) and set(names) == launched  # each compiled once, nothing more
    assert {family for family, _, _ in built} == {"plan_req_to_token", "verify", "write"}
    for family, name, _ in built:
        assert name in cc.FAMILIES[family].instantiations()


def test_warmup_compiles_on_threads_and_raises_the_first_error(monkeypatch):
    from kvcanary_cupy.backends.cuda import compile as cc
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    with fake_device():
        built = _recording_compile(monkeypatch, cc)
        variants = [(family, name) for family in ("verify", "write") for name in cc.FAMILIES[family].instantiations()]
        cc._compile_in_parallel(0, variants)
        assert sorted((f, n) for f, n, _ in built) == sorted(variants)
        assert all(thread.startswith("kvcanary-warmup") for _, _, thread in built)

        def broken(family, name):
            raise RuntimeError(f"kv-canary: {family} failed to compile")

        monkeypatch.setattr(cc, "_module", broken)
        with pytest.raises(RuntimeError, match="verify failed to compile"):
            cc._compile_in_parallel(0, variants[:3])
