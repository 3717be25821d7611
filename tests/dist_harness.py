"""Real torch.distributed runs of CanarySession for tests/test_distributed.py.

:func:`run_ranks` spawns ``world_size`` processes (``torch.multiprocessing``) that join one
process group on 127.0.0.1 and run :func:`rank_main`: every scenario of :data:`SCENARIOS` in
turn, each on a group of its own, writing what each rank saw to ``<out>/rank<r>.json``.  A run
that does not finish within its timeout is killed and reported as hung (a test fails, CI never
hangs).  ``array`` picks the session's arrays: "numpy" or "torch_cpu" over gloo, "cupy" or
"torch_cuda" over NCCL (rank r on cuda:r).
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from datetime import timedelta

import numpy as np

FAULT_STEP = 4  # the faulty rank's req_to_token[A, 2] := B's slot from here on (a stale table entry)
MISMATCH_STEP = 3  # the odd rank's model writes other KV bytes for one slot of this step
STEPS = 10
KV_WORDS = 16  # int64 words of KV per slot (128 bytes)
HEALTH_STEP = 3  # the odd rank ends this step without running the canary (a graph replayed without it)
SCENARIOS = ("agreement", "clean", "fault", "fault_every_3", "fault_callable", "fault_log", "health", "replicated",
             "table_shape", "default_group", "metrics")
GPU_ARRAYS = ("cupy", "torch_cuda")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world_size: int, array: str, out_dir: str, *, scenarios=SCENARIOS, timeout: float = 240.0) -> list:
    """Spawn the ranks, wait at most ``timeout`` seconds, return each rank's results (rank order).

    Raises TimeoutError when a rank is still running then (the ranks are killed first) and
    RuntimeError naming the rank when one failed.
    """
    spawn(_entry, (world_size, array, free_port(), out_dir, tuple(scenarios)), world_size, timeout,
          f"{world_size} {array} ranks")
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world_size)]


def spawn(entry, args: tuple, nprocs: int, timeout: float, what: str) -> None:
    """Run ``entry(rank, *args)`` in ``nprocs`` spawned processes and wait for them; a TimeoutError
    naming ``what`` when one still runs at ``timeout`` (every one is killed first)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(entry, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{what} did not finish within {timeout} s (a hang)")


def _entry(rank: int, world_size: int, array: str, port: int, out_dir: str, scenarios) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gpu = array in GPU_ARRAYS
    if gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    results = {}
    try:
        for name in scenarios:
            group = dist.new_group(backend="nccl" if gpu else "gloo")
            try:
                results[name] = globals()[f"scenario_{name}"](Rank(rank, world_size, array, group))
            except Exception:  # recorded: the test names the rank and the scenario
                results[name] = {"crashed": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


class Rank:
    """One rank's view: its arrays' framework and its dedicated group."""

    def __init__(self, rank, world_size, array, group):
        self.rank, self.world_size, self.array, self.group = rank, world_size, array, group
        self.odd = world_size - 1  # the rank the faults go to

    def asarray(self, a):
        if self.array == "numpy":
            return np.array(a, copy=True)
        import torch

        if self.array == "torch_cpu":
            return torch.from_numpy(np.array(a, copy=True))
        if self.array == "torch_cuda":
            return torch.from_numpy(np.array(a, copy=True)).cuda(self.rank)
        import cupy

        with cupy.cuda.Device(self.rank):
            return cupy.asarray(a)

    def to_numpy(self, x):
        if self.array == "numpy":
            return np.asarray(x)
        if self.array in ("torch_cpu", "torch_cuda"):
            return x.detach().cpu().numpy()
        import cupy

        return cupy.asnumpy(x)

    def session(self, engine, **kw):
        import kvcanary_cupy as kc

        kw.setdefault("max_batch_size", engine.bs)
        kw.setdefault("process_group", self.group)
        return kc.CanarySession(engine.num_slots, like=self.asarray(np.zeros(1, np.int32)), **kw)

    def step(self, session, arrays, table, before_post=None):
        a = {k: self.asarray(v) for k, v in arrays.items()}
        session.pre_forward(a["rp"], a["prefix"], a["extend"], self.asarray(table), a["ids"], a["pos"], a["loc"])
        if before_post is not None:
            before_post(arrays)
        session.post_forward()
        if self.array in GPU_ARRAYS:  # the device done with the step: "one step late" is then exact
            import cupy

            cupy.cuda.Device(self.rank).synchronize()
        session.end_step()


def _engine(seed=0, **kw):
    from session_engine import ToyEngine

    return ToyEngine(seed=seed, **kw)


def _schedule():
    from session_engine import schedule

    return schedule(STEPS)


def _loop(r: Rank, session, engine, *, fault=False, before_post=None):
    """STEPS steps; the faulty rank's table goes stale at FAULT_STEP.  Returns the errors raised, by step."""
    import kvcanary_cupy as kc

    raised = []
    for step, rows in enumerate(_schedule()):
        arrays = engine.step(rows)
        if fault and r.rank == r.odd and step == FAULT_STEP:
            engine.rtt[1, 2] = engine.rtt[2, 4]
        try:
            r.step(session, arrays, engine.rtt, before_post=None if before_post is None else (lambda a, s=step: before_post(s, a)))
        except kc.CanaryViolationError as exc:
            raised.append(_error(step, exc))
    try:
        session.check()
    except kc.CanaryViolationError as exc:
        raised.append(_error("check", exc))
    return raised


def _error(step, exc) -> dict:
    report = exc.report
    return dict(step=step, message=str(exc), ranks=list(report.ranks),
                violations=[v.to_dict() for v in report.violations],
                mismatches=[m.to_dict() for m in report.replica_mismatches])


def _totals(session) -> dict:
    s = session.stats
    return dict(stats={k: v for k, v in s.items()}, totals=session.distributed.totals,
                per_rank=list(session.distributed.per_rank), reducer=dict(session.distributed.stats))


def scenario_agreement(r: Rank) -> dict:
    """The odd rank's canary is smaller, then its KV pool larger: every rank refuses at start."""
    import kvcanary_cupy as kc

    out = {}
    engine = _engine(num_slots=512 if r.rank != r.odd else 256)
    try:
        r.session(engine)
        out["canary"] = None
    except ValueError as exc:
        out["canary"] = str(exc)
    engine = _engine()
    kv = r.asarray(np.zeros((512 if r.rank != r.odd else 640, KV_WORDS), np.int64))
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=8 * KV_WORDS, read_bytes=8 * KV_WORDS)
    try:
        r.session(engine, real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
        out["pool"] = None
    except ValueError as exc:
        out["pool"] = str(exc)
    return out


def scenario_clean(r: Rank) -> dict:
    """Each rank's own pool shard (its own slot allocation), the same schedule: nothing raised."""
    engine = _engine(seed=r.rank)
    session = r.session(engine, on_violation="raise")
    raised = _loop(r, session, engine)
    return dict(raised=raised, **_totals(session))


def scenario_fault(r: Rank, reduce_every=1) -> dict:
    engine = _engine(seed=r.rank)
    session = r.session(engine, on_violation="raise", reduce_every=reduce_every)
    raised = _loop(r, session, engine, fault=True)
    gathered = session.gather_report(dst=0)
    return dict(raised=raised, gathered=None if gathered is None else json.loads(gathered.to_json()),
                device=session.distributed.device, **_totals(session))


def scenario_fault_every_3(r: Rank) -> dict:
    return scenario_fault(r, reduce_every=3)


def scenario_fault_callable(r: Rank) -> dict:
    """A callable policy: called on every rank, on the same step, with the verdict's ranks."""
    engine = _engine(seed=r.rank)
    calls = []
    session = r.session(engine, on_violation=lambda report: calls.append(
        dict(step=session.stats["steps"] - 1, ranks=list(report.ranks), violations=len(report.violations))))
    _loop(r, session, engine, fault=True)
    return dict(calls=calls)


def scenario_fault_log(r: Rank) -> dict:
    """The log policy: the faulty rank logs its violations, every rank one line naming the ranks."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
    logger = logging.getLogger("kvcanary_cupy")
    logger.addHandler(handler)
    try:
        engine = _engine(seed=r.rank)
        session = r.session(engine, on_violation="log")
        _loop(r, session, engine, fault=True)
    finally:
        logger.removeHandler(handler)
    return dict(records=records)


def scenario_health(r: Rank) -> dict:
    """The odd rank ends HEALTH_STEP without the canary's kernels: every rank raises CanaryHealthError."""
    import kvcanary_cupy as kc

    engine = _engine(seed=r.rank)
    session = r.session(engine, on_violation="raise")
    raised = []
    for step, rows in enumerate(_schedule()):
        try:
            if r.rank == r.odd and step == HEALTH_STEP:
                session.end_step()  # the step's model ran, the canary's launches did not
            else:
                r.step(session, engine.step(rows), engine.rtt)
        except kc.CanaryHealthError as exc:
            raised.append(dict(step=step, message=str(exc)))
    session.check()
    return dict(raised=raised)


def scenario_replicated(r: Rank) -> dict:
    """Replicated KV (the same engine and bytes on every rank); the odd rank's model writes other
    bytes for one slot at MISMATCH_STEP, before the TAIL write fingerprints them (its own canary
    cannot see it)."""
    import kvcanary_cupy as kc

    engine = _engine(seed=0)
    kv = r.asarray(np.zeros((engine.num_slots, KV_WORDS), np.int64))
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=8 * KV_WORDS, read_bytes=8 * KV_WORDS)
    session = r.session(engine, on_violation="raise", replicated_kv=True, real_kv_sources=(source,),
                        real_kv_hash_mode=kc.RealKvHashMode.ALL)
    target = {}

    def model_writes_kv(step, arrays):
        n = int(np.count_nonzero(arrays["loc"]))
        loc, ids = arrays["loc"][:n], arrays["ids"][:n]
        values = np.repeat(ids[:, None], KV_WORDS, axis=1) * 7 + np.arange(KV_WORDS)
        if step == MISMATCH_STEP:
            target["slot"] = int(loc[0])
            if r.rank == r.odd:
                values[0, 5] ^= 1 << 40  # a bit flip while the KV was computed
        kv[r.asarray(loc)] = r.asarray(values)

    raised = _loop(r, session, engine, before_post=model_writes_kv)
    own_hash = int(r.to_numpy(session.tail_canary)[target["slot"], kc.CANARY_FIELD_REAL_KV_HASH])
    return dict(raised=raised, slot=target["slot"], own_hash=kc.to_unsigned(own_hash), local=session.report().to_dicts(),
                **_totals(session))


def scenario_table_shape(r: Rank) -> dict:
    """The odd rank's table is narrower: refused at the first reduction, on every rank."""
    engine = _engine(max_len=64 if r.rank != r.odd else 48)
    session = r.session(engine)
    try:
        for step, rows in enumerate(_schedule()[:3]):
            r.step(session, engine.step(rows), engine.rtt)
    except ValueError as exc:
        return {"error": str(exc), "step": step}
    return {"error": None}


def scenario_hang(r: Rank) -> dict:
    """Only for the harness's own test: the odd rank never reaches the collective its peers wait in."""
    if r.rank == r.odd:
        time.sleep(3600)
    import torch.distributed as dist

    dist.barrier(group=r.group)
    return {}


def scenario_default_group(r: Rank) -> dict:
    import torch.distributed as dist

    engine = _engine()
    try:
        r.session(engine, process_group=dist.group.WORLD)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    session = r.session(engine, process_group=dist.group.WORLD, allow_default_group=True)
    r.step(session, engine.step([1, 2]), engine.rtt)
    session.check()
    return {"refused": refused, "steps": session.distributed.totals["steps"]}


def scenario_metrics(r: Rank) -> dict:
    """Each rank's SessionMetrics, labelled with its rank in the group by default."""
    try:
        import prometheus_client
    except ImportError:
        return {"prometheus_client": False}
    import kvcanary_cupy as kc

    registry = prometheus_client.CollectorRegistry()
    engine = _engine(seed=r.rank)
    session = r.session(engine)
    kc.metrics.SessionMetrics(session, registry=registry)
    for rows in _schedule()[:3]:
        r.step(session, engine.step(rows), engine.rtt)
    session.check()
    value = lambda name: registry.get_sample_value(name, {"rank": str(r.rank)})
    return {"prometheus_client": True, "steps": value("kvcanary_steps_total"),
            "heartbeat": value("kvcanary_last_handled_step"), "verified": value("kvcanary_verified_entries_total"),
            "stats_verified": session.stats["verified_entries"]}



def _reducer_threads() -> list:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("kvcanary-reduce")]


