"""A session stepped by one thread while another reads report() / stats and calls check(): nothing
counted twice or lost, on every backend (docs/guide.md, "Threads")."""

import threading

import numpy as np

import kvcanary_cupy as kc
from canary_builders import a64

STEPS = 60


def _run(ab, reader_thread: bool):
    """STEPS steps of one request; after each step from the second on, the record just written is spoiled
    (its position), so later steps' HEAD verifies report it.  With ``reader_thread``, another thread calls
    check(), report() and stats throughout.  Returns (stats, report rows, reader snapshots, reader errors)."""
    session = kc.CanarySession(256, max_batch_size=2, like=ab.like, on_violation="ignore", overlap_head_write=False)
    rtt = np.zeros((2, 128), np.int32)
    rtt[1] = np.arange(1, 129)
    table = ab.asarray(rtt)
    stop, seen, errors = threading.Event(), [], []

    def reader():
        try:
            while not stop.is_set():
                session.check()
                s = session.stats
                seen.append((s["steps"], s["rows_read"], len(session.report().violations)))
        except Exception as exc:  # surfaced in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=reader) if reader_thread else None
    if thread is not None:
        thread.start()
    try:
        for step in range(STEPS):
            session.pre_forward(a64(ab, [1]), a64(ab, [step]), a64(ab, [1]), table, a64(ab, [100 + step]),
                                a64(ab, [step]), a64(ab, [step + 1]))
            session.post_forward()
            session.end_step()
            if step >= 1:
                session.head_canary[step + 1, 1] += 1000
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    session.check()
    rows = [(v.slot_idx, v.position, v.reasons, v.repeats, v.first_step, v.last_step) for v in session.report().violations]
    return session.stats, rows, seen, errors


def test_check_report_and_stats_from_another_thread_while_the_loop_runs(ab):
    """The same steps with a thread calling check(), report() and stats throughout count exactly what a
    single thread counts: every step handled once, no row counted twice or lost."""
    alone, alone_rows, _, _ = _run(ab, reader_thread=False)
    stats, rows, seen, errors = _run(ab, reader_thread=True)
    assert errors == []
    assert alone["steps"] == STEPS and alone["violations"] > STEPS  # spoiled records are read again and again
    assert stats == alone and rows == alone_rows
    steps = [x[0] for x in seen]
    assert seen and steps == sorted(steps)  # the reader's snapshots never go back