def scenario_lifecycle(r: Rank) -> dict:
    """The worker thread: started by the first reduction, stopped by close() (after which a
    reduction is refused) and by dropping the session; none left behind."""
    import gc

    import kvcanary_cupy as kc

    out = {"before": _reducer_threads()}
    engine = _engine(seed=r.rank)
    session = r.session(engine)
    out["thread_at_start"] = session.distributed.worker_thread is not None
    for rows in _schedule()[:3]:
        r.step(session, engine.step(rows), engine.rtt)
    session.check()
    thread = session.distributed.worker_thread
    out["running"] = (thread.name, thread.daemon, thread.is_alive(), _reducer_threads())
    session.close()
    session.close()  # idempotent
    out["after_close"] = (thread.is_alive(), _reducer_threads())
    try:
        r.step(session, engine.step(_schedule()[3]), engine.rtt)
        out["refused"] = None
    except kc.CanaryUsageError as exc:
        out["refused"] = str(exc)
    engine = _engine(seed=r.rank)
    session = r.session(engine)
    for rows in _schedule()[:2]:
        r.step(session, engine.step(rows), engine.rtt)
    session.check()
    thread = session.distributed.worker_thread
    del session
    gc.collect()
    thread.join(10)
    out["after_drop"] = (thread.is_alive(), _reducer_threads())
    return out


STOP_STEP = 2  # the odd rank of scenario_peer_stops ends no step from here on
PEER_TIMEOUT_S = 3


def scenario_peer_stops(r: Rank) -> dict:
    """The odd rank stops calling end_step after STOP_STEP steps: its peers' reduction of that step
    fails at the group's timeout on their worker threads, and their next end_step raises a
    RuntimeError naming the reduction (no hang); close() then leaves no thread."""
    import torch.distributed as dist

    group = dist.new_group(backend="nccl" if r.array in GPU_ARRAYS else "gloo", timeout=timedelta(seconds=PEER_TIMEOUT_S))
    if r.world_size == 1:
        return {"world_size": 1}
    r = Rank(r.rank, r.world_size, r.array, group)
    engine = _engine(seed=r.rank)
    session = r.session(engine)
    out = {"error": None}
    started = time.monotonic()
    for step, rows in enumerate(_schedule()):
        if r.rank == r.odd and step == STOP_STEP:
            break
        try:
            r.step(session, engine.step(rows), engine.rtt)
        except RuntimeError as exc:
            out.update(error=str(exc), step=step, cause=type(exc.__cause__).__name__, seconds=time.monotonic() - started)
            break
    thread = session.distributed.worker_thread
    session.close()
    out["after_close"] = (thread.is_alive(), _reducer_threads())
    return out
